"""Point-to-point ring machinery: pass tensors once around the switching group, and bring
the gradients of travelling tensors home.

``ring`` and ``colossal`` pass K/V blocks this way, METP's MLP its weight shards;
:class:`GradRing` is the backward pair of :func:`ring_stream`. With context parallelism the
ring family's ring is :class:`TwoLevel`: an outer ring over the CP group (across nodes) whose
every step runs an inner ring over the switching group (inside the node), so a block crosses
nodes C-1 times per pass, not C*p-1, and each crossing is in flight during an inner ring.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from .buffers import pool_buffer
from .collectives import ensure_ready, group_info, wait


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


def ring_stream(tensors: list, group, slot_name, last=None, shapes=None, like=None):
    """Pass ``tensors`` around the ring: yield ``(src, tensors held now)`` for the p steps,
    starting with this rank's own (``src`` is the group rank that owns them).

    The next hop is in flight while the caller uses the current tensors; receives go to the
    pooled buffers ``slot_name(k, slot)`` (double-buffered). A yielded list is valid until the
    generator has been advanced twice. ``last[src]`` (optional): the last step at which some
    rank needs ``src``'s tensors; they travel no further, and where they have not arrived the
    step yields ``(src, None)``. ``shapes(src)`` (optional): the shapes of ``src``'s tensors
    (default: this rank's). ``tensors`` may be None (this rank has none to send: ``like`` gives
    the receive buffers' dtype and device). A :class:`TwoLevel` ``group`` yields its owners
    (``last``: :func:`reach`'s tables).
    """
    if isinstance(group, TwoLevel):
        yield from _two_level_stream(tensors, group, slot_name, last, shapes)
        return
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


class GradRing:
    """Gradients of tensors that travel a :func:`ring_stream`, summed onto their owners.

    At each step every rank :meth:`add` s its fp32 contribution to the tensors it holds (or
    None); the running sums travel one hop behind the tensors, and when a block goes no
    further (after p - 1 hops, or at ``last[src]``) its sum goes home to the owner, so each
    rank's :meth:`result` is the complete gradient of its own tensors (fresh tensors, never
    pooled). ``last`` and ``shapes`` as for :func:`ring_stream`.
    """

    def __init__(self, like: list, group, last=None, shapes=None):
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
class TwoLevel:
    """A ring over ``outer`` (the CP group, across nodes) x ``inner`` (the switching group):
    owner ``c * p + t`` is CP rank c's TP rank t (``context.joint_layout``'s order)."""

    inner: object
    outer: object

    def position(self) -> tuple:
        """``(owner index of this rank, number of owners)``."""
        p = dist.get_world_size(self.inner)
        return dist.get_rank(self.outer) * p + dist.get_rank(self.inner), dist.get_world_size(self.outer) * p


def ring_position(group) -> tuple:
    """``(this rank's owner index, ring size)`` of a process group or a :class:`TwoLevel`."""
    if isinstance(group, TwoLevel):
        return group.position()
    return dist.get_rank(group), dist.get_world_size(group)


@dataclasses.dataclass(frozen=True)
class Reach:
    """How far blocks travel on a :class:`TwoLevel` ring: ``outer[t][c]``, the last outer step
    at which some rank needs owner (c, t)'s block; :meth:`inner` per node and outer step."""

    outer: tuple
    needs: object
    C: int
    p: int

    @functools.lru_cache(maxsize=1024)
    def inner(self, c: int, j: int) -> tuple:
        """Node c at outer step j holds owners ((c-j) % C, t): for each t the last inner step at
        which a rank of the node needs it, -1 where it did not come (it goes nowhere)."""
        sc, p = (c - j) % self.C, self.p
        return tuple(-1 if j > self.outer[t][sc] else
                     max((s for s in range(p) if self.needs(c * p + (t + s) % p, sc * p + t)), default=0)
                     for t in range(p))


def reach(layout, group):
    """The ``last`` argument of :func:`ring_stream` / :class:`GradRing` for ``layout``'s blocks on
    ``group``: its ``last_hops()`` on one group, :class:`Reach` on a :class:`TwoLevel` ring."""
    if not isinstance(group, TwoLevel):
        return layout.last_hops()
    return _two_level_reach(layout, dist.get_world_size(group.outer), dist.get_world_size(group.inner))


@functools.lru_cache(maxsize=64)
def _two_level_reach(layout, C: int, p: int) -> Reach:
    def needs(rank, src):
        return bool(layout.kernel_blocks(rank, src))

    outer = tuple(tuple(max((j for j in range(C) if any(needs(((sc + j) % C) * p + u, sc * p + t) for u in range(p))),
                            default=0) for sc in range(C)) for t in range(p))
    return Reach(outer, needs, C, p)


def _outer_slot(slot_name):
    return lambda k, slot: slot_name(k, 2 + slot)  # the outer ring's own pool slots


def _two_level_stream(tensors, ring: TwoLevel, slot_name, last: Reach | None, shapes):
    """:func:`ring_stream` over a :class:`TwoLevel` ring: the outer ring's step brings the
    block of owner ((c-j) % C, t); an inner ring passes the node's blocks of that step round."""
    c, C = dist.get_rank(ring.outer), dist.get_world_size(ring.outer)
    t, p = dist.get_rank(ring.inner), dist.get_world_size(ring.inner)
    shape_of = shapes or (lambda owner: [x.shape for x in tensors])
    outer_last = None if last is None else last.outer[t]
    for sc, held in ring_stream(tensors, ring.outer, _outer_slot(slot_name), last=outer_last,
                                shapes=lambda src: shape_of(src * p + t)):
        j = (c - sc) % C
        inner_last = None if last is None else last.inner(c, j)
        for st, cur in ring_stream(held, ring.inner, slot_name, last=inner_last,
                                   shapes=lambda src, sc=sc: shape_of(sc * p + src), like=tensors):
            yield sc * p + st, cur


def grad_ring(like: list, group, last=None, shapes=None):
    """:class:`GradRing` for ``group``, or its two-level form on a :class:`TwoLevel` ring."""
    if isinstance(group, TwoLevel):
        return TwoLevelGradRing(like, group, last, shapes)
    return GradRing(like, group, last=last, shapes=shapes)


class TwoLevelGradRing:
    """:class:`GradRing` on a :class:`TwoLevel` ring, fed in :func:`ring_stream`'s order: per
    outer step an inner GradRing sums the node's contributions to the blocks it holds; each
    holder adds that sum to the outer GradRing, which brings it home across the nodes."""

    def __init__(self, like, ring: TwoLevel, last: Reach | None, shapes):
        self.like, self.last = like, last
        self.c, self.C = dist.get_rank(ring.outer), dist.get_world_size(ring.outer)
        self.t, self.p = dist.get_rank(ring.inner), dist.get_world_size(ring.inner)
        self.ring, self.steps = ring, 0
        # no closure over self: a cycle would keep the accumulators alive until the cyclic GC
        self.shape_of = shape_of = shapes or (lambda owner, like=like: [x.shape for x in like])
        p, t = self.p, self.t
        self.outer = GradRing(like, ring.outer, last=None if last is None else last.outer[t],
                              shapes=lambda src: shape_of(src * p + t))
        self.inner = None

    def add(self, contrib) -> None:
        j, s = divmod(self.steps, self.p)
        if s == 0:
            sc, p, shape_of = (self.c - j) % self.C, self.p, self.shape_of
            self.inner = GradRing(self.like, self.ring.inner, last=None if self.last is None else self.last.inner(self.c, j),
                                  shapes=lambda src: shape_of(sc * p + src))
        self.inner.add(contrib)
        self.steps += 1
        if s == self.p - 1:
            self.outer.add(self.inner.result())
            self.inner = None

    def result(self) -> list:
        out, self.outer = self.outer.result(), None
        return out
