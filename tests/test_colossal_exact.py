"""``colossal`` (Ring Self-Attention, ZeRO-3 weights) against stock megatron-core with TP=1.

One reference world (1 rank: stock TP=1, then the plugin's own p=1 colossal path on the same
weights) and one world each at p=2 and p=4; every world runs all its cases in one spawn.
Loss, logits and every parameter gradient (gathered to its TP=1 shape) must match the stock
TP=1 model built from the same seed to a relative error below 1e-5.
"""
from __future__ import annotations

import pytest

from megatron_paradyse.testing.spawn import run_world

from .exactness import assert_exact, run_cases

MHA_GELU = dict()
GQA_SWIGLU = dict(swiglu=True, num_query_groups=2, bias=False)
MQA_GELU_NOBIAS = dict(num_query_groups=1, bias=False)
MHA_SWIGLU_BIAS = dict(swiglu=True, num_layers=3)

# (spec kwargs, batch, seq, plan); seq / p is odd or not a power of two in most cases
CASES = {
    2: [
        (MHA_GELU, 2, 24, "colossal"),
        (GQA_SWIGLU, 1, 30, "colossal"),
        (MQA_GELU_NOBIAS, 2, 30, ["colossal", "ring"]),
        (MHA_SWIGLU_BIAS, 1, 36, ["tp_sp", "colossal", "ulysses"]),
    ],
    4: [
        (MHA_GELU, 2, 24, ["colossal", "ring"]),
        (GQA_SWIGLU, 1, 36, "colossal"),
        (MQA_GELU_NOBIAS, 2, 20, "colossal"),
        (MHA_SWIGLU_BIAS, 1, 36, ["colossal", "tp_sp", "colossal"]),
    ],
}
KEYS = sorted({(tuple(sorted(kw.items())), b, s) for p in (2, 4) for kw, b, s, _ in CASES[p]})


@pytest.fixture(scope="module")
def reference():
    """Per case key: (stock TP=1 result, the plugin's p=1 colossal result on the same model)."""
    cases = [(dict(kw), [(None, b, s, 5), ("colossal", b, s, 5)]) for kw, b, s in KEYS]
    res = run_world(run_cases, 1, cases, timeout=300)[0]
    return dict(zip(KEYS, res))


def test_colossal_p1_matches_stock(reference):
    for key, (stock, p1) in reference.items():
        assert_exact(p1, stock, f"p=1 {key}")


@pytest.mark.parametrize("p", [2, 4])
def test_colossal_matches_stock_tp1(reference, p):
    cases = [(kw, [(plan, b, s, 5)]) for kw, b, s, plan in CASES[p]]
    results = run_world(run_cases, p, cases, timeout=300)[0]
    for (kw, b, s, plan), (res,) in zip(CASES[p], results):
        stock, _ = reference[(tuple(sorted(kw.items())), b, s)]
        errs = assert_exact(res, stock, f"p={p} {kw} b={b} s={s} plan={plan}")
        print(f"p={p} {kw} b={b} s={s} plan={plan}: {errs}")
