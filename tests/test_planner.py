"""The planners on synthetic cost models (no spawned world): budget, exactness, hysteresis,
the reference code's bugs, refinement agreement, the no-fit policies, the CLI."""
from __future__ import annotations

import itertools
import logging
import math
import random

import pytest
import torch

from megatron_paradyse.costmodel.base import CostModel, LayerCost, plan_counts
from megatron_paradyse.parallel.plans import RC, split_entry, strategy_of
from megatron_paradyse.planner import (NoFitError, Refinement, build_planner, make_plan_fn, pareto,
                                       solve_counts)
from megatron_paradyse.planner.ordered import solve_nested

NAMES = ("tp_sp", "ulysses", "ring", "colossal", "metp")


class TableModel(CostModel):
    """Per-strategy (seconds, saved, transient) per layer, scaled linearly in s*b (and s^2 terms)."""

    def __init__(self, table, num_layers, static=0.0, nonlayer=(0.0, 0.0, 0.0), pools=None):
        self.table = dict(table)
        self.strategies = tuple(self.table)
        self.num_layers = num_layers
        self._static = static
        self._nl = nonlayer
        self._pools = pools or {}  # {strategy or "nonlayer": {buffer: bytes per 1024 tokens}}

    def pool(self, strategy, s, b):
        u = s * b / 1024.0
        return {n: v * u for n, v in self._pools.get(strategy, {}).items()}

    def layer(self, strategy, s, b):
        t, m, x, q = self.table[strategy]
        u = s * b / 1024.0
        return LayerCost(t * u + q * u * u, m * u, x * u + 0.01 * q * u * u)

    def static_bytes(self):
        return self._static

    def nonlayer(self, s, b):
        u = s * b / 1024.0
        return LayerCost(self._nl[0] * u, self._nl[1] * u, self._nl[2] * u)


def random_model(rng, k=None, layers=None):
    k = k or rng.randint(2, 5)
    names = NAMES[:k]
    table = {n: (rng.uniform(0.5, 3.0), rng.uniform(1.0, 10.0), rng.uniform(0.0, 20.0), rng.uniform(0.0, 0.5))
             for n in names}
    # communication pools: buffers shared by name between strategies (and the non-layer part)
    pools = {n: {f"buf{j}": rng.uniform(0.0, 4.0) for j in range(4) if rng.random() < 0.5}
             for n in list(names) + ["nonlayer"]} if rng.random() < 0.7 else None
    return TableModel(table, layers or rng.randint(1, 8), static=rng.uniform(0, 50),
                      nonlayer=(rng.uniform(0, 1), rng.uniform(0, 5), rng.uniform(0, 5)), pools=pools)


def brute(planner, s, b, ordered=False):
    """Fastest fitting plan by enumerating every composition of L layers (None if none fits):
    under the order-free bound, or (``ordered``) each in its best order (largest transient
    first; ``test_the_best_order_puts_the_largest_transient_first`` checks that order)."""
    costs = planner.costs(s, b)
    evaluate = planner.evaluate_ordered if ordered else planner.evaluate
    L, K = planner.num_layers, len(costs.names)
    best = None
    for cut in itertools.combinations(range(L + K - 1), K - 1):
        prev, counts = -1, {}
        for j, c in enumerate(cut + (L + K - 1,)):
            if c - prev - 1:
                counts[costs.names[j]] = c - prev - 1
            prev = c
        sec, peak = evaluate(costs, counts)
        if peak <= planner.limit and (best is None or sec < best[0]):
            best = (sec, peak, counts)
    return best


def brute_tuples(cm, limit, s, b, entries=None):
    """Fastest fitting per-layer tuple, every tuple of ``entries`` (default the strategies)
    enumerated (``CostModel.step`` on each)."""
    best = None
    for layers in itertools.product(entries or cm.strategies, repeat=cm.num_layers):
        sec, peak = cm.step(layers, s, b)
        if peak <= limit and (best is None or sec < best[0]):
            best = (sec, peak, layers)
    return best


def _budget(rng, cm, s, b):
    """A budget between the leanest and the fattest uniform peak (so some plans fit, some not)."""
    peaks = [cm.step({n: cm.num_layers}, s, b).peak_bytes for n in cm.strategies]
    return rng.uniform(min(peaks) * 0.97, max(peaks) * 1.05)


