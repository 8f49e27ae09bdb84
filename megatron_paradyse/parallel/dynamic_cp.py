"""Dynamic context parallelism: a CP size per micro-batch inside the DP x CP pool.

The pool is the world's N = world / p nodes with PP = 1 (megatron's rank order, TP fastest:
node n holds ranks ``n*p .. n*p+p-1``; a node is one switching group). A micro-batch runs on
a :class:`NodeBlock` of c nodes (c a power of two, the block aligned: its first node a multiple of
c), as CP rank ``node - first`` of a CP group of c ranks at each TP rank, with the in-node plan
chosen for it at that c. Aligned blocks of one round partition the pool without conflicts.

:class:`DynamicCPGroups` makes every CP group once, at start-up, on every rank, in one order
(every rank calls every ``new_group``): for each power-of-two size c from ``min_size`` (at
least 2: c = 1 needs no group) to N, each aligned block, each TP rank. Weights are replicated
over the pool, so a rank joins any of them with nothing moved.

The current micro-batch's place lives in the runtime registry (``runtime.cache``), where
``context.cp_of`` reads it: :func:`enable` turns Dynamic CP on for the process (a model built
with ``context_parallel_size = 1``: megatron never slices its rotary table and never reads a
CP group), :func:`use_place` sets the place before a micro-batch's forward and leaves it for
its backward (a recompute replays the forward there) until the next micro-batch sets another.
Every micro-batch runs as a pack (one long document is a pack of one), cut into the place's
2c chunks (``context.split_for_cp``), its RoPE from in-document positions.
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from .. import runtime
from .context import DYNAMIC_CP, CPPlace


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class NodeBlock:
    """Nodes ``[first, first + size)`` of the pool: ``size`` a power of two, ``first`` a
    multiple of ``size`` (aligned buddy blocks)."""

    first: int
    size: int

    def __post_init__(self):
        if not is_power_of_two(self.size) or self.first < 0 or self.first % self.size:
            raise ValueError(f"a Dynamic CP block is {self.size} nodes from node {self.first}: its size must be "
                             "a power of two and its first node a multiple of its size")

    def holds(self, node: int) -> bool:
        return self.first <= node < self.first + self.size


Block = NodeBlock  # the name the Dynamic CP design uses (``zigzag.Block`` is a ring layout's block)


def sizes(nodes: int, min_size: int = 1) -> tuple:
    """The powers of two c with ``min_size <= c <= nodes``."""
    return tuple(c for c in (1 << k for k in range(nodes.bit_length())) if min_size <= c <= nodes)


def check_round(blocks, nodes: int) -> None:
    """ValueError unless ``blocks`` (:class:`NodeBlock` or anything with ``first`` and ``size``)
    partition the pool's ``nodes`` nodes: every node in exactly one block."""
    seen = []
    for b in blocks:
        NodeBlock(b.first, b.size)
        seen.extend(range(b.first, b.first + b.size))
    if sorted(seen) != list(range(nodes)):
        raise ValueError(f"a Dynamic CP round's blocks {[(b.first, b.size) for b in blocks]} do not "
                         f"partition the pool's {nodes} nodes (each node in exactly one block)")


def mine(round_, node: int):
    """The entry of ``round_`` (items with ``first`` and ``size``) whose block holds ``node``."""
    for item in round_:
        if item.first <= node < item.first + item.size:
            return item
    raise ValueError(f"no block of the round holds node {node}")


class DynamicCPGroups:
    """Every Dynamic CP group of the pool, made at once on every rank in one order."""

    def __init__(self, p: int, min_size: int = 1, max_size: int | None = None):
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % p:
            raise ValueError(f"a world of {world} ranks is not a whole number of nodes of p={p}")
        self.p, self.nodes = p, world // p
        self.node, self.tp_rank = rank // p, rank % p
        self.sizes = sizes(self.nodes if max_size is None else min(max_size, self.nodes), min_size)
        self.by_block: dict = {}
        for c in self.sizes:
            if c == 1:
                continue
            for first in range(0, self.nodes - c + 1, c):
                for t in range(p):
                    group = dist.new_group([(first + k) * p + t for k in range(c)])
                    if first <= self.node < first + c and t == self.tp_rank:
                        self.by_block[(first, c)] = group

    def place(self, block) -> CPPlace | None:
        """This rank's :class:`CPPlace` in ``block`` (anything with ``first`` and ``size``), or
        None at c = 1 or for a rank outside the block."""
        block = NodeBlock(block.first, block.size)
        if block.size == 1 or not block.holds(self.node):
            return None
        if block.size not in self.sizes:
            raise ValueError(f"no Dynamic CP group of size {block.size}: this run's sizes are {list(self.sizes)}")
        return CPPlace(block.size, self.node - block.first, self.by_block[(block.first, block.size)])


def enable(groups: DynamicCPGroups | None = None) -> None:
    """Dynamic CP on for this process: ``context.cp_of`` answers the current place (None: c = 1);
    ``groups``: the run's groups, which :func:`place_of` reads."""
    cache = runtime.cache(DYNAMIC_CP)
    cache["place"], cache["groups"] = None, groups


def disable() -> None:
    runtime.cache(DYNAMIC_CP).clear()


def place_of(block) -> CPPlace | None:
    """This rank's place in ``block`` (``(first, size)``, or None: c = 1) of the groups
    :func:`enable` was given."""
    if block is None:
        return None
    groups = runtime.cache(DYNAMIC_CP).get("groups")
    if groups is None:
        raise RuntimeError("Dynamic CP is not enabled with its groups in this process (dynamic_cp.enable(groups))")
    first, size = block
    return groups.place(NodeBlock(first, size))


def enabled() -> bool:
    return "place" in runtime.cache(DYNAMIC_CP)


def use_place(place: CPPlace | None) -> None:
    """The place the next micro-batch runs at (and its backward, until another is set)."""
    cache = runtime.cache(DYNAMIC_CP)
    if "place" not in cache:
        raise RuntimeError("Dynamic CP is not enabled in this process (dynamic_cp.enable())")
    cache["place"] = place


def current() -> CPPlace | None:
    return runtime.cache(DYNAMIC_CP).get("place")
