"""The planners on packs (``PackShape``, b = 1) with the analytic and the shipped fitted cost
models of the demo shape: exact (equal to brute force over every per-layer tuple of the pack's
costs, ``CostModel.step``), never over budget by the model, cached apart from single lengths."""
from __future__ import annotations

import itertools
import random

import pytest

from megatron_paradyse.costmodel import AnalyticCostModel, build_cost_model, demo_shape
from megatron_paradyse.costmodel.base import CostModel
from megatron_paradyse.costmodel.packs import random_packs
from megatron_paradyse.parallel.packing import PackShape
from megatron_paradyse.planner import build_planner
from megatron_paradyse.planner.core import plan_key


def _models():
    return [AnalyticCostModel(demo_shape(2)), AnalyticCostModel(demo_shape(4)), build_cost_model(demo_shape(2))]


class _Memo(CostModel):
    """``cm`` with its per-entry answers remembered, so that ``CostModel.step`` on thousands of
    tuples stays fast (the same numbers: ``step`` is the base class's on ``cm``'s answers)."""

    def __init__(self, cm):
        self.cm, self.strategies, self.num_layers, self._got = cm, cm.strategies, cm.num_layers, {}

    def _memo(self, *key):
        if key not in self._got:
            self._got[key] = getattr(self.cm, key[0])(*key[1:])
        return self._got[key]

    def layer(self, n, s, b):
        return self._memo("layer", n, s, b)

    def pool(self, n, s, b):
        return self._memo("pool", n, s, b)

    def nonlayer(self, s, b):
        return self._memo("nonlayer", s, b)

    def resident_bytes(self, s, b):
        return self._memo("resident_bytes", s, b)

    def static_bytes(self):
        return self._memo("static_bytes")


def _priced(cm, pack, entries, cache: dict | None = None) -> list:
    """``(seconds, peak, layers)`` of every per-layer tuple of ``entries``; kept in ``cache``
    (one test's, for one model) by pack and entries, so a test's budgets price them once."""
    key = (pack, entries)
    if cache is None or key not in cache:
        memo = _Memo(cm)
        got = [(c.seconds, c.peak_bytes, layers) for layers in itertools.product(entries, repeat=cm.num_layers)
               for c in (memo.step(layers, pack, 1),)]
        if cache is None:
            return got
        cache[key] = got
    return cache[key]


def _brute(cm, pack, limit, entries=None, cache: dict | None = None):
    """(seconds, layers) of the fastest per-layer tuple of ``entries`` (default the strategies)
    whose ordered peak fits, or None."""
    best = None
    for seconds, peak, layers in _priced(cm, pack, tuple(entries or cm.strategies), cache):
        if peak <= limit and (best is None or seconds < best[0]):
            best = (seconds, layers)
    return best


def _packs(rng, n):
    out = []
    for _ in range(n):
        T = rng.choice([96, 512, 1000, 2048])
        out.append(random_packs([T], 1, seed=rng.randrange(10 ** 6))[0])
    return out + [PackShape((72, 900, 31)), PackShape((4,) * 64)]


@pytest.mark.parametrize("which", range(3))
def test_optimal_on_packs_equals_brute_force_and_fits(which):
    cm = _models()[which]
    rng = random.Random(25 + which)
    for pack in _packs(rng, 6):
        uniform = sorted(cm.step((st,) * cm.num_layers, pack, 1).peak_bytes for st in cm.strategies)
        for budget in (uniform[0] * 0.9, uniform[0] * 1.02, rng.uniform(uniform[0], uniform[-1]), uniform[-1] * 1.1):
            pl = build_planner("optimal", cm, budget, recompute="off")
            got = pl.choose(pack, 1)
            want = _brute(cm, pack, pl.limit)
            if want is None:
                assert not got.fits and not pl.fits_at(pack, 1)
                continue
            assert got.fits, (pack, budget)
            # memory-safe: the plan as run (its layers in order) is within budget - margin by the model
            step = cm.step(got.layers, pack, 1)
            assert step.peak_bytes <= pl.limit and abs(step.peak_bytes - got.peak_bytes) <= 1e-6 * step.peak_bytes
            assert got.seconds == pytest.approx(want[0], rel=1e-9), (pack, budget, got.layers, want)
            h = build_planner("heuristic", cm, budget, recompute="off").choose(pack, 1)
            if h.fits:  # the heuristic plans with the order-free bound: never over budget either
                assert cm.step(h.layers, pack, 1).peak_bytes <= pl.limit * (1 + 1e-12)


