"""bf16 parameters: every strategy stays as close to stock TP=1 as stock megatron TP+SP does.

In bf16 no two parallel layouts agree exactly, so the yardstick is stock megatron-core's own
TP=2 + SP run (plan None) on the same batch: each strategy's error against stock TP=1 must be
within bf16 tolerance and not much worse than that baseline's.
"""
import torch

import megatron_paradyse as mp
from megatron_paradyse.testing.spawn import run_world

from .exactness import run_cases, stock, worst_errors


def test_bf16_strategies_as_close_as_stock_tp_sp():
    spec = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                swiglu=True, params_dtype=torch.bfloat16)
    plans = [None] + list(mp.STRATEGIES) + [["metp", "ring"], ["ulysses", "colossal"]]
    cases = [(spec, [(plan, 2, 32, 7) for plan in plans])]
    ref = run_world(run_cases, 1, stock(cases), timeout=300)[0][0]
    got = run_world(run_cases, 2, cases, timeout=300)[0][0]
    errs = [worst_errors(g, r) for g, r in zip(got, ref)]
    baseline = errs[0]
    for plan, e in zip(plans[1:], errs[1:]):
        assert e["loss"] < 1e-3 and e["logits"] < 2e-2 and e["grad"] < 5e-2, (plan, e)
        for key in ("logits", "grad"):
            assert e[key] <= 2 * baseline[key] + 1e-3, (plan, key, e[key], baseline[key])