def test_properties_on_random_models():
    rng = random.Random(1234)
    n_fit = n_mixed = n_order = 0
    for case in range(400):
        cm = random_model(rng)
        s, b = rng.choice([512, 1024, 3000, 4096]), rng.choice([1, 2])
        budget = _budget(rng, cm, s, b)
        margin = rng.choice([0.0, 0.05 * budget])
        h = build_planner("heuristic", cm, budget, margin_bytes=margin)
        o = build_planner("optimal", cm, budget, margin_bytes=margin)
        f = build_planner("optimal", cm, budget, margin_bytes=margin, order="free")
        ch, co, cf = h.choose(s, b), o.choose(s, b), f.choose(s, b)
        ref, ref_free = brute(o, s, b, ordered=True), brute(f, s, b)
        for c in (ch, co, cf):
            assert len(c.layers) == cm.num_layers
            sec, peak = cm.step(c.layers, s, b)  # the cost model's own composition, in the order returned
            assert math.isclose(sec, c.seconds, rel_tol=1e-9)
            if c is co:  # the ordered peak is what the optimal planner reports
                assert math.isclose(peak, c.peak_bytes, rel_tol=1e-9)
            else:  # the order-free bound, which the order returned never exceeds
                assert math.isclose(cm.step(plan_counts(c.layers), s, b)[1], c.peak_bytes, rel_tol=1e-9)
                assert peak <= c.peak_bytes * (1 + 1e-12)
            if c.fits:
                assert c.peak_bytes <= budget - margin, (case, c)  # never over budget
            else:
                assert "nothing fits" in c.reason and "GiB" in c.reason
        # under the order-free bound a fitting plan exists <=> a uniform one fits
        assert (ref_free is not None) == cf.fits == ch.fits, case
        assert (ref is not None) == co.fits, case
        if ref is None:
            continue
        n_fit += 1
        n_mixed += len(set(co.layers)) > 1
        assert math.isclose(co.seconds, ref[0], rel_tol=1e-9), (case, co, ref)  # optimal == brute force
        if ref_free is not None:
            assert math.isclose(cf.seconds, ref_free[0], rel_tol=1e-9), (case, cf, ref_free)
            n_order += co.seconds < cf.seconds * (1 - 1e-9)  # ordering found a faster plan
        assert co.seconds <= cf.seconds * (1 + 1e-12) if cf.fits else True
        assert co.seconds <= ch.seconds * (1 + 1e-12) if ch.fits else True  # never slower than the heuristic
        for name in cm.strategies:  # ... nor than any uniform plan that fits
            sec, peak = cm.step({name: cm.num_layers}, s, b)
            if peak <= budget - margin:
                assert co.seconds <= sec * (1 + 1e-12)
        hp = h.plan(s, b)  # with hysteresis, first call: no prior
        assert hp.layers == ch.layers
    assert n_fit > 200 and n_mixed > 50 and n_order > 20, (n_fit, n_mixed, n_order)  # mixed plans and orders exercised


def test_optimal_equals_brute_force_over_every_tuple():
    """Exact over ordered plans: the same time as enumerating every per-layer tuple (L <= 5,
    up to 5 strategies, pools shared by name), never over budget; hundreds of fixed-seed cases."""
    for seed in (11, 12):
        rng = random.Random(seed)
        found = beats_free = 0
        for case in range(150):
            cm = random_model(rng, layers=rng.randint(1, 5))
            s = rng.choice([512, 1024, 2048])
            budget = _budget(rng, cm, s, 1)
            pl = build_planner("optimal", cm, budget, margin_bytes=0.0)
            c, ref = pl.choose(s, 1), brute_tuples(cm, pl.limit, s, 1)
            assert c.fits == (ref is not None), (seed, case)
            if ref is None:
                continue
            found += 1
            assert math.isclose(c.seconds, ref[0], rel_tol=1e-9), (seed, case, c, ref)
            assert cm.step(c.layers, s, 1).peak_bytes <= pl.limit * (1 + 1e-12)
            free = build_planner("optimal", cm, budget, margin_bytes=0.0, order="free").choose(s, 1)
            beats_free += not free.fits or c.seconds < free.seconds * (1 - 1e-9)
        assert found > 100 and beats_free > 10, (found, beats_free)


def _assert_best_order(cm, pl, rng, case):
    """``layers_of`` (largest transient first) peaks no higher than any permutation of a random
    plan of ``pl``'s candidates."""
    costs = pl.costs(1024, 1)
    counts = plan_counts(tuple(rng.choice(pl.entries) for _ in range(cm.num_layers)))
    best = min(cm.step(p, 1024, 1).peak_bytes
               for p in set(itertools.permutations([n for n, k in counts.items() for _ in range(k)])))
    assert math.isclose(pl.evaluate_ordered(costs, counts)[1], best, rel_tol=1e-12), case


