"""The load-balanced causal layout of the ring strategies, applied inside the layer.

Between layers rank r holds the r-th contiguous chunk of ``L = s/p`` tokens (Megatron's
sequence-parallel layout). Under a causal mask a contiguous ring is unbalanced: the last rank
attends over the whole sequence, the first over its own chunk only. Cut every rank's chunk
into halves, giving 2p half-chunks ``c = 0 .. 2p-1`` in position order (chunk ``2r`` is rank
r's first ``ceil(L/2)`` tokens, ``2r+1`` its last ``floor(L/2)``). A rank that holds chunks
``c`` and ``2p-1-c`` (Megatron context parallelism's zig-zag) does the same causal work as
every other rank.

Which rank holds which pair is free, and this layout picks the pairing that moves least:
ranks r and ``p-1-r`` swap their second halves. Rank r keeps chunk ``2r`` and receives chunk
``2p-1-2r``; its partner keeps ``2(p-1-r)`` and receives ``2r+1``; each pair sums to 2p-1.
One point-to-point exchange of ``L/2`` tokens with one partner before attention
(:func:`to_balanced`) and one after (:func:`from_balanced`), each the other's adjoint; with p
odd the middle rank already holds a balanced pair and exchanges nothing. No padding: when L
is odd the halves differ by one token and each rank still holds L tokens. A rank's tokens
are kept in position order, so attention over a rank's own tokens is one causal block.

:class:`RingLayout` says where every rank's tokens sit in the sequence (segments) and which
blocks of a visiting rank's keys a rank's queries see; ``ring``, ``colossal`` and ``metp``
attend through it. ``RingLayout(p, L, balanced=False)`` is the contiguous split (one
segment per rank), kept for the balance benchmark.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from .buffers import pool_buffer
from .collectives import ensure_ready, group_info, wait


@dataclasses.dataclass(frozen=True)
class Segment:
    """Tokens ``[start, stop)`` of the sequence, held at local offset ``offset``."""

    start: int
    stop: int
    offset: int

    @property
    def local(self) -> slice:
        return slice(self.offset, self.offset + self.stop - self.start)

    @property
    def cols(self) -> slice:
        return slice(self.start, self.stop)


class Block(NamedTuple):
    """One attention block: local query ``rows`` over the visiting rank's local ``keys``
    (global positions ``cols``); ``causal``: the same tokens on both sides (a causal square)."""

    rows: slice
    keys: slice
    cols: slice
    causal: bool


@dataclasses.dataclass(frozen=True)
class RingLayout:
    """Where each of ``p`` ranks' ``local_len`` tokens sit, balanced (zig-zag) or contiguous."""

    p: int
    local_len: int
    balanced: bool = True

    @property
    def first_half(self) -> int:
        return (self.local_len + 1) // 2

    def partner(self, rank: int) -> int:
        return self.p - 1 - rank

    def moves(self, rank: int) -> bool:
        """Whether ``rank`` exchanges tokens with its partner (not the middle rank, not L < 2)."""
        return self.balanced and self.partner(rank) != rank and self.local_len - self.first_half > 0

    @functools.lru_cache(maxsize=4096)
    def segments(self, rank: int) -> tuple:
        """This rank's tokens as position-ordered :class:`Segment` s (adjacent ones merged)."""
        L, a = self.local_len, self.first_half
        if not self.moves(rank):
            return (Segment(rank * L, (rank + 1) * L, 0),)
        q = self.partner(rank)
        own, got = (rank * L, rank * L + a), (q * L + a, (q + 1) * L)
        ranges = (own, got) if rank < q else (got, own)
        out, offset = [], 0
        for start, stop in ranges:
            out.append(Segment(start, stop, offset))
            offset += stop - start
        return tuple(out)

    def ranges(self, rank: int) -> list:
        """``(start, stop)`` position ranges of this rank's tokens, in local order (for RoPE)."""
        return [(g.start, g.stop) for g in self.segments(rank)]

    @functools.lru_cache(maxsize=4096)
    def visible(self, rank: int, src: int) -> tuple:
        """The blocks of ``src``'s keys that ``rank``'s queries see under the causal mask.

        Returns ``(row_start, segment)`` pairs: the queries from local row ``row_start`` to the
        end see ``src``'s ``segment``; those in the same segment as the keys (``src == rank``)
        see it causally, later ones wholly. Segments are equal or disjoint, and ``rank``'s are
        in position order, so the rows that see a segment are always a suffix.
        """
        mine = self.segments(rank)
        out = []
        for seg in self.segments(src):
            row = next((m.offset for m in mine if m.stop > seg.start), None)
            if row is not None:
                out.append((row, seg))
        return tuple(out)

    @functools.lru_cache(maxsize=4096)
    def full_blocks(self, rank: int, src: int) -> tuple:
        """``(rows, keys)`` local slices of the non-causal blocks for ``src != rank``: adjacent
        key segments seen by the same rows are merged into one block (one kernel call)."""
        blocks = []
        for row, seg in self.visible(rank, src):
            if blocks and blocks[-1][0] == row and blocks[-1][2] == seg.offset:
                row, start = blocks[-1][0], blocks.pop()[1]
            else:
                start = seg.offset
            blocks.append((row, start, seg.local.stop))
        return tuple((slice(r, self.local_len), slice(a, b)) for r, a, b in blocks)


    # -- what the ring strategies ask every layout (``pack_layout.PackedLayout`` answers the same)
    packed = False

    def count(self, rank: int) -> int:
        return self.local_len

    @property
    def total(self) -> int:
        return self.p * self.local_len

    def row_groups(self, rank: int) -> list:
        """``(rows, stop)``: local rows whose seen keys all lie before global position ``stop``."""
        return [(g.local, g.stop) for g in self.segments(rank)]

    def rope_positions(self, rank: int, device=None) -> list:
        """RoPE positions of ``rank``'s tokens: their ``(start, stop)`` ranges (``base.apply_rope``)."""
        return self.ranges(rank)

    def last_hops(self):
        """None: every rank needs every other rank's K/V block (the whole ring)."""
        return None

    @functools.lru_cache(maxsize=4096)
    def kernel_blocks(self, rank: int, src: int) -> tuple:
        """``(rows, keys, causal)`` kernel calls for the block from ``src``: the rank's own
        tokens are one causal block (they are in position order), others the full blocks."""
        if src == rank:
            return ((slice(0, self.local_len), slice(0, self.local_len), True),)
        return tuple((rows, keys, False) for rows, keys in self.full_blocks(rank, src))

    @functools.lru_cache(maxsize=4096)
    def score_blocks(self, rank: int, src: int) -> tuple:
        """``Block`` s of ``src``'s keys that ``rank``'s queries see, per key segment, with the
        keys' global positions as columns; the rank's own segments causally."""
        out = []
        for row, seg in self.visible(rank, src):
            if src == rank:
                out.append(Block(seg.local, seg.local, seg.cols, True))
                row = seg.local.stop
            if row < self.local_len:
                out.append(Block(slice(row, self.local_len), seg.local, seg.cols, False))
        return tuple(out)