@pytest.mark.parametrize("which", range(3))
def test_optimal_with_recompute_on_packs_equals_brute_force_and_fits(which):
    """Strategy x recompute on packs (where the cost model prices ``:rc`` entries): equal to
    brute force over every per-layer tuple of the 20 candidates (plain, ``:rc``, ``:rc-attn``,
    ``:rc-mlp``: 160,000 tuples a pack), within budget by the model. One pack per model, the
    models taking turns: a random pack or (72, 900, 31)."""
    cm = _models()[which]
    if not cm.recomputes():
        pytest.skip(f"{type(cm).__name__} does not price recomputed layers")
    rng = random.Random(125 + which)
    rc_used, priced = 0, {}
    for pack in [_packs(rng, 1)[which % 2]]:  # a random pack, or (72, 900, 31)
        leanest = min(cm.step((st + ":rc",) * cm.num_layers, pack, 1).peak_bytes for st in cm.strategies)
        plain = min(cm.step((st,) * cm.num_layers, pack, 1).peak_bytes for st in cm.strategies)
        for budget in (leanest * 1.03, (leanest + plain) / 2, plain * 1.05):
            pl = build_planner("optimal", cm, budget)
            assert any(e.endswith(":rc") for e in pl.entries)
            got, want = pl.choose(pack, 1), _brute(cm, pack, pl.limit, pl.entries, priced)
            assert got.fits == (want is not None), (pack, budget)
            if want is None:
                continue
            rc_used += any(e.endswith(":rc") for e in got.layers)
            step = cm.step(got.layers, pack, 1)
            assert step.peak_bytes <= pl.limit and abs(step.peak_bytes - got.peak_bytes) <= 1e-6 * step.peak_bytes
            assert got.seconds == pytest.approx(want[0], rel=1e-9), (pack, budget, got.layers, want)
    assert rc_used


def test_packs_are_planned_and_cached_apart_from_lengths():
    cm = AnalyticCostModel(demo_shape(2))
    pl = build_planner("optimal", cm, 2 ** 30)
    one, pack = pl.choose(1024, 1), pl.choose(PackShape((1024,)), 1)
    assert plan_key(PackShape((1024,))) != plan_key(1024)
    assert len(pl._cache) == 2 and one.fits and pack.fits
    # many short documents: less attention than one sequence of the same length
    short = pl.choose(PackShape((16,) * 64), 1)
    assert short.seconds < one.seconds
    assert pl.plan(PackShape((16,) * 64), 1) == short
    with pytest.raises(ValueError, match="b must be 1"):
        pl.choose(PackShape((16,) * 64), 2)
    # a pack of 1003 tokens is padded to a multiple of p by the model (no divisibility error)
    assert pl.choose(PackShape((72, 900, 31)), 1).fits


def test_no_fit_on_a_pack_names_it():
    cm = AnalyticCostModel(demo_shape(2))
    pl = build_planner("optimal", cm, cm.static_bytes() * 1.01)
    c = pl.choose(PackShape((72, 900, 31)), 1)
    assert not c.fits and "pack of 3 documents (72, 900, 31: 1003 tokens)" in c.reason


