"""A length-aware sampler: micro-batches of similar lengths, predicted work balanced across replicas.

The sample stream (``dataset[g]`` for ``g = 0, 1, ...``; the dataset shuffles per epoch) is
cut into *windows* of ``window_steps`` global batches. Inside window ``w``:

1. the window's samples are sorted by length (ties by position), and cut into micro-batches
   of ``micro_batch_size`` consecutive samples: similar lengths, little padding;
2. the micro-batches are sorted by predicted cost and cut into *rounds* of ``dp_size``
   consecutive ones (one per replica: similar costs), and the rounds are shuffled with
   ``(seed, w)`` and dealt ``num_microbatches`` to a step, so every step mixes lengths;
3. inside a step, rounds are taken from the most to the least expensive and each round's
   micro-batches go, most expensive first, to the replicas with the least predicted work so
   far (longest-processing-time first, with each replica getting one micro-batch per round).

Everything is a pure function of ``(seed, window)``: every rank derives the same assignment
without communication, the same seed gives the same batches, and a run resumed at step ``k``
reads exactly what the uninterrupted run reads from step ``k`` on (the state is the step).
Each sample of the stream is used exactly once.

The cost of a micro-batch is ``cost_fn(s, b)`` for its padded length ``s`` and size ``b``:
:func:`make_cost_fn` builds it from a planner (the seconds of its plan), a cost model (the
seconds of the step under ``tp_sp``), or, with neither, ``b * s`` tokens (``"tokens"``) or
``b * s**2`` (``"s2"``, attention-dominated).
"""
from __future__ import annotations

import numpy as np

from ..planner.core import last_true
from .datasets import padded_length


def make_cost_fn(planner=None, cost_model=None, fallback: str = "tokens", num_layers: int | None = None):
    """``cost_fn(s, b) -> float`` for balancing (see the module docstring)."""
    if planner is not None:
        query = getattr(planner, "choose", planner.plan)  # choose: no hysteresis state touched

        def cost(s, b):
            return float(query(int(s), int(b)).seconds)
        return cost
    if cost_model is not None:
        n = num_layers or cost_model.num_layers
        plan = ("tp_sp",) * n

        def cost(s, b):
            return float(cost_model.step(plan, int(s), int(b)).seconds)
        return cost
    if fallback == "tokens":
        return lambda s, b: float(b * s)
    if fallback == "s2":
        return lambda s, b: float(b * s * s)
    raise ValueError(f"fallback must be 'tokens' or 's2', got {fallback!r}")


def longest_fitting(planner, micro_batch_size: int, upper: int, multiple: int = 1) -> int:
    """The longest padded length ``<= upper`` (a multiple of ``multiple``) for which
    ``planner.plan(s, b).fits``; 0 if none. Assumes fitting is monotone in ``s`` (bisection)."""
    if hasattr(planner, "longest_fit"):  # megatron_paradyse.planner: no state touched
        return int(planner.longest_fit(micro_batch_size, multiple=multiple, upper=upper))
    query = getattr(planner, "choose", planner.plan)
    return last_true(lambda k: query(k * multiple, micro_batch_size).fits, int(upper) // multiple) * multiple


class LengthAwareSampler:
    """Indices of each micro-batch of each step on each data-parallel replica (module docstring)."""

    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int, dp_size: int = 1,
                 seed: int = 1234, window_steps: int = 8, multiple: int = 1, cost_fn=None):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"global batch size {global_batch_size} is not divisible by micro batch "
                             f"size {micro_batch_size} x data-parallel size {dp_size}")
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        self.dataset = dataset
        self.mbs, self.gbs, self.dp_size = micro_batch_size, global_batch_size, dp_size
        self.nmb = global_batch_size // (micro_batch_size * dp_size)
        self.seed, self.window_steps, self.multiple = seed, window_steps, multiple
        self.cost_fn = cost_fn or make_cost_fn()
        self._cache: dict = {}

    def _length(self, g: int) -> int:
        ds = self.dataset
        return int(ds.length(g)) if hasattr(ds, "length") else len(ds[g]) - 1

    def _window(self, w: int) -> list:
        """``steps[k][replica] -> list of micro-batches (lists of stream indices)`` of window ``w``."""
        got = self._cache.get(w)
        if got is not None:
            return got
        n = self.window_steps * self.gbs
        g = np.arange(w * n, (w + 1) * n, dtype=np.int64)
        lens = np.asarray([self._length(int(i)) for i in g], dtype=np.int64)
        order = np.lexsort((g, lens))
        mbs = [g[order[i:i + self.mbs]].tolist() for i in range(0, n, self.mbs)]
        mb_len = [max(lens[order[i:i + self.mbs]]) for i in range(0, n, self.mbs)]
        cost = [self.cost_fn(padded_length(int(s), self.multiple), self.mbs) for s in mb_len]
        by_cost = sorted(range(len(mbs)), key=lambda k: (cost[k], k))
        rounds = [by_cost[i:i + self.dp_size] for i in range(0, len(by_cost), self.dp_size)]
        perm = np.random.default_rng([self.seed, w, 7]).permutation(len(rounds))
        steps = []
        for k in range(self.window_steps):
            chosen = [rounds[j] for j in perm[k * self.nmb:(k + 1) * self.nmb]]
            chosen.sort(key=lambda r: -sum(cost[m] for m in r))
            load = [0.0] * self.dp_size
            per = [[] for _ in range(self.dp_size)]
            for r in chosen:
                ms = sorted(r, key=lambda m: -cost[m])
                reps = sorted(range(self.dp_size), key=lambda d: (load[d], d))
                for m, d in zip(ms, reps):
                    per[d].append(mbs[m])
                    load[d] += cost[m]
            steps.append(per)
        self._cache = {w: steps}  # one window at a time
        return steps

    def step_indices(self, step: int) -> list:
        """``[replica][micro] -> stream indices`` of global batch ``step``."""
        w, k = divmod(int(step), self.window_steps)
        return self._window(w)[k]

    def micro_indices(self, step: int, micro: int, dp_rank: int) -> list:
        return self.step_indices(step)[dp_rank][micro]
