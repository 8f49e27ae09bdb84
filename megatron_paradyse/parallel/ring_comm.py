"""Point-to-point ring machinery: pass tensors once around the switching group, and bring
the gradients of travelling tensors home.

``ring`` and ``colossal`` pass K/V blocks this way, METP's MLP its weight shards;
:class:`GradRing` is the backward pair of :func:`ring_stream`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .buffers import pool_buffer
from .collectives import group_info, wait


def _p2p(sends: list, recvs: list, group) -> list:
    """Post ``(tensor, peer)`` sends and receives (group ranks) in one batch; returns the
    requests (:func:`~.collectives.wait` them before touching a receive). Odd ranks post their
    receives first, so that neighbours never both block on a send."""
    rank, _, ranks = group_info(group)
    ops = [dist.P2POp(dist.isend, t.contiguous(), ranks[peer], group) for t, peer in sends]
    got = [dist.P2POp(dist.irecv, t, ranks[peer], group) for t, peer in recvs]
    ops = got + ops if rank % 2 else ops + got
    return dist.batch_isend_irecv(ops) if ops else []


def _reach(last, src: int, p: int) -> int:
    """The last step at which ``src``'s tensors are needed (all ``p - 1`` without ``last``)."""
    return p - 1 if last is None else last[src]


def ring_stream(tensors: list, group, slot_name, last=None, shapes=None):
    """Pass ``tensors`` around the ring: yield ``(src, tensors held now)`` for the p steps,
    starting with this rank's own (``src`` is the group rank that owns them).

    The next hop is in flight while the caller uses the current tensors; receives go to the
    pooled buffers ``slot_name(k, slot)`` (double-buffered). A yielded list is valid until the
    generator has been advanced twice. ``last[src]`` (optional): the last step at which some
    rank needs ``src``'s tensors; they travel no further, and where they have not arrived the
    step yields ``(src, None)``. ``shapes(src)`` (optional): the shapes of ``src``'s tensors
    (default: this rank's).
    """
    rank, p, _ = group_info(group)
    shape_of = shapes or (lambda src: [t.shape for t in tensors])
    cur = list(tensors)
    for step in range(p):
        src, prev_src = (rank - step) % p, (rank - step - 1) % p
        nxt, reqs = None, []
        if step < p - 1:
            sends = [(t, (rank + 1) % p) for t in cur] if cur is not None and step + 1 <= _reach(last, src, p) else []
            recvs = []
            if step + 1 <= _reach(last, prev_src, p):
                nxt = [pool_buffer(slot_name(k, step % 2), shp, t.dtype, t.device)
                       for k, (t, shp) in enumerate(zip(tensors, shape_of(prev_src)))]
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