def test_plan_command_takes_a_pack(capsys):
    from megatron_paradyse.planner.cli import main

    assert main(["--p", "2", "--analytic", "--pack", "72,900,31", "--seq-lens", "1024", "--memory-budget", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "== s = 1024" in out and "== pack of 3 documents (72, 900, 31: 1003 tokens)" in out
    with pytest.raises(SystemExit) as e:
        main(["--p", "2", "--analytic", "--pack", "72,900", "--micro-batch", "2", "--memory-budget", "1"])
    assert e.value.code == 2


def test_trainer_hook_plans_a_packed_micro_batch_on_its_documents():
    import types

    import torch

    from megatron_paradyse.planner import NoFitError, make_plan_fn

    cm = AnalyticCostModel(demo_shape(2))
    pack = PackShape((72, 900, 32))
    mb = types.SimpleNamespace(tokens=torch.zeros(1, 1004, dtype=torch.long), lengths=(72, 900, 32), plan_length=pack)
    pl = build_planner("optimal", cm, 2 ** 30)
    fn = make_plan_fn(pl, on_no_fit="truncate")
    assert fn(mb, 0, 0) == pl.choose(pack, 1).layers and fn.choices[0] == pl.choose(pack, 1)
    tight = make_plan_fn(build_planner("optimal", cm, cm.static_bytes() * 1.01), on_no_fit="truncate")
    with pytest.raises(NoFitError, match="never truncated"):
        tight(mb, 0, 1)


# ---- packs and plans chosen together: never predicted behind a uniform packed plan -----------

def _uniform_total(cm, packs, entry, limit, update):
    """Predicted seconds of ``entry`` on every layer over ``packs`` (one step each), or None when a
    pack does not fit ``limit`` with it."""
    total = 0.0
    for pack in packs:
        c = cm.step((entry,) * cm.num_layers, PackShape(pack), 1)
        if c.peak_bytes > limit:
            return None
        total += c.seconds + update
    return total


@pytest.mark.parametrize("seed", range(4))
def test_packs_and_plans_together_never_predicted_behind_a_uniform_packed_plan(seed):
    """Random corpora (log-normal lengths) and budgets, the shipped fitted model of the demo shape:
    the balanced packing with the optimal planner's cost and fit (each pack a step, as in the
    benchmark: an optimizer update each) is predicted no slower than any uniform plan, plain
    or recomputed, on the greedy token-cap packs a static system runs, where that plan fits
    every pack within the planner's limit."""
    from megatron_paradyse.data import PackScheduler, make_pack_fns
    from megatron_paradyse.parallel.plans import make_entry

    rng = random.Random(100 + seed)
    cm = build_cost_model(demo_shape(2 + 2 * (seed % 2)))
    lengths = [max(8, min(2000, int(rng.lognormvariate(5.0, 1.2)))) for _ in range(rng.randrange(12, 28))]
    cap = 2048
    tp_peaks = [cm.step(("tp_sp",) * cm.num_layers, PackShape((d,)), 1).peak_bytes for d in (256, 1024, 2048)]
    compared = 0
    for budget in (tp_peaks[0] * 1.3, tp_peaks[1], tp_peaks[2] * 1.2):
        pl = build_planner("optimal", cm, budget)
        update = pl.update_seconds()
        if not all(pl.choose(PackShape((d,)), 1).fits for d in lengths):
            continue
        cost_fn, fits_fn = make_pack_fns(pl, per_pack_seconds=update)
        mine = PackScheduler(lambda g: lengths[g], len(lengths), 1, token_cap=cap, mode="balanced",
                             cost_fn=cost_fn, fits_fn=fits_fn).step_packs(0)[0]
        ours = sum(cost_fn(tuple(lengths[g] for g in p)) for p in mine)
        assert all(fits_fn(tuple(lengths[g] for g in p)) for p in mine)
        greedy = PackScheduler(lambda g: lengths[g], len(lengths), 1, token_cap=cap, mode="greedy").step_packs(0)[0]
        greedy = [tuple(lengths[g] for g in p) for p in greedy]
        for st in cm.strategies:
            for rc in (False, True):
                theirs = _uniform_total(cm, greedy, make_entry(st, rc), pl.limit, update)
                if theirs is not None:
                    compared += 1
                    assert ours <= theirs * (1 + 1e-9), (budget, st, rc, ours, theirs)
    assert compared > 0
