"""Pipeline stages: the stage cost model (``costmodel/stage.py``), the 1F1B simulator
(``costmodel/schedule.py``) against hand-computed schedules, and the pipelined step planner
(``planner/stages.py``) on the analytic and shipped cost models (no spawned world, a few seconds)."""
from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch

from megatron_paradyse.costmodel import AnalyticCostModel, build_cost_model, demo_shape
from megatron_paradyse.costmodel.base import CostModel, LayerCost, plan_counts, union_bytes
from megatron_paradyse.parallel.plans import strategy_of
from megatron_paradyse.planner import (NoFitError, PipelinePlanner, build_planner, make_step_plan_fn,
                                       simulate_1f1b, stage_cost_model)
from megatron_paradyse.costmodel.schedule import one_f_one_b

MiB = 2 ** 20


def megatron_order(r, P, M):
    """The (kind, micro-batch) order of megatron-core's ``forward_backward_pipelining_without_
    interleaving`` on stage r, written as its three loops."""
    warmup = min(P - r - 1, M)
    ops, f, b = [], 0, 0
    for _ in range(warmup):
        ops.append(("F", f))
        f += 1
    for _ in range(M - warmup):
        ops += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    for _ in range(warmup):
        ops.append(("B", b))
        b += 1
    return ops


# ---------------------------------------------------------------- the schedule


def test_one_f_one_b_is_megatrons_order():
    for P in range(1, 6):
        for M in range(1, 9):
            for r in range(P):
                assert [(op.kind, op.mb) for op in one_f_one_b(r, P, M)] == megatron_order(r, P, M), (P, M, r)


@pytest.mark.parametrize("P,M", [(2, 1), (2, 3), (4, 8), (3, 2)])
def test_equal_micro_batches_take_the_textbook_time(P, M):
    """Equal forward f and backward b = 2f everywhere: (M + P - 1) (f + b); stage r holds
    min(P - r, M) micro-batches at once."""
    f, b = 1.0, 2.0
    sch = simulate_1f1b([[f] * M for _ in range(P)], [[b] * M for _ in range(P)])
    assert math.isclose(sch.makespan, (M + P - 1) * (f + b))
    for r in range(P):
        assert max(len(op.in_flight) for op in sch.ops[r]) == min(P - r, M)
        assert math.isclose(sch.busy[r], M * (f + b))
        assert [(op.kind, op.mb) for op in sch.ops[r]] == megatron_order(r, P, M)


def test_uneven_schedule_by_hand():
    """P = 2, M = 2, micro-batch 1 twice as long: stage 0 runs F0 [0,1] F1 [1,3] B0 [4,6]
    B1 [10,14]; stage 1 F0 [1,2] B0 [2,4] F1 [4,6] B1 [6,10]."""
    sch = simulate_1f1b([[1, 2], [1, 2]], [[2, 4], [2, 4]])
    assert [(o.kind, o.mb, o.start, o.end) for o in sch.ops[0]] == [
        ("F", 0, 0, 1), ("F", 1, 1, 3), ("B", 0, 4, 6), ("B", 1, 10, 14)]
    assert [(o.kind, o.mb, o.start, o.end) for o in sch.ops[1]] == [
        ("F", 0, 1, 2), ("B", 0, 2, 4), ("F", 1, 4, 6), ("B", 1, 6, 10)]
    assert sch.makespan == 14 and sch.busy == (9, 9) and sch.ends == (14, 10)
    assert [o.in_flight for o in sch.ops[0]] == [(0,), (0, 1), (0, 1), (1,)]


# ---------------------------------------------------------------- the stage view


class NoShape(CostModel):
    """A cost model without ``shape`` (no parameter counts): stages split static bytes evenly."""

    strategies = ("a",)
    num_layers = 4

    def layer(self, strategy, s, b):
        return LayerCost(1.0, 2.0 * s, 1.0 * s)

    def static_bytes(self):
        return 100.0

    def nonlayer(self, s, b):
        return LayerCost(0.5, 3.0 * s, 1.0 * s)


