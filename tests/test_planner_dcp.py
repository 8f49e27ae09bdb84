"""Dynamic CP planning (``planner/dynamic_cp.py``) against brute force on small pools, on a
synthetic cost model per CP size (pure Python, a few seconds): every plan is the planner's
exact answer at its c and fits the budget; the rounds partition the pool into aligned blocks;
the rounds' time is within ``t_max + 2A/N`` (and 3x the best arrangement of the same
micro-batches, found by brute force); never slower than megatron's policy; and how far the
schedule is from the brute-force optimum over every packing, c and round assignment. Packs
under CP (``costmodel/cp.py``) are priced and planned within the budget."""
from __future__ import annotations

import itertools
import random

import pytest

from megatron_paradyse.costmodel.base import CostModel, LayerCost
from megatron_paradyse.parallel.packing import PackShape
from megatron_paradyse.planner import build_planner
from megatron_paradyse.planner.core import NoFitError
from megatron_paradyse.planner.dynamic_cp import (MicroBatchPricer, _neighbour_keys, _shelf, arrange, fillers,
                                                  megatron_dcp, plan_dynamic_cp, power_sizes, shelf_seconds)

BUDGET = 24e6


class SynthCP(CostModel):
    """A layer at CP size c: linear work on the local tokens, causal attention pairs over c
    nodes, a ring whose hops cost a fixed latency (so small documents prefer c = 1)."""

    strategies = ("tp_sp", "ulysses")
    num_layers = 4

    def __init__(self, c: int):
        self.c = c

    def recomputes(self) -> bool:
        return True

    def static_bytes(self) -> float:
        return 2e6

    def update_seconds(self) -> float:
        return 0.01

    def _work(self, s):
        if isinstance(s, PackShape):
            return s.tokens, sum(d * (d + 1) / 2 for d in s.lengths)
        return s, s * (s + 1) / 2

    def nonlayer(self, s, b) -> LayerCost:
        T, _ = self._work(s)
        return LayerCost(3e-4 + 2e-7 * T / self.c, 60 * T / self.c, 0.0)

    def layer(self, entry, s, b) -> LayerCost:
        T, P = self._work(s)
        name, _, rc = entry.partition(":")
        ring = 0.0 if self.c == 1 else 4e-4 * (self.c - 1) + 1e-7 * T * (self.c - 1) / self.c
        seconds = 1e-6 * T / self.c + 4e-10 * P / self.c + ring
        saved, trans = 900 * T / self.c, 300 * T / self.c
        if name == "ulysses":
            seconds, saved, trans = seconds * 1.15 + 1e-4, saved * 0.7, trans * 1.5
        if rc:
            return LayerCost(seconds * 1.3, 50 * T / self.c, trans + saved)
        return LayerCost(seconds, saved, trans)


def planners(pool: int) -> dict:
    return {c: build_planner("optimal", SynthCP(c), BUDGET, margin_bytes=0) for c in power_sizes(pool)}


PLANNERS = {8: planners(8)}
PLANNERS[4] = {c: PLANNERS[8][c] for c in (1, 2, 4)}
PLANNERS[2] = {c: PLANNERS[8][c] for c in (1, 2)}