def test_the_best_order_puts_the_largest_transient_first():
    """``layers_of`` (largest transient first) peaks no higher than any permutation of the layers."""
    rng = random.Random(5)
    for case in range(200):
        cm = random_model(rng, layers=rng.randint(2, 5))
        _assert_best_order(cm, build_planner("optimal", cm, 1e12), rng, case)


def test_optimal_equals_brute_force_with_large_transients():
    """Transient-heavy strategies (colossal-like): the max-transient term decides."""
    rng = random.Random(7)
    for case in range(150):
        table = {n: (rng.uniform(0.5, 3), rng.uniform(0.1, 2), rng.choice([0.0, rng.uniform(5, 40)]), 0.0)
                 for n in NAMES[:rng.randint(3, 5)]}
        cm = TableModel(table, rng.randint(2, 7), static=1.0)
        budget = _budget(rng, cm, 2048, 1)
        o = build_planner("optimal", cm, budget, margin_bytes=0)
        ref = brute(o, 2048, 1, ordered=True)
        c = o.choose(2048, 1)
        assert c.fits == (ref is not None)
        if ref:
            assert math.isclose(c.seconds, ref[0], rel_tol=1e-9), (case, c, ref)


def test_solve_counts_large_against_enumeration_of_three():
    rng = random.Random(3)
    for _ in range(50):
        t = [rng.uniform(1, 3) for _ in range(3)]
        m = [rng.uniform(1, 5) for _ in range(3)]
        L = rng.randint(10, 40)
        C = rng.uniform(min(m) * L, max(m) * L)
        got, counts = solve_counts(t, m, L, C)
        best = min((a * t[0] + bb * t[1] + (L - a - bb) * t[2] for a in range(L + 1) for bb in range(L + 1 - a)
                    if a * m[0] + bb * m[1] + (L - a - bb) * m[2] <= C), default=math.inf)
        assert math.isclose(got, best, rel_tol=1e-12)
        assert sum(counts) == L and sum(k * mi for k, mi in zip(counts, m)) <= C


def test_hysteresis_keeps_only_fitting_plans_within_gamma():
    rng = random.Random(99)
    kept = 0
    for case in range(200):
        cm = random_model(rng, layers=rng.randint(2, 6))
        budget = _budget(rng, cm, 4096, 1)
        for kind in ("heuristic", "optimal"):
            pl = build_planner(kind, cm, budget, gamma=0.2, margin_bytes=0)
            for s in [rng.choice([256, 1024, 2048, 4096, 6000, 8192]) for _ in range(8)]:
                prior = pl.prior
                fresh = pl.choose(s, 1)
                c = pl.plan(s, 1)
                if c.fits:
                    assert c.peak_bytes <= budget
                    assert c.seconds <= 1.2 * fresh.seconds * (1 + 1e-12)
                    if c.layers != fresh.layers:
                        kept += 1
                        assert c.layers == prior and "kept the previous plan" in c.reason
                else:
                    assert not fresh.fits  # a prior that no longer fits is never kept
    assert kept > 10


def test_heuristic_returns_largest_fitting_mix_not_one_over():
    """Reference bug 1: the aliased list made the returned mix one fast layer over budget."""
    cm = TableModel({"fast": (1.0, 10.0, 0.0, 0.0), "lean": (2.0, 1.0, 0.0, 0.0)}, num_layers=8)
    # budget for exactly 5 fast + 3 lean layers (u = 1 at s = 1024): 5*10 + 3*1 = 53
    h = build_planner("heuristic", cm, 53.5, margin_bytes=0)
    c = h.choose(1024, 1)
    assert plan_counts(c.layers) == {"fast": 5, "lean": 3}, c
    assert c.peak_bytes <= 53.5
    # the reference's aliasing replica: the candidate list for e = 1..5 all point at e = 6
    plan, stored = ["lean"] * 8, []
    for e in range(1, 8):
        plan.pop()
        plan.insert(0, "fast")
        if cm.step(plan, 1024, 1).peak_bytes <= 53.5:
            stored.append(plan)  # the bug: no copy
        else:
            break
    assert cm.step(stored[-1], 1024, 1).peak_bytes > 53.5  # what the reference returned
    assert build_planner("optimal", cm, 53.5, margin_bytes=0).choose(1024, 1).layers == c.layers


