"""The cost models on packs (``PackShape``): one document equals one sequence in time, the
analytic pack memory equals the tracker's difference to one sequence, the profiler's packs are
deterministic."""
from __future__ import annotations

import pytest

from megatron_paradyse.costmodel import AnalyticCostModel, build_cost_model, demo_shape
from megatron_paradyse.costmodel import analytic
from megatron_paradyse.costmodel.packs import geometry, random_packs
from megatron_paradyse.parallel.packing import PackShape

STRATEGIES = ("tp_sp", "ulysses", "ring", "colossal", "metp")
PACKS = [PackShape((100, 300, 624)), PackShape((16,) * 64), PackShape((1000, 24))]


def test_random_packs_are_deterministic_and_exact():
    a, b = random_packs([512, 1024], 3, seed=0, p=2), random_packs([512, 1024], 3, seed=0, p=2)
    assert a == b and [x.tokens for x in a] == [512] * 3 + [1024] * 3
    assert random_packs([512], 3, seed=1) != a[:3]
    assert max(a[2].lengths) >= 256 and max(a[0].lengths) <= 128  # one long among short; many short


@pytest.mark.parametrize("p", [2, 4])
def test_one_document_is_one_sequence_in_time(p):
    shape = demo_shape(p)
    for st in STRATEGIES:
        for s in (256, 1024):
            one, pk = analytic.time_features(st, shape, s, 1), analytic.time_features(st, shape, PackShape((s,)), 1)
            assert pk["pack"] == 1.0 and pk["pack_calls"] == 0.0 and one["pack"] == 0.0
            for k in one:
                if k not in analytic.PACK_FEATURES and not k.startswith(("bytes:p2p", "comm:p2p", "messages")):
                    assert pk[k] == pytest.approx(one[k], rel=1e-12), (st, s, k)


def test_pack_attention_and_calls():
    shape = demo_shape(2)
    pk = PackShape((16,) * 64)
    f1, fp = analytic.time_features("tp_sp", shape, 1024, 1), analytic.time_features("tp_sp", shape, pk, 1)
    assert fp["attn_flops"] == pytest.approx(f1["attn_flops"] * 64 * 16 * 17 / (1024 * 1025))
    assert fp["pack_calls"] == 63 and fp["gemm_flops"] == f1["gemm_flops"]
    # nothing crosses a rank: no ring hop, no re-layout
    assert analytic.time_features("ring", shape, pk, 1)["bytes:p2p"] == 0.0
    g = geometry(PackShape((100, 300, 624)), 2)
    assert g.count == 712 and g.tokens == 1024
    assert geometry(PackShape((72, 900, 31)), 2).tokens == 1004  # padded to a multiple of p


def test_models_take_packs_with_b_1_only():
    for cm in (AnalyticCostModel(demo_shape(2)), build_cost_model(demo_shape(2))):
        for st in STRATEGIES:
            c = cm.layer(st, PackShape((72, 900, 31)), 1)
            assert c.seconds > 0 and c.saved_bytes > 0
        with pytest.raises(ValueError, match="b must be 1"):
            cm.layer("tp_sp", PackShape((8, 8)), 2)
        assert cm.nonlayer(PackShape((72, 900, 31)), 1) == cm.nonlayer(1004, 1)
        assert cm.step(("ring",) * 4, PackShape((512, 512)), 1).peak_bytes < cm.step(("ring",) * 4, 1024, 1).peak_bytes


def _measure(rank, world):
    from megatron_paradyse.costmodel import measure as M
    from megatron_paradyse.costmodel.shape import ModelShape

    shape = ModelShape(**demo_shape(world).key())
    _, model = M.build(shape, num_layers=1, max_seq=2048)
    runner = M.LayerRunner(model, shape)
    out = {}
    for st in STRATEGIES:
        M.set_strategy(model, st)
        for s in [1024] + PACKS:
            out[(st, s)] = runner.memory("layer", s, 1) + (sum(runner.pool(s, 1).values()),)
    return out


def test_analytic_pack_memory_equals_the_tracker():
    """Saved bytes: the analytic difference a pack makes to one sequence of its length equals
    the tracker's (largest rank); the pool is never under the measured one."""
    from megatron_paradyse.costmodel.ranks import run_ranks

    per_rank = run_ranks(_measure, 2, timeout=600)
    cm = AnalyticCostModel(demo_shape(2))
    for st in STRATEGIES:
        one = max(r[(st, 1024)][0] for r in per_rank)
        for pk in PACKS:
            got = max(r[(st, pk)][0] for r in per_rank) - one
            want = cm.layer(st, pk, 1).saved_bytes - cm.layer(st, 1024, 1).saved_bytes
            assert got == pytest.approx(want, abs=0.01 * one), (st, pk)
            pool = max(r[(st, pk)][2] for r in per_rank)
            assert pool <= sum(cm.pool(st, pk, 1).values()) <= pool * 1.25 + 1, (st, pk)
