"""Point-to-point rings: pass tensors once around a ring of owners, and bring the gradients
of travelling tensors home.

A ring is a communicator (:class:`RingComm`) with one interface: :meth:`~RingComm.stream`
(tensors once around), :meth:`~RingComm.grad_ring` (their gradients brought home, a
:class:`GradRing`), :meth:`~RingComm.reach` (how far a layout's blocks must travel) and
:attr:`~RingComm.position` / :attr:`~RingComm.size` (this rank's owner index, the number of
owners). :func:`ring_over` builds the right one from the groups. ``ring`` and ``colossal`` pass
K/V blocks this way, METP's MLP its weight shards. Without context parallelism the ring is a
:class:`FlatRing` over one process group; with it the ring family's ring is a
:class:`TwoLevelRing`: an outer ring over the CP group (across nodes) whose every step runs
an inner ring over the switching group (inside the node), so a block crosses nodes C-1 times
per pass, not C*p-1, and each crossing is in flight during an inner ring.
"""
from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from .buffers import pool_buffer
from .collectives import ensure_ready, group_info, wait

SlotName = Callable[[int, int], str]  # (tensor index, pool slot) -> pooled buffer name
Shapes = Callable[[int], list]  # owner -> the shapes of its tensors
Hops = tuple[int, ...]  # Hops[src]: the last step of a flat ring at which some rank needs src's tensors
Stream = Iterator[tuple[int, list | None]]  # (owner, its tensors held now, or None)


def _p2p(sends: list, recvs: list, group) -> list:
    """Post ``(tensor, peer)`` sends and receives (group ranks) in one batch; returns the
    requests (:func:`~.collectives.wait` them before touching a receive). Odd ranks post their
    receives first, so that neighbours never both block on a send."""
    ensure_ready(group)  # every rank of the group calls _p2p at each step, even with nothing to do
    rank, _, ranks = group_info(group)
    ops = [dist.P2POp(dist.isend, t.contiguous(), ranks[peer], group) for t, peer in sends]
    got = [dist.P2POp(dist.irecv, t, ranks[peer], group) for t, peer in recvs]
    ops = got + ops if rank % 2 else ops + got
    return dist.batch_isend_irecv(ops) if ops else []


def _reach(last, src: int, p: int) -> int:
    """The last step at which ``src``'s tensors are needed (all ``p - 1`` without ``last``)."""
    return p - 1 if last is None else last[src]


class GradRing(abc.ABC):
    """Gradients of tensors that travel a :meth:`RingComm.stream`, summed onto their owners.

    At each step of the stream every rank :meth:`add` s its fp32 contribution to the tensors
    it holds (or None); :meth:`result` is then the complete gradient of this rank's own
    tensors (fresh tensors, never pooled).
    """

    @abc.abstractmethod
    def add(self, contrib: list | None) -> None:
        """This rank's contribution to the tensors the stream's current step holds."""

    @abc.abstractmethod
    def result(self) -> list:
        """The complete gradient of this rank's own tensors (after the stream's last step)."""