def test_pareto_prunes_the_last_pair():
    """Reference bug 2: ``pop_useless`` (i < n - 2) never compared the last pair."""
    items = [("a", 1.0, 10.0), ("b", 2.0, 5.0), ("c", 3.0, 2.0), ("d", 4.0, 3.0)]  # d dominated by c
    assert [k for k, _, _ in pareto(items)] == ["a", "b", "c"]

    def pop_useless(lst):  # the reference's loop bound, as a replica
        out, i = list(lst), 0
        while i < len(out) - 2:
            if out[i + 1][1] >= out[i][1] and out[i + 1][2] >= out[i][2]:
                out.pop(i + 1)
            else:
                i += 1
        return out
    assert [k for k, _, _ in pop_useless(items)] == ["a", "b", "c", "d"]  # keeps the dominated one
    assert [k for k, _, _ in pareto(items[::-1])] == ["a", "b", "c"]  # order of input does not matter
    # equal time and memory: exactly one kept, the first
    assert [k for k, _, _ in pareto([("x", 1.0, 1.0), ("y", 1.0, 1.0)])] == ["x"]


def test_no_sticky_out_of_memory_flag():
    """Reference bug 3: after a length that fits nothing, a shorter length gets its best plan again."""
    cm = TableModel({"fast": (1.0, 10.0, 0.0, 0.0), "lean": (2.0, 1.0, 0.0, 0.0)}, num_layers=4)
    for kind in ("heuristic", "optimal"):
        pl = build_planner(kind, cm, 45.0, margin_bytes=0)
        assert pl.plan(1024, 1).layers == ("fast",) * 4
        long = pl.plan(1024 * 16, 1)
        assert not long.fits and long.layers == ("lean",) * 4
        assert "longest length that fits" in long.reason and "needs" in long.reason
        assert pl.plan(1024, 1).layers == ("fast",) * 4  # the reference stayed on its leanest plan
        assert pl.plan(512, 1).layers == ("fast",) * 4


def test_refinement_is_identical_on_every_rank():
    """Reference bug 4: predictions refined per rank diverge; here only the summed vector is applied."""
    cm = TableModel({"fast": (1.0, 10.0, 0.0, 0.0), "lean": (1.05, 1.0, 0.0, 0.0)}, num_layers=4)
    ranks = [build_planner("optimal", cm, 1e9, refinement=True) for _ in range(4)]
    rng = random.Random(0)
    for step in range(10):
        contribs = []
        for r, pl in enumerate(ranks):
            c = pl.plan(2048, 1)
            measured = c.seconds * (1.5 if "fast" in c.layers else 1.0) * (1 + 0.1 * rng.random() * r)
            contribs.append(pl.refinement.contribution([(c.layers, 2048)], c.seconds, measured, c.peak_bytes,
                                                       c.peak_bytes * (1 + 0.01 * r)))
        summed = [sum(v) for v in zip(*contribs)]
        for pl in ranks:
            pl.refinement.apply(summed)
        plans = {pl.plan(2048, 1).layers for pl in ranks}
        assert len(plans) == 1, plans
        assert len({tuple(pl.refinement.time) for pl in ranks}) == 1
    # measured 'fast' ~1.5x slower than predicted: the planner has switched to 'lean'
    assert ranks[0].plan(2048, 1).layers == ("lean",) * 4
    # what the reference did (each rank its own measured time) would have made them disagree
    local = [build_planner("optimal", cm, 1e9, refinement=True) for _ in range(2)]
    for r, pl in enumerate(local):
        c = pl.plan(2048, 1)
        for _ in range(5):
            pl.refinement.apply(pl.refinement.contribution([(c.layers, 2048)], c.seconds, c.seconds * (1.0 + 0.6 * r)))
    assert local[0].plan(2048, 1).layers != local[1].plan(2048, 1).layers


def test_refinement_memory_factor_shrinks_what_fits():
    cm = TableModel({"fast": (1.0, 10.0, 0.0, 0.0), "lean": (2.0, 1.0, 0.0, 0.0)}, num_layers=4)
    pl = build_planner("optimal", cm, 45.0, margin_bytes=0, refinement=True)
    before = pl.plan(1024, 1)
    assert before.layers == ("fast",) * 4 and before.fits
    for _ in range(10):  # measured peaks 30% above prediction
        pl.refinement.apply(pl.refinement.contribution([(before.layers, 1024)], 1.0, 1.0, 40.0, 52.0))
    after = pl.plan(1024, 1)
    assert after.fits and after.peak_bytes <= 45.0 and after.layers != before.layers


def test_cache_and_longest_fit():
    cm = TableModel({"fast": (1.0, 10.0, 0.0, 0.0), "lean": (2.0, 1.0, 0.0, 0.0)}, num_layers=4)
    pl = build_planner("optimal", cm, 45.0, margin_bytes=0)
    pl.plan(1000, 1), pl.plan(1000, 1), pl.plan(1000, 2)
    assert (pl.hits, pl.misses) == (1, 2)
    # leanest: 4 layers lean = 4 * s/1024 <= 45 -> s <= 11520
    assert pl.longest_fit(1) == 11520
    assert pl.longest_fit(1, multiple=64) == 11520 - 11520 % 64
    assert pl.longest_fit(2, multiple=4) == 5760
    assert pl.longest_fit(1, upper=5000) == 5000