def layout_for(hidden_states, group) -> RingLayout:
    """The balanced layout of sequence-sharded ``[s/p, b, h]`` activations over ``group``."""
    return RingLayout(dist.get_world_size(group), hidden_states.shape[0])


def exchange(send: torch.Tensor, partner: int, group) -> torch.Tensor:
    """Send ``send`` to group rank ``partner``; returns what it sent back, a pooled buffer
    valid until the next exchange.

    Both sides go through the pool (slots ``zigzag_send`` / ``zigzag_recv``): a backend may
    keep a request's tensors alive for a while after the wait (gloo does, on its own thread),
    which must not keep a layer's activations alive.
    """
    _, _, ranks = group_info(group)
    out = pool_buffer("zigzag_send", send.shape, send.dtype, send.device).copy_(send)
    recv = pool_buffer("zigzag_recv", send.shape, send.dtype, send.device)
    ops = [dist.P2POp(dist.isend, out, ranks[partner], group),
           dist.P2POp(dist.irecv, recv, ranks[partner], group)]
    if dist.get_rank(group) > partner:
        ops.reverse()
    wait(dist.batch_isend_irecv(ops))
    return recv


def _to_balanced(x, layout: RingLayout, rank: int, group):
    if not layout.moves(rank):
        return x
    a, q = layout.first_half, layout.partner(rank)
    got = exchange(x[a:], q, group)
    return torch.cat([x[:a], got] if rank < q else [got, x[:a]])


def _from_balanced(y, layout: RingLayout, rank: int, group):
    if not layout.moves(rank):
        return y
    a, q = layout.first_half, layout.partner(rank)
    b = layout.local_len - a
    own, theirs = (y[:a], y[a:]) if rank < q else (y[b:], y[:b])
    return torch.cat([own, exchange(theirs, q, group)])


class _Relayout(torch.autograd.Function):
    """Contiguous -> balanced (``to_balanced=True``) or back; the backward is the other way."""

    @staticmethod
    def forward(ctx, x, layout, group, to_balanced: bool):
        ctx.layout, ctx.group, ctx.to_balanced = layout, group, to_balanced
        move = _to_balanced if to_balanced else _from_balanced
        return move(x, layout, dist.get_rank(group), group)

    @staticmethod
    def backward(ctx, dy):
        move = _from_balanced if ctx.to_balanced else _to_balanced
        return move(dy, ctx.layout, dist.get_rank(ctx.group), ctx.group), None, None, None


def to_balanced(x: torch.Tensor, layout: RingLayout, group) -> torch.Tensor:
    """``[s/p, ...]`` contiguous tokens to this rank's balanced tokens (backward: the inverse).
    Every rank calls it, the middle one of an odd p too (``collectives.ensure_ready``)."""
    ensure_ready(group)
    return _Relayout.apply(x, layout, group, True) if layout.moves(dist.get_rank(group)) else x


def from_balanced(y: torch.Tensor, layout: RingLayout, group) -> torch.Tensor:
    """This rank's balanced tokens back to its contiguous ``[s/p, ...]`` chunk (the inverse)."""
    return _Relayout.apply(y, layout, group, False) if layout.moves(dist.get_rank(group)) else y