class RingComm(abc.ABC):
    """A ring of owners this rank is one of: the interface of :class:`FlatRing` and
    :class:`TwoLevelRing`. ``last`` (``reach``'s value) and ``shapes`` (owner -> its tensors'
    shapes, default this rank's) are each ring's own."""

    @property
    @abc.abstractmethod
    def position(self) -> int:
        """This rank's owner index."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """The number of owners."""

    @abc.abstractmethod
    def reach(self, layout):
        """The ``last`` argument of :meth:`stream` / :meth:`grad_ring` for ``layout``'s blocks:
        how far each must travel (no further than some rank needs it)."""

    @abc.abstractmethod
    def stream(self, tensors: list | None, slot_name: SlotName, last=None, shapes: Shapes | None = None,
               like: list | None = None) -> Stream:
        """Pass ``tensors`` around the ring: yield ``(owner, tensors held now)`` for every owner,
        starting with this rank's own; ``(owner, None)`` where they did not come (``last``).
        Receives go to the pooled buffers ``slot_name(k, slot)``; a yielded list is valid until
        the generator has been advanced twice."""

    @abc.abstractmethod
    def grad_ring(self, like: list, last=None, shapes: Shapes | None = None) -> GradRing:
        """The :class:`GradRing` of tensors like ``like`` on a :meth:`stream` with the same
        ``last`` and ``shapes``, fed in its order."""


def ring_over(group: dist.ProcessGroup, cp_group: dist.ProcessGroup | None = None) -> RingComm:
    """The ring over ``group`` (:class:`FlatRing`), or with context parallelism the two-level
    ring over ``cp_group`` x ``group`` (:class:`TwoLevelRing`)."""
    flat = FlatRing(group)
    return flat if cp_group is None else TwoLevelRing(inner=flat, outer=FlatRing(cp_group))


# ------------------------------------------------------------------------------ one level
@dataclasses.dataclass(frozen=True)
class FlatRing(RingComm):
    """The ring over the ranks of one process group, in group-rank order."""

    group: dist.ProcessGroup

    @property
    def position(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def reach(self, layout) -> Hops:
        """``layout.last_hops()``: ``last[src]``, the last step at which some rank needs
        ``src``'s block."""
        return layout.last_hops()

    def stream(self, tensors: list | None, slot_name: SlotName, last: Hops | None = None,
               shapes: Shapes | None = None, like: list | None = None) -> Stream:
        """:meth:`RingComm.stream` over the group: p steps; the next hop is in flight while the
        caller uses the current tensors (receives double-buffered). ``last[src]`` (optional):
        the last step at which some rank needs ``src``'s tensors; they travel no further.
        ``tensors`` may be None (this rank has none to send: ``like`` gives the receive
        buffers' dtype and device)."""
        group = self.group
        rank, p, _ = group_info(group)
        like = like if like is not None else tensors
        shape_of = shapes or (lambda src: [t.shape for t in like])
        cur = None if tensors is None else list(tensors)
        for step in range(p):
            src, prev_src = (rank - step) % p, (rank - step - 1) % p
            nxt, reqs = None, []
            if step < p - 1:
                sends = [(t, (rank + 1) % p) for t in cur] if cur is not None and step + 1 <= _reach(last, src, p) else []
                recvs = []
                if step + 1 <= _reach(last, prev_src, p):
                    nxt = [pool_buffer(slot_name(k, step % 2), shp, t.dtype, t.device)
                           for k, (t, shp) in enumerate(zip(like, shape_of(prev_src)))]
                    recvs = [(t, (rank - 1) % p) for t in nxt]
                reqs = _p2p(sends, recvs, group)
            yield src, cur
            wait(reqs)
            cur = nxt

    def grad_ring(self, like: list, last: Hops | None = None, shapes: Shapes | None = None) -> GradRing:
        return FlatGradRing(like, self.group, last=last, shapes=shapes)


class FlatGradRing(GradRing):
    """The :class:`GradRing` of a :class:`FlatRing`: the running sums travel one hop behind
    the tensors, and when a block goes no further (after p - 1 hops, or at ``last[src]``) its
    sum goes home to the owner. ``last`` and ``shapes`` as for :meth:`FlatRing.stream`.
    """

    def __init__(self, like: list, group: dist.ProcessGroup, last: Hops | None = None, shapes: Shapes | None = None):
        self.like, self.group, self.last = like, group, last
        self.rank, self.p, _ = group_info(group)
        self.shapes = shapes or (lambda src: [t.shape for t in like])
        self.step, self.incoming, self.home, self.reqs = 0, None, None, []

    def _empty(self, src):
        return [torch.empty(shp, dtype=torch.float32, device=t.device) for t, shp in zip(self.like, self.shapes(src))]

    def add(self, contrib: list | None) -> None:
        wait(self.reqs)  # the sums of the tensors held now, from the previous rank
        t, rank, p = self.step, self.rank, self.p
        src = (rank - t) % p
        held = t <= _reach(self.last, src, p)
        if t == 0:
            acc = contrib if contrib is not None else [torch.zeros(s, dtype=torch.float32, device=x.device)
                                                       for x, s in zip(self.like, self.shapes(rank))]
        else:
            acc = self.incoming if held else None
            if acc is not None and contrib is not None:
                acc = [r.add_(c) for r, c in zip(acc, contrib)]
        self.step += 1
        sends, recvs, self.incoming = [], [], None
        if acc is not None:
            if t < p - 1 and t + 1 <= _reach(self.last, src, p):
                sends = [(a, (rank + 1) % p) for a in acc]
            elif src != rank:
                sends = [(a, src) for a in acc]  # the block goes no further: its sum goes home
            else:
                self.home = acc
        prev_src = (rank - t - 1) % p
        if t < p - 1 and t + 1 <= _reach(self.last, prev_src, p):
            self.incoming = self._empty(prev_src)
            recvs += [(a, (rank - 1) % p) for a in self.incoming]
        if t == _reach(self.last, rank, p) and t > 0:
            self.home = self._empty(rank)
            recvs += [(a, (rank + t) % p) for a in self.home]
        self.reqs = _p2p(sends, recvs, self.group)

    def result(self) -> list:
        wait(self.reqs)  # the owner's complete gradient has come home
        return self.home



# ------------------------------------------------------------------------------ two levels
@dataclasses.dataclass(frozen=True)
class TwoLevelReach:
    """How far blocks travel on a :class:`TwoLevelRing`, seen from one node c (of C, p ranks
    each): ``outer[t][sc]``, the last outer step at which some rank needs owner (sc, t)'s
    block; ``inner[j][t]``: at outer step j the node holds owners ((c-j) % C, t), and this is
    the last inner step at which a rank of the node needs that block, -1 where it did not
    come (it goes nowhere)."""

    outer: tuple[tuple[int, ...], ...]
    inner: tuple[tuple[int, ...], ...]


