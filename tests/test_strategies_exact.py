"""Every strategy and random mixed plans equal stock megatron-core TP=1 (fp32, rel. error < 1e-5).

One reference world (stock TP=1, one process) and one world per group size p run the same
batches; each model also runs several passes in a row with different plans.
"""
import random

import pytest

import megatron_paradyse as mp
from megatron_paradyse.testing.spawn import run_world

from .exactness import assert_exact, run_cases, stock

ALL = ("tp_sp", "ulysses", "ring", "colossal", "metp")

# (spec, batch, seq): MHA and GQA (fewer KV groups than p too), GELU and SwiGLU, bias on/off,
# b = 1 and 2, sequence lengths that are not powers of two. Every plugin pass at p > 1 also
# checks that each layer ran its planned strategy (tests/exactness.py: check_strategies_ran).
# Two cases use megatron's fused bias-activation kernels (stock and plugin alike), one the unfused path.
FUSED = {"config": {"bias_activation_fusion": True}}
CASES = [
    (dict(num_layers=3, hidden_size=64, num_attention_heads=4, bias=True, **FUSED), 2, 36),
    (dict(num_layers=3, hidden_size=64, num_attention_heads=8, num_query_groups=4, swiglu=True,
          bias=False), 1, 28),
    (dict(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2, swiglu=True,
          bias=True, ffn_hidden_size=80, **FUSED), 2, 20),
]


def _plans(spec_kw, p, rng):
    from megatron_paradyse.testing.models import TinyGPT

    cfg = TinyGPT(**{k: v for k, v in spec_kw.items() if k != "config"}).transformer_config(p, True)
    usable = [s for s in mp.STRATEGIES if mp.supports(s, cfg, p)[0]]
    mixed = [[rng.choice(usable) for _ in range(spec_kw["num_layers"])] for _ in range(3)]
    return usable + mixed


def _matrix(p):
    rng = random.Random(1000 + p)
    cases = []
    for i, (spec_kw, batch, seq) in enumerate(CASES):
        plans = _plans(spec_kw, p, rng)
        cases.append((spec_kw, [(plan, batch, seq, 17 * i + j) for j, plan in enumerate(plans)]))
    return cases


def test_registry_has_the_five_strategies():
    assert mp.STRATEGIES == ALL


@pytest.mark.parametrize("p", [2, 4])
def test_every_strategy_and_mixed_plans_match_stock_tp1(p):
    cases = _matrix(p)
    ref = run_world(run_cases, 1, stock(cases), timeout=300)[0]
    got = run_world(run_cases, p, cases, timeout=600, trace=True)[0]  # NCCL's ordering rule checked too
    covered = set()
    worst = 0.0
    for (spec_kw, passes), ref_case, got_case in zip(cases, ref, got):
        for (plan, batch, seq, _), r, g in zip(passes, ref_case, got_case):
            errs = assert_exact(g, r, f"p={p} {spec_kw} b={batch} s={seq} plan={plan}")
            worst = max(worst, errs["loss"], errs["logits"], errs["grad"])
            covered.update([plan] if isinstance(plan, str) else plan)
    assert covered == set(mp.STRATEGIES)
    print(f"p={p}: {sum(len(c[1]) for c in cases)} passes, worst rel. error {worst:.2e}")
