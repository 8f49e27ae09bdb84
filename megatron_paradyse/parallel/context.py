"""Context parallelism: megatron's CP dimension composed with the switching group.

With ``context_parallel_size = C`` a sequence of ``s`` tokens is cut into 2C chunks of
``L = s/(2C)``; CP rank c holds chunks c and 2C-1-c (megatron's ``get_batch_on_this_cp_rank``
order, which balances causal work), ``2L`` local tokens in local order, sequence-sharded over
the p ranks of the switching group between layers. A pack is cut the same way, as one
sequence of its tokens (documents inside one chunk never leave their CP rank).

Every strategy runs inside its node on the local tokens exactly as without CP, and its
attention also covers the keys of the other CP ranks:

* ``tp_sp`` and ``ulysses`` hold heads/p of all 2L local tokens after their gather or
  all-to-all; their K/V travel a ring over the CP group (:func:`cp_layout`: C owners);
* the ring family holds its in-node layout's tokens (``zigzag`` / ``pack_layout``, built on the
  local tokens) with all heads; their K/V travel a two-level ring (``ring_comm.TwoLevelRing``:
  :func:`joint_layout`'s C*p owners): an outer ring over the CP group whose every step runs
  an inner ring over the switching group, so a block crosses nodes C-1 times per pass.

Blocks, causality and the hops a pack skips come from global positions
(``pack_layout.PieceLayout``). RoPE: megatron slices its rotary table by CP rank for one
sequence per row (local positions index it) and not for a pack (in-document positions do).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from .. import runtime
from .pack_layout import PackedLayout, PieceLayout, place
from .ring_comm import RingComm, ring_over
from .packing import Documents
from .zigzag import RingLayout


@dataclasses.dataclass(frozen=True)
class CPPlace:
    """This rank's place in the CP dimension: ``size`` C, ``rank`` c, megatron's CP ``group``."""

    size: int
    rank: int
    group: dist.ProcessGroup


DYNAMIC_CP = "dynamic_cp"  # the runtime cache of Dynamic CP's current place (``dynamic_cp.py``)


def cp_of(config) -> CPPlace | None:
    """The CP dimension of a model built with ``config``, or None without one (C = 1); under
    Dynamic CP (``dynamic_cp.enable``) the current micro-batch's place."""
    dynamic = runtime.cache(DYNAMIC_CP)
    if "place" in dynamic:
        return dynamic["place"]
    size = getattr(config, "context_parallel_size", 1) or 1
    if size == 1:
        return None
    from megatron.core import parallel_state as ps

    group = ps.get_context_parallel_group()
    if dist.get_world_size(group) != size:
        raise RuntimeError(f"the model was built with context_parallel_size={size} but megatron's CP group has "
                           f"{dist.get_world_size(group)} ranks: initialise its parallel state with the same size")
    return CPPlace(size, dist.get_rank(group), group)


def cp_size(config) -> int:
    """C of the current micro-batch: the config's, or under Dynamic CP the current place's."""
    dynamic = runtime.cache(DYNAMIC_CP)
    if "place" in dynamic:
        return dynamic["place"].size if dynamic["place"] is not None else 1
    return getattr(config, "context_parallel_size", 1) or 1


def chunks(size: int, rank: int, local: int) -> tuple:
    """``(local start, local stop, global start)`` of CP rank ``rank``'s two chunks."""
    half = local // 2
    return (0, half, rank * half), (half, local, (2 * size - 1 - rank) * half)


def to_global(size: int, rank: int, local: int, ranges) -> list:
    """Local ``(start, stop)`` ranges of CP rank ``rank`` as global position ranges, in order."""
    out = []
    for a, b in ranges:
        for lo, hi, g in chunks(size, rank, local):
            x, y = max(a, lo), min(b, hi)
            if x < y:
                out.append((g + x - lo, g + y - lo))
    return out


def check_local_length(local: int, size: int, p: int) -> None:
    """ValueError unless ``local`` tokens per CP rank split into two chunks and over p ranks."""
    if local % 2 or local % p:
        raise ValueError(
            f"context parallelism of size {size}: each CP rank holds {local} tokens, which must be "
            f"even (two chunks) and divisible by p={p}: make the sequence length a multiple of "
            f"2 x C x p = {2 * size * p}")


