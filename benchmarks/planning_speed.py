"""Planning time per micro-batch: 100 layers x 5 strategies, and x recompute (no timed test;
this prints the numbers).

    python -m benchmarks.planning_speed [--layers 100] [--lengths 200] [--repeat 3] [--only rc]

For each planner (heuristic; optimal, exact over ordered plans; ``opt-free``, the optimal
planner under the order-free bound) and each cost model (the analytic model of the demo's
shape with 100 layers; a synthetic table model whose budget forces mixed plans everywhere; the
synthetic model with recompute, ``synthetic + rc``: each strategy also as ``:rc``, 10
candidates per layer, with the pools of the analytic model so that the sets of strategies
matter; and the analytic model with recompute when it prices ``:rc`` entries), it
plans ``--lengths`` distinct padded lengths with the cache cleared before every call (the
uncached cost: cost-model queries + search; lengths where nothing fits are timed apart: their
message bisects for the longest length that fits), then the same lengths again from the cache
(``plan``: cached choice + hysteresis), and prints the mean and worst time per micro-batch and
how many plans were mixed.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

from megatron_paradyse.costmodel.base import CostModel, LayerCost
from megatron_paradyse.parallel.plans import split_entry
from megatron_paradyse.planner import build_planner


class Synthetic(CostModel):
    """Five strategies with distinct (time, saved, transient) slopes; costs linear in s*b."""

    TABLE = {"tp_sp": (1.0, 8.0, 2.0), "ulysses": (1.1, 6.0, 3.0), "ring": (1.4, 5.0, 1.0),
             "colossal": (1.8, 3.0, 30.0), "metp": (2.5, 1.5, 0.5)}

    def __init__(self, layers):
        self.strategies = tuple(self.TABLE)
        self.num_layers = layers

    def layer(self, strategy, s, b):
        t, m, x = self.TABLE[strategy]
        u = s * b / 1024.0
        return LayerCost(t * u * (1 + u / 64), m * u * 2**20, x * u * 2**20)

    def static_bytes(self):
        return 2**30

    def nonlayer(self, s, b):
        u = s * b / 1024.0
        return LayerCost(0.1 * u, 0.5 * u * 2**20, 0.5 * u * 2**20)


class SyntheticRc(Synthetic):
    """:class:`Synthetic` with each strategy also recomputed (``tp_sp:rc``): a third more time
    (the forward again), the layer's input saved (a sixteenth of tp_sp's saved bytes, the same
    for every strategy), a transient of the strategy's saved plus transient bytes; and per-strategy
    communication pools (buffers shared by name, as the strategies' are)."""

    POOLS = {"tp_sp": {"ag": 1.0}, "ulysses": {"a2a": 1.5}, "ring": {"kv": 0.5, "a2a": 0.5},
             "colossal": {"ag": 2.0}, "metp": {"ag": 0.5, "kv": 0.25}, "nonlayer": {"ag": 0.25}}

    def recomputes(self):
        return True

    def layer(self, strategy, s, b):
        name, rc = split_entry(strategy)
        c = super().layer(name, s, b)
        if not rc:
            return c
        u = s * b / 1024.0
        return LayerCost(c.seconds * 4 / 3, 0.5 * u * 2**20, c.saved_bytes + c.transient_bytes)

    def pool(self, strategy, s, b):
        u = s * b / 1024.0
        return {k: v * u * 2**20 for k, v in self.POOLS[split_entry(strategy)[0]].items()}


def bench(planner, lengths, repeat):
    """Per call (seconds): cost-model queries, search, whole uncached choose; cached plan."""
    q, srch, whole = [], [], []
    for _ in range(repeat):
        for s in lengths:
            planner._cache.clear()
            planner._costs.clear()
            t0 = time.perf_counter()
            costs = planner.costs(s, 1)
            t1 = time.perf_counter()
            planner._search(costs, s, 1)
            t2 = time.perf_counter()
            planner._cache.clear()
            planner._costs.clear()
            t3 = time.perf_counter()
            planner.choose(s, 1)
            whole.append(time.perf_counter() - t3)
            q.append(t1 - t0)
            srch.append(t2 - t1)
    for s in lengths:  # fill the cache
        planner.choose(s, 1)
    cached = []
    for s in lengths:
        t0 = time.perf_counter()
        planner.plan(s, 1)  # cached choice + hysteresis against the previous plan
        cached.append(time.perf_counter() - t0)
    mixed = sum(len(set(planner.choose(s, 1).layers)) > 1 for s in lengths)
    fits = sum(planner.choose(s, 1).fits for s in lengths)
    rc = sum(any(split_entry(e)[1] for e in planner.choose(s, 1).layers) for s in lengths)
    return dict(query=q, search=srch, whole=whole, cached=cached, mixed=mixed, fits=fits, n=len(lengths), rc=rc)


def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--lengths", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=("plain", "rc"), default=None,
                    help="only the cases without (plain) or with recompute (rc)")
    a = ap.parse_args(argv)
    from megatron_paradyse.costmodel import demo_shape
    from megatron_paradyse.costmodel.analytic import AnalyticCostModel

    rng = random.Random(0)
    models = []
    am = AnalyticCostModel(dataclasses.replace(demo_shape(4), num_layers=a.layers))
    lens = sorted({4 * rng.randint(64, 16384) for _ in range(a.lengths)})
    # budget: tp_sp fits at the short end, only mixes or metp near the long end
    budget = am.step({"tp_sp": a.layers}, 16384, 1).peak_bytes
    models.append(("analytic demo shape", am, budget, lens))
    sm = Synthetic(a.layers)
    lens2 = sorted({4 * rng.randint(256, 8192) for _ in range(a.lengths)})
    budget2 = sm.step({"ring": a.layers}, 4 * 4096, 1).peak_bytes
    models.append(("synthetic", sm, budget2, lens2))
    rm = SyntheticRc(a.layers)
    # the same lengths and budget: plain plans fit up to 16k, recomputed layers let longer ones fit
    models.append(("synthetic + rc", rm, rm.step({"ring": a.layers}, 4 * 4096, 1).peak_bytes, lens2))
    if getattr(am, "recomputes", lambda: False)():
        models.append(("analytic demo + rc", am, budget, lens))
    if a.only:
        models = [m for m in models if ("rc" in m[0]) == (a.only == "rc")]
    print(f"planning time per micro-batch, {a.layers} layers x 5 strategies (x recompute: 10 candidates), "
          f"{a.lengths} lengths, "
          f"caches cleared before each call (x{a.repeat}); ms unless said; p95 = 95th percentile "
          "(the shared machine's scheduling shows in the tail)")
    print(f"{'cost model':<21}{'planner':<10}{'cands':>6}{'queries med':>12}{'search med':>11}{'search p95':>11}"
          f"{'uncached med':>13}{'uncached p95':>13}{'cached us':>10}{'mixed':>6}{'fit':>5}    rc")
    for label, cm, budget, lengths in models:
        for kind, kw in (("heuristic", {}), ("optimal", {}), ("opt-free", {"order": "free"})):
            rc = "auto" if "rc" in label else "off"
            pl = build_planner("optimal" if kw else kind, cm, budget, recompute=rc, **kw)
            r = bench(pl, lengths, a.repeat)
            ms = lambda xs, p: 1e3 * _pct(xs, p)  # noqa: E731
            print(f"{label:<21}{kind:<10}{len(pl.entries):>6}{ms(r['query'], .5):12.3f}{ms(r['search'], .5):11.3f}"
                  f"{ms(r['search'], .95):11.3f}{ms(r['whole'], .5):13.3f}{ms(r['whole'], .95):13.3f}"
                  f"{1e6 * statistics.median(r['cached']):10.1f}{r['mixed']:>6}{r['fits']:>4}/{r['n']}"
                  + (f"{r['rc']:>5}" if "rc" in label else ""))


if __name__ == "__main__":
    main()