class _MB:
    def __init__(self, s, lengths=None):
        self.tokens = torch.zeros(1, s, dtype=torch.long)
        self.labels = torch.zeros(1, s, dtype=torch.long)
        self.loss_mask = torch.ones(1, s)
        self.position_ids = torch.arange(s)[None]
        self.lengths = tuple(lengths or (s,))


def test_no_fit_policies(caplog):
    cm = TableModel({"fast": (1.0, 10.0, 0.0, 0.0), "lean": (2.0, 1.0, 0.0, 0.0)}, num_layers=4)
    pl = build_planner("heuristic", cm, 45.0, margin_bytes=0)
    with pytest.raises(NoFitError, match=r"needs .* GiB.*longest length that fits .* 11520"):
        make_plan_fn(pl, "error")(_MB(16384), 3, 0)

    def warned():
        return [r.getMessage() for r in caplog.records
                if r.name == "megatron_paradyse.planner" and r.levelno == logging.WARNING]

    caplog.set_level(logging.WARNING, logger="megatron_paradyse")
    fn = make_plan_fn(pl, "truncate", multiple=4)
    mb = _MB(16384)
    assert fn(mb, 0, 0) == ("lean",) * 4 and mb.tokens.shape == (1, 11520) and mb.lengths == (11520,)
    assert "truncated to 11520" in warned()[-1] and "16384" in warned()[-1]
    fn = make_plan_fn(pl, "skip", multiple=4)
    mb = _MB(16384)
    fn(mb, 0, 1)
    assert mb.tokens.shape == (1, 4) and float(mb.loss_mask.sum()) == 0 and "skipped" in warned()[-1]
    mb = _MB(1024)
    assert fn(mb, 0, 2) == ("fast",) * 4 and mb.tokens.shape == (1, 1024)  # fitting ones untouched


def test_bad_arguments():
    cm = TableModel({"a": (1.0, 1.0, 0.0, 0.0)}, num_layers=2)
    with pytest.raises(ValueError, match="unknown planner"):
        build_planner("greedy", cm, 1.0)
    with pytest.raises(ValueError, match="positive"):
        build_planner("optimal", cm, 0)
    with pytest.raises(ValueError, match="margin"):
        build_planner("optimal", cm, 10.0, margin_bytes=10.0)
    with pytest.raises(ValueError, match="on_no_fit"):
        make_plan_fn(build_planner("optimal", cm, 10.0), "oom")


def test_cli_explains_every_candidate(capsys):
    from megatron_paradyse.planner.cli import main

    assert main(["--analytic", "--p", "4", "--seq-lens", "1k,64k,4m", "--memory-budget", "0.05"]) == 0
    text = capsys.readouterr().out
    for name in NAMES:
        assert f"uniform {name}" in text
    assert "chosen by heuristic, optimal" in text and "nothing fits" in text and "longest length that fits" in text
    assert text.count("== s = ") == 3