@functools.lru_cache(maxsize=64)
def _two_level_reach(layout, nodes: int, per_node: int, node: int) -> TwoLevelReach:
    """:class:`TwoLevelReach` of ``layout``'s ``nodes`` x ``per_node`` owners, from ``node``."""
    C, p, c = nodes, per_node, node

    def needs(rank, src):
        return bool(layout.kernel_blocks(rank, src))

    outer = tuple(tuple(max((j for j in range(C) if any(needs(((sc + j) % C) * p + u, sc * p + t) for u in range(p))),
                            default=0) for sc in range(C)) for t in range(p))
    inner = tuple(tuple(-1 if j > outer[t][(c - j) % C] else
                        max((s for s in range(p) if needs(c * p + (t + s) % p, ((c - j) % C) * p + t)), default=0)
                        for t in range(p))
                  for j in range(C))
    return TwoLevelReach(outer, inner)


def _outer_slot(slot_name: SlotName) -> SlotName:
    return lambda k, slot: slot_name(k, 2 + slot)  # the outer ring's own pool slots


@dataclasses.dataclass(frozen=True)
class TwoLevelRing(RingComm):
    """A ring over ``outer`` (the CP group, across nodes) x ``inner`` (the switching group):
    owner ``c * p + t`` is CP rank c's TP rank t (``context.joint_layout``'s order)."""

    inner: FlatRing
    outer: FlatRing

    @property
    def position(self) -> int:
        return self.outer.position * self.inner.size + self.inner.position

    @property
    def size(self) -> int:
        return self.outer.size * self.inner.size

    def reach(self, layout) -> TwoLevelReach:
        """:class:`TwoLevelReach` of ``layout``'s blocks, from this rank's node (cached)."""
        return _two_level_reach(layout, self.outer.size, self.inner.size, self.outer.position)

    def stream(self, tensors: list | None, slot_name: SlotName, last: TwoLevelReach | None = None,
               shapes: Shapes | None = None, like: list | None = None) -> Stream:
        """:meth:`RingComm.stream` over both levels: the outer ring's step brings the block of
        owner ((c-j) % C, t); an inner ring passes the node's blocks of that step round."""
        c, C = self.outer.position, self.outer.size
        t, p = self.inner.position, self.inner.size
        like = like if like is not None else tensors
        shape_of = shapes or (lambda owner: [x.shape for x in like])
        outer_last = None if last is None else last.outer[t]
        for sc, held in self.outer.stream(tensors, _outer_slot(slot_name), last=outer_last,
                                          shapes=lambda src: shape_of(src * p + t), like=like):
            j = (c - sc) % C
            inner_last = None if last is None else last.inner[j]
            for st, cur in self.inner.stream(held, slot_name, last=inner_last,
                                             shapes=lambda src, sc=sc: shape_of(sc * p + src), like=like):
                yield sc * p + st, cur

    def grad_ring(self, like: list, last: TwoLevelReach | None = None, shapes: Shapes | None = None) -> GradRing:
        return TwoLevelGradRing(like, self, last, shapes)


class TwoLevelGradRing(GradRing):
    """The :class:`GradRing` of a :class:`TwoLevelRing`, fed in its stream's order: per outer
    step an inner gradient ring sums the node's contributions to the blocks it holds; each
    holder adds that sum to the outer gradient ring, which brings it home across the nodes."""

    def __init__(self, like: list, ring: TwoLevelRing, last: TwoLevelReach | None, shapes: Shapes | None):
        self.like, self.last = like, last
        self.c, self.C = ring.outer.position, ring.outer.size
        self.t, self.p = ring.inner.position, ring.inner.size
        self.ring, self.steps = ring, 0
        # no closure over self: a cycle would keep the accumulators alive until the cyclic GC
        self.shape_of = shape_of = shapes or (lambda owner, like=like: [x.shape for x in like])
        p, t = self.p, self.t
        self.outer = ring.outer.grad_ring(like, last=None if last is None else last.outer[t],
                                          shapes=lambda src: shape_of(src * p + t))
        self.inner = None

    def add(self, contrib: list | None) -> None:
        j, s = divmod(self.steps, self.p)
        if s == 0:
            sc, p, shape_of = (self.c - j) % self.C, self.p, self.shape_of
            self.inner = self.ring.inner.grad_ring(self.like, last=None if self.last is None else self.last.inner[j],
                                                   shapes=lambda src: shape_of(sc * p + src))
        self.inner.add(contrib)
        self.steps += 1
        if s == self.p - 1:
            self.outer.add(self.inner.result())
            self.inner = None

    def result(self) -> list:
        out, self.outer = self.outer.result(), None
        return out
