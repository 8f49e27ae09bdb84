"""Online refinement: measured step times and peaks correct the cost model's predictions.

A moving average of the measured/predicted ratio is kept per strategy family and length
bucket (``ceil(log2 s)``), for time and for memory. The planner multiplies each layer's
predicted seconds by its time factor and its bytes by its memory factor (never below 1: a
model that over-predicts memory is left conservative, one that under-predicts is corrected).

Every rank must plan identically, so the factors are updated only from all-reduced inputs:
:meth:`Refinement.contribution` turns one rank's step (its micro-batches' plans and lengths,
predicted and measured time and peak) into a fixed-size vector of weighted ratios,
:meth:`Refinement.step` sums that vector over the world with ONE small all-reduce, and
:meth:`Refinement.apply` updates the factors from the sum, a deterministic function of data
every rank then holds. (The reference code refined per rank, so ranks could disagree.) The
plan check (:mod:`megatron_paradyse.parallel.plan_check`) stays as the safety net.

A step's ratio is attributed to the (family, bucket) cells of its micro-batches in proportion
to their share of the step's predicted time (time) or to their share of the layers (memory).
Families: one per strategy, plus ``nonlayer`` (embedding, output layer, optimizer). A recomputed
layer (plan entry ``tp_sp:rc``) is its strategy's family: it shares the strategy's factors.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..parallel.plan_check import collective_device
from ..parallel.plans import strategy_of

NUM_BUCKETS = 40


def bucket(s: int) -> int:
    return min(NUM_BUCKETS - 1, max(0, math.ceil(math.log2(max(1, int(s))))))


class Refinement:
    def __init__(self, strategies, alpha: float = 0.3, tolerance: float = 0.02, memory_floor: float = 1.0):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.families = tuple(strategies) + ("nonlayer",)
        self._index = {f: i for i, f in enumerate(self.families)}
        self.alpha, self.tolerance, self.memory_floor = float(alpha), float(tolerance), float(memory_floor)
        n = len(self.families) * NUM_BUCKETS
        self.time = [1.0] * n
        self.mem = [1.0] * n
        self._published = (list(self.time), list(self.mem))  # the factors the planner sees
        self.version = 0
        self.updates = 0

    def _cell(self, family: str, s: int) -> int:
        """The cell of ``family`` (a strategy, a plan entry such as ``tp_sp:rc``: its strategy's,
        or ``nonlayer``) at length ``s``."""
        return self._index[strategy_of(family)] * NUM_BUCKETS + bucket(s)

    def factors(self, family: str, s: int) -> tuple:
        c = self._cell(family, s)
        return self._published[0][c], max(self.memory_floor, self._published[1][c])

    def size(self) -> int:
        return 4 * len(self.families) * NUM_BUCKETS

    def contribution(self, micro, predicted_seconds: float, measured_seconds: float,
                     predicted_peak: float | None = None, measured_peak: float | None = None,
                     layer_seconds=None) -> list:
        """One rank's step as a flat list: per cell [w_t, w_t * time ratio, w_m, w_m * mem ratio].

        ``micro``: [(plan layers, padded s)] of this rank's micro-batches (entries with ``:rc``
        count for their strategy); ``layer_seconds(entry, s)`` the predicted seconds of one layer (for the time shares; default: equal per layer).
        ``measured_seconds`` or ``measured_peak`` None: that side was not measured this step.
        """
        n = len(self.families) * NUM_BUCKETS
        v = [0.0] * (4 * n)
        if not micro or not predicted_seconds or predicted_seconds <= 0:
            return v
        rt = measured_seconds / predicted_seconds if measured_seconds and measured_seconds > 0 else None
        rm = (measured_peak / predicted_peak) if predicted_peak and measured_peak else None
        shares: dict = {}
        total = 0.0
        layers_total = sum(len(p) for p, _ in micro)
        lshare: dict = {}
        for plan, s in micro:
            for name in plan:
                w = layer_seconds(name, s) if layer_seconds else 1.0
                c = self._cell(name, s)
                shares[c] = shares.get(c, 0.0) + w
                total += w
                lshare[c] = lshare.get(c, 0.0) + 1.0 / layers_total
        for c, w in shares.items() if rt is not None else ():
            w = w / total if total > 0 else 0.0
            v[4 * c] += w
            v[4 * c + 1] += w * rt
        if rm is not None:
            for c, w in lshare.items():
                v[4 * c + 2] += w
                v[4 * c + 3] += w * rm
        return v

    def apply(self, summed) -> bool:
        """Update the factors from the world's summed contributions; True if the planner's view changed."""
        n = len(self.families) * NUM_BUCKETS
        for c in range(n):
            wt, st, wm, sm = (float(summed[4 * c + k]) for k in range(4))
            if wt > 0:
                a = self.alpha * min(1.0, wt)
                self.time[c] = (1 - a) * self.time[c] + a * (st / wt)
            if wm > 0:
                a = self.alpha * min(1.0, wm)
                self.mem[c] = (1 - a) * self.mem[c] + a * (sm / wm)
        self.updates += 1
        pt, pm = self._published
        moved = any(abs(self.time[c] / pt[c] - 1) > self.tolerance or abs(self.mem[c] / pm[c] - 1) > self.tolerance
                    for c in range(n))
        if moved:
            self._published = (list(self.time), list(self.mem))
            self.version += 1
        return moved

    def step(self, contribution, group=None) -> bool:
        """All-reduce (SUM) ``contribution`` over ``group`` (the world by default) and :meth:`apply` it."""
        t = torch.tensor(contribution, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            t = t.to(collective_device())
            dist.all_reduce(t, group=group)
            t = t.cpu()
        return self.apply(t.tolist())

    def state(self) -> dict:
        return {"time": list(self.time), "mem": list(self.mem), "version": self.version}
