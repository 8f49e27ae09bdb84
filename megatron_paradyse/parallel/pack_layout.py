"""The ring strategies' layout of a packed micro-batch, and its in-layer re-layout.

Between layers rank r holds the contiguous chunk ``[rL, (r+1)L)`` of the pack (``L = T/p``).
Inside a ring layer (:class:`PackedLayout`):

* a document that lies inside one chunk stays where it is: its attention is local, no K/V
  block it owns is needed by any other rank;
* a document that crosses a chunk boundary (at most p-1 of them) is split as megatron's THD
  context parallelism splits each sequence: into p parts, each cut into halves (the first
  one token longer when odd), giving 2p pieces; rank r holds pieces 2r and 2p-1-2r, so its
  causal work on that document is the same as every other rank's. With one document this is
  exactly ``zigzag.RingLayout``'s balanced split.

A rank's tokens are kept in position order. Query ``i`` sees key ``j`` iff they share a
document and ``j <= i``, so the blocks a rank's queries see of another rank's keys are
whole (never triangular) and those of its own keys are one causal square per document.
:meth:`PackedLayout.kernel_blocks` lists the kernel calls of a ring step (ring, metp),
:meth:`PackedLayout.score_blocks` the score blocks with their global columns (colossal),
and :meth:`PackedLayout.last_hops` how far each rank's K/V block must travel: a hop that
carries a block no later rank needs is not made (``ring_comm``).

:func:`arrange` / :func:`restore` move the tokens from the contiguous chunks to this layout
and back (point-to-point with every rank that holds a piece; each the other's adjoint).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from .collectives import ensure_ready, group_info, wait
from .packing import Documents
from .zigzag import Block, Segment  # noqa: F401 - Block: the blocks' type, here for callers


@dataclasses.dataclass(frozen=True)
class Piece(Segment):
    """A :class:`~.zigzag.Segment` inside document ``doc``."""

    doc: int = 0


def _halves(start: int, stop: int) -> list:
    mid = start + (stop - start + 1) // 2
    return [(start, mid), (mid, stop)]


def _spread(start: int, stop: int, p: int) -> list:
    """The 2p pieces of a document that crosses a chunk boundary, in position order."""
    d = stop - start
    out, a = [], start
    for k in range(p):
        b = a + d // p + (1 if k < d % p else 0)
        out.extend(_halves(a, b))
        a = b
    return out


class PieceLayout:
    """Ring owners' tokens as position-ordered :class:`Piece` s (global positions, documents).

    The blocks a ring step attends (:meth:`kernel_blocks`, :meth:`score_blocks`) and how far each
    owner's K/V travels (:meth:`last_hops`) follow from the pieces alone: query ``i`` sees key
    ``j`` iff they share a document and ``j <= i``. Pieces of different owners never overlap, and
    an owner's pieces are in position order (so its own tokens of a document are one causal
    square). :class:`PackedLayout` is one; context parallelism builds others (``context.py``).
    """

    packed = True

    def __init__(self, pieces: tuple, total: int):
        self.p, self._pieces, self._total = len(pieces), tuple(pieces), int(total)

    def pieces(self, rank: int) -> tuple:
        return self._pieces[rank]

    def count(self, rank: int) -> int:
        """How many tokens ``rank`` holds inside the layer."""
        ps = self._pieces[rank]
        return ps[-1].offset + ps[-1].stop - ps[-1].start if ps else 0

    def ranges(self, rank: int) -> list:
        return [(g.start, g.stop) for g in self._pieces[rank]]

    @property
    def total(self) -> int:
        return self._total

    def row_groups(self, rank: int) -> list:
        """``(rows, stop)``: local rows whose seen keys all lie before global position ``stop``."""
        return [(g.local, g.stop) for g in self._pieces[rank]]

    def _of_doc(self, rank: int, doc: int) -> tuple:
        """``rank``'s pieces of document ``doc``, in order (an index built once per rank: the
        block lists then cost the pieces, not their pairs)."""
        by_doc = self._by_doc.get(rank)
        if by_doc is None:
            by_doc = self._by_doc[rank] = {}
            for g in self._pieces[rank]:
                by_doc.setdefault(g.doc, []).append(g)
        return by_doc.get(doc, ())

    @functools.cached_property
    def _by_doc(self) -> dict:
        return {}

    @functools.lru_cache(maxsize=4096)
    def score_blocks(self, rank: int, src: int) -> tuple:
        """Blocks of ``src``'s keys that ``rank``'s queries see, one per pair of pieces."""
        out = []
        for q in self._pieces[rank]:
            for k in self._of_doc(src, q.doc):
                if src == rank and k == q:
                    out.append(Block(q.local, k.local, slice(k.start, k.stop), True))
                elif k.stop <= q.start:
                    out.append(Block(q.local, k.local, slice(k.start, k.stop), False))
        return tuple(out)

    @functools.lru_cache(maxsize=4096)
    def kernel_blocks(self, rank: int, src: int) -> tuple:
        """``(rows, keys, causal)`` kernel calls of ``rank``'s queries over ``src``'s keys: on its
        own keys one causal square per document (a document's pieces are adjacent locally); on
        another rank's, per piece the keys of its document before it (adjacent pieces locally,
        so one block), pieces that see the same keys merged."""
        mine = self._pieces[rank]
        if src == rank:
            spans = {}
            for g in mine:
                a, b = spans.get(g.doc, (g.offset, None))
                spans[g.doc] = (a, g.local.stop)
            return tuple((slice(a, b), slice(a, b), True) for a, b in spans.values())
        out = []
        for q in mine:
            ks = [k for k in self._of_doc(src, q.doc) if k.stop <= q.start]
            if not ks:
                continue
            keys = slice(ks[0].offset, ks[-1].local.stop)
            if out and out[-1][1] == keys and out[-1][0].stop == q.offset:
                out[-1] = (slice(out[-1][0].start, q.local.stop), keys, False)
            else:
                out.append((q.local, keys, False))
        return tuple(out)

    def own_documents(self, rank: int) -> Documents:
        """The causal squares of ``rank``'s queries over its own keys (:meth:`kernel_blocks`) as
        the documents of its local rows, for one variable-length kernel call. Built once per
        layout and rank, so its device tensors (``Documents.on_device``) serve every layer."""
        got = self._own.get(rank)
        if got is None:
            spans = sorted((r.start, r.stop) for r, _, _ in self.kernel_blocks(rank, rank))
            bounds = (0,) + tuple(b for _, b in spans)
            if tuple(a for a, _ in spans) != bounds[:-1] or bounds[-1] != self.count(rank):
                raise AssertionError(f"rank {rank}'s own causal blocks {spans} do not tile its {self.count(rank)} rows")
            got = self._own[rank] = Documents(bounds)
        return got

    @functools.cached_property
    def _own(self) -> dict:
        return {}

    @functools.cached_property
    def _last(self) -> tuple:
        out = []
        for src in range(self.p):
            seen = [t for t in range(self.p) if self.kernel_blocks((src + t) % self.p, src)]
            out.append(max(seen) if seen else 0)
        return tuple(out)

    def last_hops(self) -> tuple:
        """For each rank, the last ring step at which some rank needs its K/V block (0: only
        itself): the block goes no further."""
        return self._last


def place(ranges, docs: Documents | None = None) -> tuple:
    """``(start, stop)`` position ranges, in local order, as :class:`Piece` s cut at ``docs``'
    boundaries (one document 0 without ``docs``); adjacent pieces of one document merged."""
    out, offset = [], 0
    for start, stop in ranges:
        for d, a, b in (docs.pieces(start, stop) if docs is not None else [(0, start, stop)]):
            if out and out[-1].doc == d and out[-1].stop == a:
                out[-1] = dataclasses.replace(out[-1], stop=b)
            else:
                out.append(Piece(a, b, offset, d))
            offset += b - a
    return tuple(out)


class PackedLayout(PieceLayout):
    """Where each of ``p`` ranks' tokens of a pack sit inside a ring layer (module docstring)."""

    def __init__(self, p: int, docs: Documents):
        if docs.total % p:
            raise ValueError(f"a pack of {docs.total} tokens is not divisible by p={p}")
        self.docs, self.chunk = docs, docs.total // p
        ranges = [[] for _ in range(p)]
        for a, b in zip(docs.bounds, docs.bounds[1:]):
            if a // self.chunk == (b - 1) // self.chunk:
                ranges[a // self.chunk].append((a, b))
                continue
            pieces = _spread(a, b, p)
            for r in range(p):
                ranges[r].extend(pieces[c] for c in (2 * r, 2 * p - 1 - 2 * r) if pieces[c][1] > pieces[c][0])
        super().__init__(tuple(place(sorted(rs), docs) for rs in ranges), docs.total)

    def rope_positions(self, rank: int, device=None):
        """In-document positions of ``rank``'s tokens, in local order (RoPE)."""
        return self.docs.positions(self.ranges(rank), device)

    def moves_plan(self, rank: int) -> tuple:
        """``(sends, recvs)``: for each peer, the local rows (contiguous chunk) ``rank`` sends
        and the local rows (this layout) it fills, in matching order."""
        return _move_plan(self, rank)


@functools.lru_cache(maxsize=16)
def packed_layout(p: int, docs: Documents) -> PackedLayout:
    return PackedLayout(p, docs)


def _overlap(a0, a1, b0, b1):
    return max(a0, b0), min(a1, b1)


def _move_plan(layout: PackedLayout, rank: int) -> tuple:
    c = layout.chunk
    lo, hi = rank * c, (rank + 1) * c
    sends, recvs = {}, {}
    for peer in range(layout.p):
        for g in layout.pieces(peer):  # what of my chunk the peer holds
            a, b = _overlap(lo, hi, g.start, g.stop)
            if a < b:
                sends.setdefault(peer, []).append(slice(a - lo, b - lo))
        plo = peer * c
        for g in layout.pieces(rank):  # what of the peer's chunk I hold
            a, b = _overlap(plo, plo + c, g.start, g.stop)
            if a < b:
                recvs.setdefault(peer, []).append(slice(g.offset + a - g.start, g.offset + b - g.start))
    return sends, recvs


def _move(x, sends: dict, recvs: dict, out_rows: int, group) -> torch.Tensor:
    """Rows ``sends[peer]`` of ``x`` to each peer; rows ``recvs[peer]`` of the result from it.
    Every rank of the group calls it, with or without peers (``collectives.ensure_ready``)."""
    ensure_ready(group)
    rank, _, ranks = group_info(group)
    out = x.new_empty((out_rows,) + tuple(x.shape[1:]))
    if rank in sends:
        for s, r in zip(sends[rank], recvs[rank]):
            out[r] = x[s]
    ops, landing = [], []
    for peer, slices in sends.items():
        if peer != rank:
            buf = torch.cat([x[s] for s in slices]).contiguous()
            ops.append(dist.P2POp(dist.isend, buf, ranks[peer], group))
    for peer, slices in recvs.items():
        if peer != rank:
            n = sum(s.stop - s.start for s in slices)
            buf = x.new_empty((n,) + tuple(x.shape[1:]))
            ops.append(dist.P2POp(dist.irecv, buf, ranks[peer], group))
            landing.append((buf, slices))
    if ops:
        wait(dist.batch_isend_irecv(ops))
    for buf, slices in landing:
        at = 0
        for s in slices:
            n = s.stop - s.start
            out[s] = buf[at:at + n]
            at += n
    return out


class _Arrange(torch.autograd.Function):
    """Contiguous chunk -> packed layout (``forward=True``) or back; backward: the other way."""

    @staticmethod
    def forward(ctx, x, layout, group, forward: bool):
        ctx.layout, ctx.group, ctx.forward_dir = layout, group, forward
        return _direction(x, layout, group, forward)

    @staticmethod
    def backward(ctx, dy):
        return _direction(dy, ctx.layout, ctx.group, not ctx.forward_dir), None, None, None


def _direction(x, layout, group, to_layout: bool):
    rank = dist.get_rank(group)
    sends, recvs = layout.moves_plan(rank)
    if to_layout:
        return _move(x, sends, recvs, layout.count(rank), group)
    return _move(x, recvs, sends, layout.chunk, group)


def arrange(x: torch.Tensor, layout: PackedLayout, group) -> torch.Tensor:
    """``[T/p, ...]`` contiguous tokens to this rank's tokens of ``layout`` (backward: inverse)."""
    return _Arrange.apply(x, layout, group, True)


def restore(y: torch.Tensor, layout: PackedLayout, group) -> torch.Tensor:
    """This rank's tokens of ``layout`` back to its contiguous ``[T/p, ...]`` chunk."""
    return _Arrange.apply(y, layout, group, False)
