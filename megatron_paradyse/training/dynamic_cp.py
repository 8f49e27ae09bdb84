"""The plugin trainer's Dynamic CP data path: every rank reads the step's whole global batch of
documents, gets the step's schedule (rounds of blocks of nodes, each with its documents), and
yields its own block's micro-batch per round, packed and padded to 2 x c x p tokens.

A schedule is a list of rounds; a round is a tuple of assignments (``first``, ``size``,
``documents``: indices into the step's documents in pack order, ``plan``: a plan or None for the
trainer's plan rule) whose blocks partition the pool (``parallel.dynamic_cp.check_round``).
Every rank runs one micro-batch per round, so every rank runs the same number (megatron's
schedule needs that); a node with nothing to run in a round runs a pack of padding alone.

With the planner the schedule is ``planner.dynamic_cp.plan_dynamic_cp``'s (``training/planning.py:
dynamic_cp_schedule_fn``) and each micro-batch runs its assignment's plan (:func:`assigned_plan`).
With ``--paradyse-plan`` it is :func:`placeholder_schedule`: each document alone, at the smallest
power-of-two c from ``--min-dynamic-context-parallel-size`` whose tokens per node fit
``--max-seqlen-per-dp-cp-rank`` (without it, at the smallest size), rounds filled largest first,
every micro-batch under the plan rule.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import data as pdata
from ..errors import UserError
from ..parallel.dynamic_cp import check_round, mine


@dataclasses.dataclass(frozen=True)
class PlaceholderAssignment:
    """One micro-batch of a round: nodes ``[first, first + size)``, the step's ``documents``
    packed in this order, its ``plan`` (None: the trainer's plan rule decides)."""

    first: int
    size: int
    documents: tuple
    plan: tuple | None = None


def _size_for(length: int, nodes: int, min_size: int, max_seqlen: int | None) -> int:
    c = min_size
    while max_seqlen is not None and -(-length // c) > max_seqlen and c < nodes:
        c *= 2
    if max_seqlen is not None and -(-length // c) > max_seqlen:
        raise UserError(f"a document of {length} tokens does not fit --max-seqlen-per-dp-cp-rank {max_seqlen} "
                        f"even on the whole pool of {nodes} nodes")
    return c


def placeholder_schedule(lengths, nodes: int, min_size: int = 1, max_seqlen: int | None = None) -> list:
    """A stand-in for the Dynamic CP planner (see the module's text): rounds of
    :class:`PlaceholderAssignment`, every round's blocks partitioning the ``nodes`` nodes."""
    sizes = [_size_for(n, nodes, min_size, max_seqlen) for n in lengths]
    rounds: list = []  # each: [assignments, free flags per node]
    for i in sorted(range(len(lengths)), key=lambda i: (-sizes[i], -lengths[i], i)):
        c = sizes[i]
        for items, free in rounds:
            first = next((f for f in range(0, nodes, c) if all(free[f:f + c])), None)
            if first is not None:
                break
        else:
            items, free = [], [True] * nodes
            rounds.append((items, free))
            first = 0
        items.append(PlaceholderAssignment(first, c, (i,)))
        free[first:first + c] = [False] * c
    out = []
    for items, free in rounds:
        items += [PlaceholderAssignment(f, min_size, ()) for f in range(0, nodes, min_size) if free[f]]
        out.append(tuple(sorted(items, key=lambda a: a.first)))
    return out


def assigned_plan(mb, step: int, index: int):
    """The planned iterator's ``plan_fn`` under the Dynamic CP planner: the plan the step's
    schedule assigned to this node's micro-batch (the same on every rank of its block)."""
    return mb.plan


def padding_pack(total: int) -> pdata.MicroBatch:
    """A micro-batch of ``total`` padding tokens (one padding document, no loss)."""
    z = torch.zeros((1, total), dtype=torch.long)
    return pdata.MicroBatch(z, z.clone(), torch.zeros((1, total)), torch.arange(total).unsqueeze(0), (),
                            cu_seqlens=(0, total))


class DynamicCPLoader:
    """This node's micro-batches under Dynamic CP: per step, the schedule of the step's global
    batch (``schedule_fn(lengths) -> rounds``) and this node's block's pack of each round, with
    ``cp_block`` (first node, c) and the assignment's plan. ``counts(step)``: the step's rounds
    (the same on every rank), for the planned iterator."""

    def __init__(self, dataset, global_batch_size: int, nodes: int, node: int, p: int, schedule_fn,
                 start_step: int = 0, pad_id: int = 0):
        self.dataset, self.gbs, self.nodes, self.node, self.p = dataset, global_batch_size, nodes, node, p
        self.schedule_fn, self.pad_id = schedule_fn, pad_id
        self.step, self._queue, self._cache = start_step, [], {}

    def documents(self, step: int) -> list:
        """The step's global batch, Megatron's order (samples ``step * gbs`` ..)."""
        return [self.dataset[i] for i in range(step * self.gbs, (step + 1) * self.gbs)]

    def schedule(self, step: int) -> list:
        """The step's rounds (computed once per step; every round checked to partition the pool)."""
        got = self._cache.get(step)
        if got is None:
            docs = self.documents(step)
            rounds = self.schedule_fn([len(d) - 1 for d in docs])
            for round_ in rounds:
                check_round(round_, self.nodes)
            # this step and the one before: the step read ahead must not drop the step just run
            self._cache = {k: v for k, v in self._cache.items() if k == step - 1}
            got = self._cache[step] = (rounds, docs)
        return got

    def counts(self, step: int) -> tuple:
        n = len(self.schedule(step)[0])
        return n, n

    def __iter__(self):
        return self

    def __next__(self) -> pdata.MicroBatch:
        if not self._queue:
            rounds, docs = self.schedule(self.step)
            self._queue = [self._micro_batch(mine(r, self.node), docs) for r in rounds]
            self.step += 1
        return self._queue.pop(0)

    def _micro_batch(self, item, docs) -> pdata.MicroBatch:
        unit = 2 * item.size * self.p
        if item.documents:
            mb = pdata.pack_documents([docs[i] for i in item.documents], multiple=unit, pad_id=self.pad_id)
        else:
            mb = padding_pack(unit)
        return dataclasses.replace(mb, cp_block=(item.first, item.size),
                                   plan=None if item.plan is None else tuple(item.plan))