def test_plan_command_runs(capsys):
    """The one command line, ``python -m megatron_paradyse.plan`` (``megatron_paradyse.planner``
    is a library, not a second command)."""
    import os
    import subprocess
    import sys

    from megatron_paradyse.plan import main

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert main(["--analytic", "--p", "4", "--seq-lens", "1k", "--memory-budget", "0.05", "--planner", "optimal"]) == 0
    out = capsys.readouterr().out
    assert "== s = 1024" in out and "optimal: " in out
    gone = subprocess.run([sys.executable, "-m", "megatron_paradyse.planner"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert gone.returncode != 0 and "cannot be directly executed" in gone.stderr


# ---------------------------------------------------------------- strategy x recompute

class RcModel(TableModel):
    """:class:`TableModel` that also prices each strategy recomputed in backward (``tp_sp:rc``):
    its own (seconds, saved, transient) per layer, the strategy's pool."""

    def __init__(self, table, rc, num_layers, **kw):
        super().__init__(table, num_layers, **kw)
        self.rc = dict(rc)

    def recomputes(self):
        return True

    def pool(self, strategy, s, b):
        return super().pool(strategy_of(strategy), s, b)

    def layer(self, strategy, s, b):
        name, rc = split_entry(strategy)
        if not rc:
            return super().layer(name, s, b)
        t, m, x = self.rc[name]
        u = s * b / 1024.0
        return LayerCost(t * u, m * u, x * u)


def random_rc_model(rng, k=None, layers=None):
    """A random model whose recomputed layers are slower, keep less and peak higher (some much
    higher, some lower) than the plain ones, as a recomputed layer does."""
    base = random_model(rng, k=k, layers=layers)
    heavy = rng.random() < 0.3
    rc = {n: (t * rng.uniform(1.1, 1.6) + q, m * rng.uniform(0.05, 0.4),
              (m + x) * rng.uniform(0.6, 1.3) * (rng.choice([0.2, 3.0, 10.0]) if heavy else 1.0))
          for n, (t, m, x, q) in base.table.items()}
    return RcModel(base.table, rc, base.num_layers, static=base._static, nonlayer=base._nl, pools=base._pools)


def _rc_budget(rng, cm, s):
    """From below the leanest recomputed uniform plan to above the fattest plain one."""
    peaks = [cm.step({e: cm.num_layers}, s, 1).peak_bytes for n in cm.strategies for e in (n, n + RC)]
    return rng.uniform(min(peaks) * 0.95, max(peaks) * 1.05)


def brute_multisets(planner, costs, evaluate):
    """Fastest fitting plan over every multiset of the planner's candidates (``evaluate``: the
    order-free bound, or the ordered peak in the best order), or None."""
    best = None
    for layers in itertools.combinations_with_replacement(costs.names, planner.num_layers):
        counts = plan_counts(layers)
        sec, peak = evaluate(costs, counts)
        if peak <= planner.limit and (best is None or sec < best[0]):
            best = (sec, peak, counts)
    return best


def test_recompute_optimal_equals_brute_force_over_every_tuple():
    """Strategy x recompute: the optimal planner equals enumerating every per-layer tuple of
    the candidates (``CostModel.step``); ``off`` never recomputes, ``only`` always, each exact
    over its own candidates; ``order="free"`` exact under the bound; never over budget."""
    rng = random.Random(2027)
    found = rc_used = 0
    for case in range(90):
        cm = random_rc_model(rng, k=rng.randint(2, 4), layers=rng.randint(1, 3))
        s = rng.choice([512, 1024, 2048])
        budget = _rc_budget(rng, cm, s)
        for mode in ("auto", "off", "only"):
            pl = build_planner("optimal", cm, budget, margin_bytes=0.0, recompute=mode)
            assert pl.entries == {"auto": cm.strategies + tuple(n + RC for n in cm.strategies),
                                  "off": cm.strategies, "only": tuple(n + RC for n in cm.strategies)}[mode]
            c, ref = pl.choose(s, 1), brute_tuples(cm, pl.limit, s, 1, pl.entries)
            assert c.fits == (ref is not None), (case, mode, c, ref)
            if mode == "off":
                assert not any(split_entry(e)[1] for e in c.layers)
            if mode == "only":
                assert all(split_entry(e)[1] for e in c.layers)
            if ref is None:
                continue
            step = cm.step(c.layers, s, 1)
            assert math.isclose(c.seconds, ref[0], rel_tol=1e-9), (case, mode, c, ref)
            assert math.isclose(step.seconds, c.seconds, rel_tol=1e-9)
            assert step.peak_bytes <= pl.limit * (1 + 1e-12) and math.isclose(step.peak_bytes, c.peak_bytes, rel_tol=1e-9)
            if mode == "auto":
                found += 1
                rc_used += any(split_entry(e)[1] for e in c.layers)
        free = build_planner("optimal", cm, budget, margin_bytes=0.0, order="free")
        cf = free.choose(s, 1)
        ref = brute_multisets(free, free.costs(s, 1), free.evaluate)
        assert cf.fits == (ref is not None), case
        if ref is not None:
            assert math.isclose(cf.seconds, ref[0], rel_tol=1e-9), (case, cf, ref)
    assert found > 50 and rc_used > 20, (found, rc_used)


def test_recompute_optimal_exact_and_within_budget_up_to_eight_layers():
    """5 strategies x recompute, up to 8 layers, chunks, margins, transient-heavy recomputed
    layers: equal to brute force over every multiset in its best order, within budget, never
    slower than the heuristic or any fitting uniform plan; the heuristic within budget too."""
    rng = random.Random(77)
    mixed = 0
    for case in range(80):
        cm = random_rc_model(rng, layers=rng.randint(2, 8))
        s = rng.choice([512, 2048, 4096])
        budget = _rc_budget(rng, cm, s)
        margin = rng.choice([0.0, 0.05 * budget])
        chunk = rng.choice([1, 1, 2, 3])
        o = build_planner("optimal", cm, budget, margin_bytes=margin, recompute_chunk=chunk)
        h = build_planner("heuristic", cm, budget, margin_bytes=margin, recompute_chunk=chunk)
        costs = o.costs(s, 1)
        co, ch = o.choose(s, 1), h.choose(s, 1)
        ref = brute_multisets(o, costs, o.evaluate_ordered)
        assert co.fits == (ref is not None), case
        if ch.fits:
            assert ch.peak_bytes <= o.limit and o.evaluate_layers(costs, ch.layers)[1] <= ch.peak_bytes * (1 + 1e-12)
        if ref is None:
            assert not ch.fits
            continue
        mixed += len(set(co.layers)) > 1
        assert math.isclose(co.seconds, ref[0], rel_tol=1e-9), (case, co, ref)
        assert co.peak_bytes <= o.limit
        assert math.isclose(o.evaluate_layers(costs, co.layers)[1], co.peak_bytes, rel_tol=1e-12)
        if chunk == 1:  # the cost model's own peak (a chunk is the planner's bound on top of it)
            assert math.isclose(cm.step(co.layers, s, 1).peak_bytes, co.peak_bytes, rel_tol=1e-9)
        assert co.seconds <= ch.seconds * (1 + 1e-12) if ch.fits else True
        for sec, peak in (o.evaluate_ordered(costs, {e: cm.num_layers}) for e in costs.names):
            assert co.seconds <= sec * (1 + 1e-12) if peak <= o.limit else True
    assert mixed > 15, mixed


def test_the_best_order_puts_the_largest_transient_first_with_recompute():
    rng = random.Random(6)
    for case in range(60):
        cm = random_rc_model(rng, k=rng.randint(2, 3), layers=rng.randint(2, 4))
        _assert_best_order(cm, build_planner("optimal", cm, 1e12), rng, case)


def _rc_fixture(layers=4):
    """Per layer (u = s / 1024): fast keeps 10 u, lean 4 u; recomputed, they keep 0.5 u and
    0.25 u and peak 10 u and 4 u above it (the layer's activations again, in its backward)."""
    return RcModel({"fast": (1.0, 10.0, 0.0, 0.0), "lean": (2.0, 4.0, 0.0, 0.0)},
                   {"fast": (1.3, 0.5, 10.0), "lean": (2.5, 0.25, 4.0)}, num_layers=layers)


def test_recompute_lets_a_longer_length_fit():
    """Under a tight budget the longest length that fits grows with recompute, and the
    no-fit message names the leanest uniform plan among the recomputed ones."""
    cm = _rc_fixture()
    off = build_planner("optimal", cm, 45.0, margin_bytes=0, recompute="off")
    auto = build_planner("optimal", cm, 45.0, margin_bytes=0)
    assert off.longest_fit(1) == 2880  # 4 lean layers: 16 u <= 45
    # 4 recomputed lean layers peak at 4 x 0.25 u saved + 4 u transient = 5 u; the last one
    # plain peaks lower still: 3 x 0.25 u + max(4 u transient, 4 u saved) = 4.75 u <= 45
    assert auto.longest_fit(1) == 9701
    assert auto.choose(9701, 1).layers == ("lean:rc",) * 3 + ("lean",)
    s = 8192
    assert not off.choose(s, 1).fits and auto.choose(s, 1).fits
    assert any(split_entry(e)[1] for e in auto.choose(s, 1).layers)
    assert auto.choose(1024, 1).layers == ("fast",) * 4  # plain where it fits: faster
    heur = build_planner("heuristic", cm, 45.0, margin_bytes=0)
    c = heur.choose(s, 1)
    assert c.fits and c.peak_bytes <= 45.0 and all(split_entry(e)[1] for e in c.layers)
    far = auto.choose(10 ** 6, 1)
    assert not far.fits and ":rc on all 4 layers" in far.reason
    assert f"the longest length that fits is {auto.longest_fit(1)} tokens" in far.reason


def test_recompute_chunk_adds_the_chunks_saved_bytes():
    """megatron's uniform recompute of N layers as one chunk: every :rc transient holds N - 1
    more layers' saved bytes (the largest plain saved of the strategies)."""
    cm = _rc_fixture()
    one = build_planner("optimal", cm, 1e9, recompute="only").costs(1024, 1)
    three = build_planner("optimal", cm, 1e9, recompute="only", recompute_chunk=3).costs(1024, 1)
    assert one.names == three.names == ("fast:rc", "lean:rc")
    assert [b - a for a, b in zip(one.x, three.x)] == [2 * 10.0, 2 * 10.0]
    auto = build_planner("optimal", cm, 1e9, recompute_chunk=2).costs(1024, 1)
    assert auto.x == (0.0, 0.0, 10.0 + 10.0, 4.0 + 10.0)  # the plain ones untouched
    # a budget the recomputed plans fit alone (fast:rc*4: 2 + 10), not with their chunk's bytes
    assert build_planner("optimal", cm, 12.5, margin_bytes=0, recompute="only").choose(1024, 1).fits
    assert not build_planner("optimal", cm, 12.5, margin_bytes=0, recompute="only",
                             recompute_chunk=2).choose(1024, 1).fits
    with pytest.raises(ValueError, match="recompute_chunk"):
        build_planner("optimal", cm, 1e9, recompute_chunk=0)


def test_recompute_modes_on_a_model_that_cannot_price_it(caplog):
    from megatron_paradyse.planner import core

    cm = TableModel({"a": (1.0, 1.0, 0.0, 0.0), "b": (2.0, 0.5, 0.0, 0.0)}, num_layers=2)
    core._WARNED.discard("TableModel")
    caplog.set_level(logging.WARNING, logger="megatron_paradyse")
    pl = build_planner("optimal", cm, 10.0)
    build_planner("heuristic", cm, 10.0)
    assert pl.recompute == "off" and pl.entries == ("a", "b")
    warned = [r.getMessage() for r in caplog.records if "does not price recomputed" in r.getMessage()]
    assert len(warned) == 1, warned  # one warning
    with pytest.raises(ValueError, match="recompute='only' needs a cost model"):
        build_planner("optimal", cm, 10.0, recompute="only")
    with pytest.raises(ValueError, match="recompute must be one of"):
        build_planner("optimal", cm, 10.0, recompute="on")


def test_refinement_factors_of_a_recomputed_layer_are_its_strategys():
    cm = _rc_fixture()
    pl = build_planner("optimal", cm, 1e9, refinement=True)
    ref = pl.refinement
    assert ref.families == ("fast", "lean", "nonlayer")
    before = pl.costs(1024, 1)
    v = ref.contribution([(("fast:rc",) * 2 + ("lean",) * 2, 1024)], 1.0, 2.0, 10.0, 13.0,
                         layer_seconds=lambda e, s: pl.layer_seconds(e, s, 1))
    for _ in range(5):
        ref.apply(v)
    after = pl.costs(1024, 1)
    i, j = after.names.index("fast"), after.names.index("fast:rc")
    ft, fm = ref.factors("fast", 1024)
    assert ft > 1 and fm > 1 and ref.factors("fast:rc", 1024) == (ft, fm)
    assert math.isclose(after.t[i], before.t[i] * ft) and math.isclose(after.t[j], before.t[j] * ft)
    assert math.isclose(after.m[j], before.m[j] * fm)


def test_solve_nested_equals_enumeration_without_a_seed():
    """The ordered subproblem alone (no incumbent: the search's first plan is its own) against
    every count vector: infinite LP bounds at the top of a scan (the rest cannot fit) end no
    scan, and the symmetry (an earlier, faster, no larger strategy takes the layer) loses no
    optimum; equal saved bytes, as recomputed layers have, included."""
    rng = random.Random(31)
    found = 0
    for case in range(300):
        q, L = rng.randint(2, 5), rng.randint(1, 9)
        t = [rng.uniform(1, 3) for _ in range(q)]
        m = [rng.choice([1.0, rng.uniform(0.5, 6)]) for _ in range(q)]
        base = rng.uniform(0, L * max(m))
        caps = sorted(base + rng.uniform(0, 4) for _ in range(q))
        got, counts = solve_nested(t, m, caps, L)
        best = math.inf
        for ks in itertools.product(range(L + 1), repeat=q):
            if sum(ks) == L and all(sum(k * mi for k, mi in zip(ks[:j + 1], m)) <= caps[j] for j in range(q)):
                best = min(best, sum(k * ti for k, ti in zip(ks, t)))
        assert (counts is None) == (best == math.inf), case
        if counts is not None:
            found += 1
            assert math.isclose(got, best, rel_tol=1e-12), (case, got, best)
            assert sum(counts) == L
    assert found > 150, found


def test_cli_recompute(capsys, monkeypatch):
    from megatron_paradyse.planner import cli

    monkeypatch.setattr(cli, "load_model", lambda a: _rc_fixture())
    args = ["--seq-lens", "1k,8k", "--memory-budget", str(45.0 / 2**30), "--memory-margin", "0"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "recompute auto" in out and "uniform fast:rc" in out and ":rc*" in out
    assert "== s = 8192" in out and "nothing fits" not in out.split("== s = 8192")[1]
    assert cli.main(args + ["--recompute", "off"]) == 0
    out = capsys.readouterr().out
    assert ":rc" not in out and "nothing fits" in out