@functools.lru_cache(maxsize=64)
def cp_layout(size: int, local: int, docs: Documents | None) -> PieceLayout:
    """The CP ring of ``tp_sp`` and ``ulysses``: owner c holds CP rank c's 2L local tokens."""
    total = size * local
    return PieceLayout(tuple(place(to_global(size, c, local, [(0, local)]), docs) for c in range(size)), total)


def local_documents(docs: Documents, size: int, rank: int, local: int) -> Documents:
    """The documents of CP rank ``rank``'s local tokens, cut at the chunk boundary (for the
    in-node arrangement only: blocks and RoPE use the global documents)."""
    bounds = {0, local}
    for lo, hi, g in chunks(size, rank, local):
        bounds.add(lo)
        bounds.update(b - g + lo for b in docs.bounds if g < b < g + hi - lo)
    return Documents(tuple(sorted(bounds)))


@functools.lru_cache(maxsize=256)
def inner_layout(p: int, size: int, rank: int, local: int, docs: Documents | None):
    """The ring family's in-node layout of CP rank ``rank``'s local tokens (local positions);
    cached: every layer of a micro-batch asks for the same one."""
    if docs is None:
        return RingLayout(p, local // p)
    return PackedLayout(p, local_documents(docs, size, rank, local))


@functools.lru_cache(maxsize=64)
def joint_layout(size: int, p: int, local: int, docs: Documents | None) -> PieceLayout:
    """The ring family's blocks under CP: owner ``c * p + t`` holds TP rank t's in-node tokens
    of CP rank c, at their global positions."""
    owners = []
    for c in range(size):
        inner = inner_layout(p, size, c, local, docs)
        owners.extend(place(to_global(size, c, local, inner.ranges(t)), docs) for t in range(p))
    return PieceLayout(tuple(owners), size * local)


def rope_positions(cp: CPPlace | None, docs: Documents | None, ranges, device=None):
    """RoPE positions of the local tokens ``ranges`` (local ``(start, stop)``, in order): the
    ranges themselves for one sequence per row (megatron's table is this CP rank's, indexed
    locally), each token's in-document position for a pack (the table is not sliced)."""
    ranges = [tuple(r) for r in ranges]
    if docs is None:
        return ranges[0][0] if len(ranges) == 1 else ranges
    if cp is not None:
        ranges = to_global(cp.size, cp.rank, docs.total // cp.size, ranges)
    return docs.positions(ranges, device)


@dataclasses.dataclass(frozen=True)
class Span:
    """Where a ring strategy's attention runs: the RoPE positions of its tokens
    (:func:`rope_positions`), the ring its K/V travel and the ring's layout of the blocks."""

    positions: int | list | torch.Tensor
    ring: RingComm
    layout: RingLayout | PieceLayout


def ring_span(inner: RingLayout | PackedLayout, group: dist.ProcessGroup, rank: int, cp: CPPlace | None,
              docs: Documents | None, device=None) -> Span:
    """The ring family's attention for this rank, which holds ``inner``'s tokens of rank ``rank``
    of the switching ``group``: that ring alone, or with CP the two-level ring over CP x TP."""
    local_ranges = inner.ranges(rank)
    if cp is None:
        return Span(inner.rope_positions(rank, device), ring_over(group), inner)
    local = docs.total // cp.size if docs is not None else inner.total
    layout = joint_layout(cp.size, inner.p, local, docs)
    return Span(rope_positions(cp, docs, local_ranges, device), ring_over(group, cp.group), layout)


def split_for_cp(x, size: int, rank: int, dim: int = 1):
    """CP rank ``rank``'s two chunks of ``x`` along ``dim`` (megatron's
    ``get_batch_on_this_cp_rank``: chunks ``rank`` and ``2 * size - 1 - rank`` of 2 x size)."""
    if size == 1:
        return x
    if x.shape[dim] % (2 * size):
        raise ValueError(f"a sequence of {x.shape[dim]} tokens does not split into 2 x {size} equal CP chunks")
    parts = x.chunk(2 * size, dim=dim)
    return torch.cat([parts[rank], parts[2 * size - 1 - rank]], dim=dim)


def gather_from_cp(x, size: int, group, dim: int = 1):
    """The whole sequence from every CP rank's :func:`split_for_cp` chunks (not differentiable)."""
    if size == 1:
        return x
    got = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(got, x.contiguous(), group=group)
    halves = [g.chunk(2, dim=dim) for g in got]
    return torch.cat([halves[c][0] for c in range(size)] + [halves[c][1] for c in reversed(range(size))], dim=dim)