def _cases(seed: int, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        pool = rng.choice((2, 4))
        k = rng.randint(2, 6)
        per_node = rng.choice((None, 4096, 8192))
        top = pool * min(per_node or 6000, 6000)
        yield pool, [min(top, int(2 ** rng.uniform(6, 14.3))) for _ in range(k)], per_node


def _check_structure(sched, pool, lengths, pr):
    seen = []
    for r in sched.rounds:
        covered = 0
        for a in sorted(r, key=lambda a: a.first):
            assert a.first == covered and a.size & (a.size - 1) == 0 and a.first % a.size == 0, r
            covered += a.size
            choice = pr.choice(a.documents, a.size)
            assert tuple(a.plan) == tuple(choice.layers) and choice.fits and a.peak_bytes <= BUDGET
            seen.extend(a.documents)
        assert covered == pool
    for node in range(pool):
        mine = sched.for_node(node)
        assert len(mine) == len(sched.rounds) and all(a.first <= node < a.first + a.size for a in mine)
    assert sorted(seen) == list(range(len(lengths)))


def _best_rounds(items, pool):
    """Brute force: the least sum of round maxima over every partition of ``items`` into rounds
    of total size <= pool (fillers aside)."""
    best = [float("inf")]

    def go(i, rounds):
        if i == len(items):
            best[0] = min(best[0], sum(max(items[j][1] for j in r) for r in rounds))
            return
        for r in rounds:
            if sum(items[j][0] for j in r) + items[i][0] <= pool:
                r.append(i)
                go(i + 1, rounds)
                r.pop()
        rounds.append([i])
        go(i + 1, rounds)
        rounds.pop()

    go(0, [])
    return best[0]


def _set_partitions(xs):
    if not xs:
        yield []
        return
    first, rest = xs[0], xs[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def _round_seconds(pr, pool, blocks):
    """A round's seconds with its fillers: blocks [(docs, c)] laid out in decreasing size."""
    used = sum(c for _, c in blocks)
    t = [pr.choice(d, c).seconds for d, c in blocks]
    t += [pr.choice((), c).seconds for _, c in fillers(used, pool)]
    return max(t)


def _brute_force(pr, pool, lengths, per_node):
    """The least predicted step time over every packing, c per micro-batch and round
    assignment (fillers included, update excluded)."""
    best = float("inf")
    for part in _set_partitions(list(range(len(lengths)))):
        options = []
        for docs in part:
            d = tuple(sorted(docs, key=lambda i: (-lengths[i], i)))
            cs = [c for c in power_sizes(pool) if (per_node is None or pr.tokens(d) <= c * per_node)
                  and pr.choice(d, c).fits]
            options.append([(d, c) for c in cs])
        for mbs in itertools.product(*options):
            best = min(best, _best_round_split(pr, pool, list(mbs)))
    return best


def _best_round_split(pr, pool, mbs):
    best = [float("inf")]

    def go(i, rounds):
        if i == len(mbs):
            best[0] = min(best[0], sum(_round_seconds(pr, pool, r) for r in rounds))
            return
        for r in rounds:
            if sum(c for _, c in r) + mbs[i][1] <= pool:
                r.append(mbs[i])
                go(i + 1, rounds)
                r.pop()
        rounds.append([mbs[i]])
        go(i + 1, rounds)
        rounds.pop()

    go(0, [])
    return best[0]


def test_schedule_guarantees_against_brute_force():
    worst = 1.0
    for pool, lengths, per_node in _cases(0, 14):
        pr = MicroBatchPricer(lengths, PLANNERS[pool], 2)
        sched = plan_dynamic_cp(lengths, pool, PLANNERS[pool], 2, per_node=per_node, pricer=pr)
        _check_structure(sched, pool, lengths, pr)
        mbs = sched.micro_batches()
        items = [(a.size, a.seconds) for a in mbs]
        area = sum(c * t for c, t in items) / pool
        shelf = sum(max([a.seconds for a in r if not a.filler], default=0.0) for r in sched.rounds)
        best_rounds = _best_rounds(items, pool)
        assert best_rounds - 1e-12 <= shelf <= max(t for _, t in items) + 2 * area + 1e-12
        assert shelf <= 3 * best_rounds + 1e-12
        megatron = megatron_dcp(pr, pool, per_node=per_node)
        assert sched.seconds <= megatron.seconds + 1e-12
        optimum = _brute_force(pr, pool, lengths, per_node) + sched.update_seconds
        assert sched.seconds >= optimum - 1e-12
        worst = max(worst, sched.seconds / optimum)
    print(f"\nworst predicted step time / brute-force optimum over the cases: {worst:.3f}")
    assert worst < 1.5



def test_larger_pools_keep_the_guarantees():
    """N = 8, up to 16 documents (no brute force): structure, budget, the shelf bound, megatron."""
    rng = random.Random(3)
    for _ in range(6):
        per_node = rng.choice((None, 4096))
        lengths = [min(8 * (per_node or 6000), int(2 ** rng.uniform(6, 15))) for _ in range(rng.randint(6, 16))]
        pr = MicroBatchPricer(lengths, PLANNERS[8], 2)
        sched = plan_dynamic_cp(lengths, 8, PLANNERS[8], 2, per_node=per_node, pricer=pr)
        _check_structure(sched, 8, lengths, pr)
        items = [(a.size, a.seconds) for a in sched.micro_batches()]
        shelf = sum(max([a.seconds for a in r if not a.filler], default=0.0) for r in sched.rounds)
        assert shelf <= max(t for _, t in items) + 2 * sum(c * t for c, t in items) / 8 + 1e-12
        assert sched.seconds <= megatron_dcp(pr, 8, per_node=per_node).seconds + 1e-12


def test_the_rounds_bound_against_brute_force():
    """:func:`arrange` on random micro-batches (size, seconds): within ``t_max + 2A/N`` and 3x
    the best arrangement into rounds (brute force), on pools of 2, 4 and 8."""
    rng = random.Random(5)
    worst = 1.0
    for _ in range(300):
        pool = rng.choice((2, 4, 8))
        items = [(rng.choice(power_sizes(pool)), rng.choice((0.1, 1.0)) * rng.uniform(0.1, 1.0))
                 for _ in range(rng.randint(1, 7))]
        shelf, best = shelf_seconds(items, pool), _best_rounds(items, pool)
        area = sum(c * t for c, t in items) / pool
        assert best - 1e-12 <= shelf <= max(t for _, t in items) + 2 * area + 1e-12 and shelf <= 3 * best + 1e-12
        worst = max(worst, shelf / best)
    print(f"\nrounds: worst first-fit decreasing / best arrangement {worst:.3f}")


def test_the_local_searchs_shortcut_is_shelf_seconds_exactly():
    """The local search prices a neighbour by ``_shelf`` on the current items' sorted keys less
    the removed plus the added: the same float as ``shelf_seconds`` on the neighbour's items
    (ties in seconds included)."""
    rng = random.Random(7)
    for _ in range(300):
        pool = rng.choice((4, 8, 64))
        items = [(rng.choice(power_sizes(pool)), rng.choice((0.5, 1.0, rng.uniform(0.1, 2.0))), ())
                 for _ in range(rng.randint(2, 30))]
        keys = sorted((-t, -c, i) for i, (c, t, _) in enumerate(items))
        removed = tuple(sorted(rng.sample(range(len(items)), rng.randint(1, 2))))
        added = [(rng.choice(power_sizes(pool)), rng.choice((1.0, rng.uniform(0.1, 2.0))), ())
                 for _ in range(rng.randint(1, 2))]
        after = [it for i, it in enumerate(items) if i not in removed] + added
        assert _shelf(_neighbour_keys(keys, removed, added), pool) == shelf_seconds(after, pool)


def test_arrange_is_aligned_and_a_document_that_fits_nowhere_is_refused():
    items = [(2, 5.0), (1, 4.0), (1, 3.0), (4, 1.0), (2, 2.0)]
    rounds = arrange(items, 4)
    assert [sorted(r) for r in rounds] == [[0, 1, 2], [4], [3]]  # slowest first
    assert shelf_seconds(items, 4) == 5.0 + 1.0 + 2.0
    assert fillers(1, 8) == [(1, 1), (2, 2), (4, 4)] and fillers(6, 8) == [(6, 2)]
    with pytest.raises(NoFitError, match="document 1 of 40000 tokens fits no CP size"):
        plan_dynamic_cp([100, 40000], 2, PLANNERS[2], 2)
    with pytest.raises(ValueError, match="power of two"):
        plan_dynamic_cp([100], 3, PLANNERS[4], 2)
    # a cap forces c: 9000 tokens over at most 4096 per node needs c = 4
    sched = plan_dynamic_cp([9000, 100], 4, PLANNERS[4], 2, per_node=4096)
    assert {a.size for a in sched.micro_batches() if 0 in a.documents} == {4}
    assert plan_dynamic_cp([9000, 100], 4, PLANNERS[4], 2, per_node=4096) == sched  # deterministic
    # --min-dynamic-context-parallel-size 2: no block below 2 nodes, fillers included
    docs = [3000, 100, 200, 50]
    assert min(a.size for r in plan_dynamic_cp(docs, 4, PLANNERS[4], 2).rounds for a in r) == 1
    assert min(a.size for r in plan_dynamic_cp(docs, 4, PLANNERS[4], 2, min_size=2).rounds for a in r) >= 2


def test_packs_under_cp_are_priced_per_rank_and_planned_within_the_budget():
    """A pack at C = 2, p = 2 (the demo's fitted model): each CP rank's local pack is its
    documents' pieces in chunks c and 2C-1-c; the extra attention pairs (keys in the same
    document outside the piece) match a count over positions; the layer is the largest rank's;
    the planner's plan for a pack under CP fits the budget."""
    from megatron_paradyse.costmodel import build_cost_model, demo_shape
    from megatron_paradyse.costmodel.cp import CPCostModel, Links, _pairs, _rank_pieces

    base = build_cost_model(demo_shape(2))
    cm = CPCostModel(base, 2, Links.from_config("cpu_gloo", "cpu_gloo"))
    pack = PackShape((300, 500, 21))      # 821 tokens: padded to 824 (2 x C x p = 8) by a document of 3
    padded = cm.padded(pack, 1)
    assert padded.lengths == (300, 500, 21, 3)
    # chunks of 206: rank 0 holds [0, 206) and [618, 824), rank 1 [206, 618)
    assert cm.local_packs(padded) == (PackShape((206, 182, 21, 3)), PackShape((94, 112, 206)))
    bounds = [0, 300, 800, 821, 824]
    for c, pieces in enumerate(_rank_pieces(padded.lengths, 2)):
        mine = [q for k in (c, 3 - c) for q in range(k * 206, (k + 1) * 206)]
        every = sum(q - max(b for b in bounds if b <= q) + 1 for q in mine)  # same document, keys <= q
        assert sum(_pairs(a - o, b - o) for a, b, o in pieces) == every
    per_pair = cm.attention_seconds("tp_sp", 412, 1) / (412 * 413 / 2)
    ring = cm.ring_seconds("tp_sp", 824, 1, cm.pack_reach(padded))
    # tp_sp's CP ring makes the hops the runtime makes: one for a document crossing CP ranks,
    # none when each document sits in one rank's chunks (as one sequence's C - 1 = 1 otherwise)
    assert cm.pack_reach(padded) == 1 and cm.pack_reach(PackShape((206,) * 4)) == 0
    assert cm.ring_seconds("tp_sp", 824, 1, 0) == 0 < cm.ring_seconds("tp_sp", 824, 1, 1) == cm.ring_seconds(
        "tp_sp", 824, 1)
    want = max(base.layer("tp_sp", lp, 1).seconds + per_pair * sum(_pairs(a - o, b - o) - (b - a) * (b - a + 1) / 2
                                                                  for a, b, o in pcs) + ring
               for lp, pcs in zip(cm.local_packs(padded), _rank_pieces(padded.lengths, 2)))
    assert cm.layer("tp_sp", pack, 1).seconds == pytest.approx(want, rel=1e-12)
    for e in ("tp_sp", "ring", "metp:rc", "colossal"):
        got = cm.layer(e, pack, 1)
        for lp in cm.local_packs(padded):   # never below any rank's in-node share
            own = base.layer(e, lp, 1)
            assert got.saved_bytes >= own.saved_bytes and got.transient_bytes >= own.transient_bytes
    with pytest.raises(ValueError, match="b must be 1"):
        cm.layer("tp_sp", pack, 2)
    budget = 24 * 2**20
    planner = build_planner("optimal", cm, budget, margin_bytes=0)
    big = PackShape((900, 700, 300, 148))
    choice = planner.choose(big, 1)
    assert choice.fits and cm.step(choice.layers, big, 1).peak_bytes == pytest.approx(choice.peak_bytes)
    assert choice.peak_bytes <= budget
    from megatron_paradyse.planner import cp_planners, plan_dynamic_cp as plan

    got = cp_planners("optimal", base, budget, 2, cm.links, margin_bytes=0)
    assert sorted(got) == [1, 2] and got[1].cm is base and got[2].cm.cp == 2
    sched = plan([900, 700, 300, 148, 3000], 2, got, 2, per_node=1600)   # the demo model: 3000 tokens need c = 2
    assert all(a.peak_bytes <= budget for r in sched.rounds for a in r) and sched.sizes()[2] >= 1