@pytest.mark.parametrize("cm", [AnalyticCostModel(demo_shape(2)), build_cost_model(demo_shape(4)),
                                AnalyticCostModel(dataclasses.replace(demo_shape(2), num_layers=8, dtype="bf16"))],
                         ids=["analytic", "shipped", "analytic-bf16-L8"])
def test_stages_share_out_the_model(cm):
    """The stages' static bytes and update seconds sum to the model's; stage 0 holds the
    embedding, the last the output layer (the two ends hold more than a middle stage); the
    non-layer part is the last stage's; every stage keeps its input as resident bytes (a
    non-last stage's output sent on is its last layer's, already in that layer's saved bytes)."""
    L = cm.num_layers
    for P in (1, 2, 4):
        st = [stage_cost_model(cm, r, P) for r in range(P)]
        assert math.isclose(sum(m.static_bytes() for m in st), cm.static_bytes(), rel_tol=1e-12)
        assert math.isclose(sum(m.update_seconds() for m in st), cm.update_seconds(), rel_tol=1e-12)
        assert all(m.num_layers == L // P for m in st)
        assert [list(m.layers()) for m in st] == [list(range(r * L // P, (r + 1) * L // P)) for r in range(P)]
        if P > 2:
            assert st[0].static_bytes() > st[1].static_bytes() < st[-1].static_bytes()
        assert st[-1].nonlayer(1024, 1) == cm.nonlayer(1024, 1)
        assert st[-1].pool("nonlayer", 1024, 1) == cm.pool("nonlayer", 1024, 1)
        assert all(m.resident_bytes(1024, 1) == cm.resident_bytes(1024, 1) for m in st)
        for m in st[:-1]:
            assert m.nonlayer(1024, 1) == (0.0, 0.0, 0.0) and m.pool("nonlayer", 1024, 1) == {}
        assert st[0].layer("tp_sp:rc", 1024, 1) == cm.layer("tp_sp:rc", 1024, 1)
    one = stage_cost_model(cm, 0, 1)  # one stage is the model
    assert one.step(("tp_sp",) * L, 1024, 1) == cm.step(("tp_sp",) * L, 1024, 1)


def test_stage_without_shape_splits_evenly():
    st = [stage_cost_model(NoShape(), r, 2) for r in range(2)]
    assert [m.static_bytes() for m in st] == [50.0, 50.0]
    with pytest.raises(ValueError, match="do not split evenly"):
        stage_cost_model(NoShape(), 0, 3)


# ---------------------------------------------------------------- choose under a limit


def test_choose_under_a_limit():
    cm = AnalyticCostModel(demo_shape(2))
    for kind in ("optimal", "heuristic"):
        pl = build_planner(kind, cm, 64 * MiB, margin_bytes=0)
        c = pl.choose(4096, 1)
        assert pl.choose_under(4096, 1, pl.limit) is c and pl.choose_under(4096, 1, 2 * pl.limit) is c
        lim = 0.8 * c.peak_bytes
        u = pl.choose_under(4096, 1, lim)
        assert u.fits and u.peak_bytes <= lim and u.seconds >= c.seconds
        hits = pl.hits
        assert pl.choose_under(4096, 1, lim) is u and pl.hits == hits + 1  # cached by the limit
        assert pl.choose(4096, 1) is c  # the (s, b) entry untouched
        assert not pl.choose_under(4096, 1, 1.0).fits


# ---------------------------------------------------------------- the step planner


def check_peaks(pp, shapes, sp, V=1):
    """Each stage's peak recomputed from the stage cost models alone (``CostModel.step``, the
    pools, the layers' saved bytes) over megatron's op order (with V > 1 its interleaved
    order: each chunk in flight holds its input and 1/V of the rest, the running chunk its
    micro-batch's peak less the other chunks' share of that rest): equal to the planner's.
    Returns them."""
    P, M = pp.num_stages, len(shapes)
    out = []
    for r in range(P):
        m = pp.models[r]
        static = m.static_bytes()

        def pool(j):
            s, b = shapes[j]
            return [m.pool(strategy_of(e), s, b) for e in set(sp.stage_plans[r][j].layers)] + [m.pool("nonlayer", s, b)]

        def held(j):
            s, b = shapes[j]
            return (m.resident_bytes(s, b) + m.nonlayer(s, b).saved_bytes
                    + sum(m.layer(e, s, b).saved_bytes for e in sp.stage_plans[r][j].layers))

        def act(j):
            s, b = shapes[j]
            layers = sp.stage_plans[r][j].layers  # the heuristic plans with the order-free bound
            plan = layers if pp.stages[r].order == "ordered" else plan_counts(layers)
            return m.step(plan, s, b).peak_bytes - static - union_bytes(pool(j))

        def chunk_held(j):
            s, b = shapes[j]
            return m.resident_bytes(s, b) + (held(j) - m.resident_bytes(s, b)) / V

        def own(j):
            s, b = shapes[j]
            return act(j) if V == 1 else act(j) - (V - 1) * (held(j) - m.resident_bytes(s, b)) / V

        live, peak = set(), 0.0
        order = ([(kind, k, 0) for kind, k in megatron_order(r, P, M)] if V == 1 else
                 megatron_interleaved_order(r, P, M, V, P if M % P == 0 else M))
        for kind, k, c in order:
            j = sp.order[k]
            live.add((c, j))
            mbs = {i for _, i in live}
            rest = held if V == 1 else chunk_held
            peak = max(peak, static + union_bytes([d for i in mbs for d in pool(i)]) + own(j)
                       + sum(rest(i) for ci, i in live if (ci, i) != (c, j)))
            if kind == "B":
                live.discard((c, j))
        out.append(peak)
    for a, b in zip(out, sp.stage_peaks):
        assert math.isclose(a, b, rel_tol=1e-9), (out, sp.stage_peaks)
    return out


def analytic_l8():
    return AnalyticCostModel(dataclasses.replace(demo_shape(2), num_layers=8))


def test_one_stage_is_the_planner():
    """P = 1: every micro-batch gets the plain planner's plan, the peak is the largest of theirs."""
    cm = AnalyticCostModel(demo_shape(2))
    pl = build_planner("optimal", cm, 64 * MiB)
    pp = PipelinePlanner("optimal", cm, 64 * MiB, 1, reorder=False)
    shapes = [(4096, 1), (1024, 2), (2048, 1)]
    sp = pp.plan_step(shapes)
    assert sp.fits and sp.plans == tuple(pl.choose(s, b).layers for s, b in shapes)
    assert math.isclose(sp.stage_peaks[0], max(pl.choose(s, b).peak_bytes for s, b in shapes))
    assert math.isclose(sp.seconds, sum(pl.choose(s, b).seconds for s, b in shapes) + pl.update_seconds())
    check_peaks(pp, shapes, sp)


@pytest.mark.parametrize("kind", ["optimal", "heuristic"])
def test_in_flight_micro_batches_are_tightened(kind):
    """Each micro-batch alone fits its stage with its fastest plan, the two in flight on stage 0
    do not: the planner switches some to leaner plans, and the peaks it predicts (recomputed
    here from the cost model) are within the limits."""
    cm = analytic_l8()
    P, shapes = 2, [(4096, 1)] * 4
    s0 = build_planner(kind, stage_cost_model(cm, 0, P), 1e12, margin_bytes=0)
    fast = s0.choose(4096, 1)
    budget = 1.3 * fast.peak_bytes
    pp = PipelinePlanner(kind, cm, budget, P, margin_bytes=0, reorder=False)
    assert all(pl.choose(4096, 1).fits for pl in pp.stages)  # each alone fits
    untightened = PipelinePlanner(kind, cm, 1e12, P, margin_bytes=0, reorder=False).plan_step(shapes)
    assert untightened.stage_peaks[0] > budget  # the fastest plans in flight together do not
    sp = pp.plan_step(shapes)
    assert sp.fits and sp.message == ""
    peaks = check_peaks(pp, shapes, sp)
    assert all(p <= lim for p, lim in zip(peaks, sp.stage_limits))
    assert any(c.layers != fast.layers for c in sp.stage_plans[0])  # tightened
    assert sp.seconds > untightened.seconds
    assert all(len(p) == cm.num_layers for p in sp.plans)
    assert sp.plans[0] == sp.stage_plans[0][0].layers + sp.stage_plans[1][0].layers


def test_tightening_on_four_stages_with_packs_and_recompute():
    """Four stages, mixed lengths, a pack: every fitting answer is within its limits by the
    cost model's own numbers, and a tighter budget gives a slower (never faster) step."""
    cm = analytic_l8()
    from megatron_paradyse.parallel.packing import PackShape
    shapes = [(4096, 1), (1024, 1), (PackShape((900, 2000, 148)), 1), (512, 2), (3072, 1), (2048, 1)]
    last = 0.0
    for budget in (1e12, 120 * MiB, 90 * MiB, 75 * MiB):
        pp = PipelinePlanner("optimal", cm, budget, 4)
        sp = pp.plan_step(shapes)
        assert sp.fits, sp.message
        peaks = check_peaks(pp, shapes, sp)
        assert all(p <= lim * (1 + 1e-12) for p, lim in zip(peaks, sp.stage_limits))
        assert sorted(sp.order) == list(range(len(shapes)))
        assert sp.seconds >= last * (1 - 1e-12)
        last = sp.seconds
    assert any(":rc" in e for p in sp.plans for e in p)  # recompute among the leaner plans


def test_nothing_fits_names_stage_and_micro_batches():
    cm = analytic_l8()
    shapes = [(8192, 1), (8192, 1), (1024, 1)]
    floor = build_planner("optimal", stage_cost_model(cm, 0, 2), 1e12).leanest(8192, 1)[2]  # each alone fits
    pp = PipelinePlanner("optimal", cm, 1.05 * floor, 2, margin_bytes=0, reorder=False)
    sp = pp.plan_step(shapes)
    assert not sp.fits and sp.offenders == (0, 1)
    assert sp.message.startswith("stage 0 of 2: micro-batches 0, 1 (lengths 8192, 8192) in flight need ")
    assert "> limit" in sp.message and "budget" in sp.message and "margin" in sp.message
    # three long ones: no run order keeps two apart (with the short one, one does)
    assert PipelinePlanner("optimal", cm, 1.05 * floor, 2, margin_bytes=0).plan_step(shapes).fits
    longs = PipelinePlanner("optimal", cm, 1.05 * floor, 2, margin_bytes=0).plan_step([(8192, 1)] * 3)
    assert not longs.fits and "(and in 1 other run orders)" in longs.message
    # one micro-batch that fits no stage alone
    tiny = PipelinePlanner("optimal", cm, 4 * MiB, 2).plan_step(shapes)
    assert not tiny.fits and tiny.message.startswith("stage 0 of 2: micro-batch 0 (length 8192) alone: nothing fits")
    text = pp.explain_step(shapes)
    assert "does not fit: stage 0 of 2" in text and "OVER" in text


def test_reorder_spreads_long_micro_batches():
    """long, long, short, short on two stages: stage 0 holds two at once; alternating long and
    short lowers its peak, and where the given order does not fit, reordering does."""
    cm = build_cost_model(demo_shape(2))  # the shipped fitted model
    shapes = [(8192, 1), (8192, 1), (1024, 1), (1024, 1)]
    free = PipelinePlanner("optimal", cm, 1e12, 2)
    given = free.plan_step(shapes, reorder=False)
    spread = free.plan_step([shapes[j] for j in (0, 2, 1, 3)], reorder=False)
    assert spread.stage_peaks[0] < 0.8 * given.stage_peaks[0]
    # p = 2: stage 0 (two in flight) binds from about 55.5 to 59 MiB (at p = 4 the last stage's
    # one 8192 binds first, now that the stage output is not counted twice)
    budget = 57 * 2 ** 20
    tight = PipelinePlanner("optimal", cm, budget, 2)
    assert not tight.plan_step(shapes, reorder=False).fits
    sp = tight.plan_step(shapes)
    assert sp.fits and abs(sp.order.index(0) - sp.order.index(1)) > 1  # the long ones apart
    assert all(p <= lim for p, lim in zip(check_peaks(tight, shapes, sp), sp.stage_limits))
    assert f"run order {', '.join(map(str, sp.order))};" in tight.explain_step(shapes)


class PerToken(CostModel):
    """Layers priced per token: ``{strategy: (seconds, saved, transient)}`` per token of ``s``;
    no static bytes, no non-layer part, no pools (a stage's memory is its layers')."""

    def __init__(self, per_token: dict, num_layers: int):
        self.per_token, self.num_layers = dict(per_token), int(num_layers)
        self.strategies = tuple(per_token)

    def layer(self, strategy, s, b):
        t, m, x = self.per_token[strategy]
        return LayerCost(t * s * b, m * s * b, x * s * b)

    def static_bytes(self):
        return 0.0


def test_held_bytes_tightening():
    """Two stages of two layers, two micro-batches of 1000 tokens: ``fast`` (1 s, saves 2,
    transient 2 per token) or ``lean`` (3 s, saves 1, transient 3). Alone on stage 0,
    fast*2 peaks at 6000 bytes, lean*1+fast*1 (lean first) at 5000 and lean*2 also at 5000,
    the leanest uniform plan's: from there no plan has a lower peak, but lean*2 keeps 2000
    bytes from forward to backward instead of 3000. Stage 0 holds both micro-batches while
    one runs: 5000 + 3000 is over the 7000-byte limit, 5000 + 2000 is not. Only tightening
    by held bytes finds it (without it the step does not fit); the peaks, recomputed from
    the cost model, are within the limits."""
    cm = PerToken({"fast": (1.0, 2.0, 2.0), "lean": (3.0, 1.0, 3.0)}, 4)
    shapes = [(1000, 1)] * 2
    pp = PipelinePlanner("optimal", cm, 7000.0, 2, margin_bytes=0, recompute="off")
    st = pp.stages[0]
    assert st.choose(1000, 1).layers == ("fast", "fast") and st.choose(1000, 1).peak_bytes == 6000
    assert st.leanest(1000, 1)[2] == 5000
    under = st.choose_under(1000, 1, 5000)  # the peak ladder's last rung: no lower peak exists
    assert under.layers == ("lean", "fast") and under.peak_bytes == 5000
    assert not st.choose_under(1000, 1, 4999).fits
    sp = pp.plan_step(shapes)
    assert sp.fits, sp.message
    assert sp.stage_plans[0][0].layers == sp.stage_plans[0][1].layers == ("lean", "lean")
    assert all(c.layers == ("fast", "fast") for c in sp.stage_plans[1])  # one in flight: the fastest
    peaks = check_peaks(pp, shapes, sp)
    assert peaks[0] == 7000 and all(p <= lim for p, lim in zip(peaks, sp.stage_limits))
    # the peak ladder alone stops at lean*1+fast*1 on both: 8000 bytes > 7000
    ladder_only = PipelinePlanner("optimal", cm, 7000.0, 2, margin_bytes=0, recompute="off")
    ladder_only.held_plans = lambda *a: []  # no plan holding fewer bytes: the peak ladder alone
    stuck = ladder_only.plan_step(shapes)
    assert not stuck.fits and stuck.offenders == (0, 1) and stuck.stage_peaks[0] == 8000
    assert "0: lean*1+fast*1; 1: lean*1+fast*1" in stuck.message
    assert PipelinePlanner("optimal", cm, 7000.0, 2, margin_bytes=0, recompute="off").plan_step(shapes) == sp


def test_spread_order():
    """``candidate_orders`` has an order with the R = ceil(M / P) longest micro-batches P
    positions apart (at 0, P, 2P, ...; longest first where M <= P), so no two of them are in
    flight together on any stage (stage 0 holds P consecutive positions under 1F1B), and the
    next R longest at 1, P + 1, ... where M allows, shortest first (the longest is in flight
    with the shortest of them)."""
    from megatron_paradyse.planner.stages import candidate_orders
    for P in (1, 2, 3, 4, 8):
        for M in range(1, 20):
            sizes = [(7 * j) % 11 + j for j in range(M)]  # not sorted
            orders = candidate_orders(sizes, P)
            assert orders[0] == tuple(range(M)) and len(set(orders)) == len(orders) <= 5
            assert all(sorted(o) == list(range(M)) for o in orders)
            desc = sorted(range(M), key=lambda j: (-sizes[j], j))
            R = -(-M // P)
            spread = [o for o in orders if [o.index(j) for j in desc[:R]] == [P * q for q in range(R)]]
            assert spread, (P, M, orders)
            if P > 1 and M >= (R - 1) * P + 2:  # column 1 has R cells too
                assert any([o.index(j) for j in desc[R:2 * R]] == [P * q + 1 for q in reversed(range(R))]
                           for o in spread)
    assert candidate_orders([1, 2, 3]) == candidate_orders([1, 2, 3], 1)  # one stage: nothing new


def test_only_the_spread_order_fits():
    """Three stages (stage 0 holds three micro-batches at once), two of 1000 tokens among four of
    100, one strategy (no plan to tighten): with both long ones in flight stage 0 needs 5200
    bytes > 4000, with one 3400. Only the spread order (the long ones at positions 0 and 3)
    keeps them apart: the given order, the alternated ones and longest first do not fit."""
    from megatron_paradyse.planner.stages import candidate_orders
    cm = PerToken({"a": (1.0, 1.0, 1.0)}, 6)
    shapes = [(100, 1), (1000, 1), (100, 1), (1000, 1), (100, 1), (100, 1)]
    pp = PipelinePlanner("optimal", cm, 4000.0, 3, margin_bytes=0, recompute="off")
    orders = candidate_orders([s for s, _ in shapes], 3)
    assert len(orders) == 5
    for order in orders[:-1]:
        sp = pp.plan_step([shapes[j] for j in order], reorder=False)
        assert not sp.fits and sp.message.startswith("stage 0 of 3"), order
    sp = pp.plan_step(shapes)
    assert sp.fits and sp.order == orders[-1] == (1, 2, 5, 3, 0, 4)
    assert sp.order.index(3) - sp.order.index(1) == 3
    peaks = check_peaks(pp, shapes, sp)
    assert peaks[0] == 3400 and all(p <= lim for p, lim in zip(peaks, sp.stage_limits))
    assert not pp.plan_step(shapes, reorder=False).fits


def test_random_steps_fit_by_the_cost_model():
    """40 random steps (fixed seed): analytic and shipped models, 1 to 4 stages, up to 6
    micro-batches with packs and b = 2, both planners, budgets from nothing fitting to
    everything: the predicted peaks equal the recomputed ones, a fitting step is within every
    limit, a failing one names a stage and its micro-batches, and a fresh planner agrees."""
    import random

    from megatron_paradyse.parallel.packing import PackShape
    rng = random.Random(7)
    models = [AnalyticCostModel(dataclasses.replace(demo_shape(2), num_layers=12)), build_cost_model(demo_shape(4))]
    fits = 0
    for case in range(40):
        cm = rng.choice(models)
        P = rng.choice([d for d in (1, 2, 3, 4) if cm.num_layers % d == 0])
        shapes = [(PackShape(tuple(rng.randint(8, 2000) for _ in range(rng.randint(1, 4)))), 1) if rng.random() < 0.2
                  else (cm.shape.p * rng.randint(16, 2048), rng.choice([1, 1, 2])) for _ in range(rng.randint(1, 6))]
        kind = rng.choice(["optimal", "heuristic"])
        budget = rng.uniform(5, 200) * MiB
        pp = PipelinePlanner(kind, cm, budget, P)
        sp = pp.plan_step(shapes)
        check_peaks(pp, shapes, sp)
        if sp.fits:
            fits += 1
            assert all(pk <= lim * (1 + 1e-12) for pk, lim in zip(sp.stage_peaks, sp.stage_limits)), case
        else:
            assert sp.message.startswith("stage ") and sp.offenders, case
        assert PipelinePlanner(kind, cm, budget, P).plan_step(shapes) == sp, case
    assert 10 < fits < 40, fits


def test_deterministic():
    cm = analytic_l8()
    shapes = [(4096, 1), (512, 1), (3072, 1), (2048, 1), (4096, 1), (256, 1)]
    a = PipelinePlanner("optimal", cm, 90 * MiB, 4)
    first = a.plan_step(shapes)
    a.plan_step([(1024, 1)] * 3)  # another step in between: no state carried
    assert a.plan_step(shapes) == first
    assert PipelinePlanner("optimal", cm, 90 * MiB, 4).plan_step(shapes) == first
    assert a.explain_step(shapes) == PipelinePlanner("optimal", cm, 90 * MiB, 4).explain_step(shapes)


def test_explain_step_shows_every_stage():
    cm = analytic_l8()
    pp = PipelinePlanner("optimal", cm, 90 * MiB, 4)
    text = pp.explain_step([(4096, 1), (512, 1), (2048, 1)])
    for r in range(4):
        assert f"== stage {r}: layers {2 * r}-{2 * r + 1}" in text
    assert "+ embedding" in text and "+ output layer, loss" in text
    assert "bubble fraction" in text and text.rstrip().endswith("fits")


# ---------------------------------------------------------------- the trainer's hook


class _MB:
    def __init__(self, s):
        self.tokens = torch.zeros(1, s, dtype=torch.long)
        self.labels = torch.zeros(1, s, dtype=torch.long)
        self.loss_mask = torch.ones(1, s)
        self.position_ids = torch.arange(s)[None]
        self.lengths = (s,)


def test_step_plan_fn_policies(caplog):
    cm = analytic_l8()
    budget = 1.05 * build_planner("optimal", stage_cost_model(cm, 0, 2), 1e12, margin_bytes=0).leanest(8192, 1)[2]
    pp = PipelinePlanner("optimal", cm, budget, 2, margin_bytes=0)
    fn = make_step_plan_fn(pp, "error")
    ok = [_MB(1024), _MB(512)]
    order, plans, sp = fn(ok, 0)
    assert sp.fits and fn.last is sp and order == sp.order and len(plans) == 2
    with pytest.raises(NoFitError, match=r"step 3: stage 0 of 2: micro-batches 0, 1 .*--paradyse-on-no-fit error"):
        fn([_MB(8192), _MB(8192)], 3)
    caplog.set_level(logging.WARNING, logger="megatron_paradyse")
    mbs = [_MB(8192), _MB(8192)]
    order, plans, sp = make_step_plan_fn(pp, "truncate", multiple=4)(mbs, 5)
    assert sp.fits and mbs[0].tokens.shape[1] < 8192 and mbs[0].tokens.shape[1] % 4 == 0
    assert mbs[1].tokens.shape[1] == 8192
    assert any("truncated to" in r.getMessage() for r in caplog.records)
    mbs = [_MB(8192), _MB(8192)]
    order, plans, sp = make_step_plan_fn(pp, "skip", multiple=4)(mbs, 6)
    assert sp.fits and mbs[0].tokens.shape[1] == 4 and float(mbs[0].loss_mask.sum()) == 0
    with pytest.raises(ValueError, match="on_no_fit"):
        make_step_plan_fn(pp, "oom")


# ---------------------------------------------------------------- the command line


def test_cli_step(capsys):
    from megatron_paradyse.planner.cli import main

    assert main(["--analytic", "--p", "2", "--pp", "2", "--step-lengths", "4096,1024,2048,512",
                 "--memory-budget", "0.05", "--planner", "optimal"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages x 2 layers, 4 micro-batches" in out and "== stage 1: layers 2-3" in out
    for args, why in ((["--p", "2", "--pp", "3", "--step-lengths", "4096"], "--pp 3: 4 layers do not split evenly"),
                      (["--pp", "2", "--seq-lens", "1k"], "--pp needs"),
                      (["--p", "2", "--step-lengths", "4095"], "multiples of p = 2: 4095")):
        with pytest.raises(SystemExit) as e:
            main(["--analytic", "--memory-budget", "0.05"] + args)
        assert e.value.code == 2 and why in capsys.readouterr().err


# ---------------------------------------------------------------- the interleaved schedule


def megatron_interleaved_order(r, P, M, V, N):
    """The (kind, micro-batch, chunk) order of megatron-core's ``forward_backward_pipelining_with_
    interleaving`` on stage r, from its own table and warm-up count (``get_schedule_table``,
    ``get_pp_rank_microbatches``) and its loops' chunk rule (backward: ``V - 1 - c``)."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: P, rank=lambda: r),
                           virtual_pipeline_model_parallel_size=V)
    total, _, warmup, remaining = get_pp_rank_microbatches(M, V, N, p2p_communicator=comm)
    table = get_schedule_table(M, V, N)
    ops = [("F",) + table[k] for k in range(warmup)]
    for i in range(remaining):
        ops += [("F",) + table[warmup + i], ("B", table[i][0], V - 1 - table[i][1])]
    ops += [("B", table[k][0], V - 1 - table[k][1]) for k in range(remaining, total)]
    return ops


def test_interleaved_order_is_megatrons():
    from megatron_paradyse.costmodel.schedule import interleaved_order

    for P in (2, 3, 4):
        for V in (2, 3):
            for M in range(P, 3 * P + 1):
                for N in sorted({P, M}):
                    if 0 < M % N < P:
                        continue  # megatron refuses it
                    for r in range(P):
                        got = [(op.kind, op.mb, op.chunk) for op in interleaved_order(r, P, M, V, N)]
                        assert got == megatron_interleaved_order(r, P, M, V, N), (P, V, M, N, r)


def test_interleaved_schedule_by_hand():
    """P = 2, V = 2, M = 2, equal forwards f = 1, backwards b = 2: each micro-batch crosses the
    four virtual stages forward (4 f) and back (4 b); stage 0 holds both micro-batches of both
    chunks at once (warm-up 2 + 2), and the schedule's time is the critical path."""
    from megatron_paradyse.costmodel.schedule import interleaved_receives, simulate_interleaved

    P, V, M = 2, 2, 2
    sch = simulate_interleaved([[[1.0] * M] * V] * P, [[[2.0] * M] * V] * P)
    assert max(len(op.chunks) for op in sch.ops[0]) == 4
    assert max(len(op.chunks) for op in sch.ops[1]) == 3
    assert max(len(op.in_flight) for op in sch.ops[0]) == 2
    assert all(math.isclose(b, M * V * 3.0) for b in sch.busy)
    # stage 0: F00 F10 F01 F11 (1 each, F01 waits for stage 1's F00 at 2) ... 15 s in all
    assert math.isclose(sch.makespan, 15.0), sch.makespan
    assert [(op.kind, op.mb, op.chunk) for op in sch.ops[0]][:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]
    assert interleaved_receives(0, P, M, V) == ((0, 1), (0, 1, 0, 1))
    assert interleaved_receives(1, P, M, V) == ((0, 1, 0, 1), (0, 1))


def test_interleaved_step_planner():
    """V = 2 chunks per stage: the step planner tightens over megatron's interleaved order (its
    peaks recomputed here over that order), times the step by the interleaved simulation, and
    lays each stage's plan out chunk after chunk (stage 0: layers 1-2 and 5-6 of 8)."""
    cm = analytic_l8()
    P, V, shapes = 2, 2, [(4096, 1)] * 4
    fast = build_planner("optimal", stage_cost_model(cm, 0, P), 1e12, margin_bytes=0).choose(4096, 1)
    budget = 1.2 * fast.peak_bytes
    loose = PipelinePlanner("optimal", cm, 1e12, P, margin_bytes=0, reorder=False, num_chunks=V).plan_step(shapes)
    assert loose.stage_peaks[0] > budget  # the fastest plans, in flight together, do not fit
    pp = PipelinePlanner("optimal", cm, budget, P, margin_bytes=0, reorder=False, num_chunks=V)
    sp = pp.plan_step(shapes)
    assert sp.fits, sp.message
    peaks = check_peaks(pp, shapes, sp, V=V)
    assert all(p <= lim for p, lim in zip(peaks, sp.stage_limits))
    assert sp.seconds > loose.seconds
    a, b = sp.stage_plans[0][0].layers, sp.stage_plans[1][0].layers
    assert sp.plans[0] == a[:2] + b[:2] + a[2:] + b[2:]
    one = PipelinePlanner("optimal", cm, 1e12, P, margin_bytes=0, reorder=False).plan_step(shapes)
    assert loose.makespan < one.makespan  # the interleaved schedule's smaller bubble
