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


def ring_exchange(sends: list, recvs: list, group) -> list:
    """Post sends of ``sends`` to the next rank and receives into ``recvs`` from the previous one.

    Returns the requests; :func:`~.collectives.wait` them before touching ``recvs``. Ranks are
    ordered within the group and mapped to global ranks for the point-to-point ops.
    """
    rank, size, ranks = group_info(group)
    nxt, prv = ranks[(rank + 1) % size], ranks[(rank - 1) % size]
    ops = []
    for s in sends:
        ops.append(dist.P2POp(dist.isend, s.contiguous(), nxt, group))
    for r in recvs:
        ops.append(dist.P2POp(dist.irecv, r, prv, group))
    if rank % 2:  # odd ranks receive first so that neighbours never both block on send
        ops = ops[len(sends):] + ops[:len(sends)]
    return dist.batch_isend_irecv(ops) if ops else []


def ring_stream(tensors: list, group, slot_name):
    """Pass ``tensors`` once around the ring: yield ``(src, tensors held now)`` for the p steps,
    starting with this rank's own (``src`` is the group rank that owns them).

    The next hop is in flight while the caller uses the current tensors; receives go to the
    pooled buffers ``slot_name(k, slot)`` (double-buffered). A yielded list is valid until the
    generator has been advanced twice.
    """
    rank, p, _ = group_info(group)
    cur = list(tensors)
    for step in range(p):
        nxt, reqs = None, []
        if step < p - 1:
            nxt = [pool_buffer(slot_name(k, step % 2), t.shape, t.dtype, t.device) for k, t in enumerate(cur)]
            reqs = ring_exchange(cur, nxt, group)
        yield (rank - step) % p, cur
        wait(reqs)
        cur = nxt


class GradRing:
    """Gradients of tensors that travel a :func:`ring_stream`, summed onto their owners.

    At each step every rank :meth:`add` s its fp32 contribution to the tensors it holds (or
    None); the running sums travel one hop behind the tensors, and after p steps each rank's
    :meth:`result` is the complete gradient of its own tensors (fresh tensors, never pooled).
    """

    def __init__(self, like: list, group):
        self.like, self.group = like, group
        self.p = dist.get_world_size(group)
        self.step, self.recv, self.reqs = 0, None, []

    def add(self, contrib: list | None) -> None:
        wait(self.reqs)  # the sums of the tensors held now, from the previous rank
        if self.step == 0:
            acc = contrib if contrib is not None else [
                torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in self.like]
        else:
            acc = self.recv if contrib is None else [r.add_(c) for r, c in zip(self.recv, contrib)]
        self.step += 1
        if self.p == 1:
            self.recv = acc
            return
        self.recv = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in self.like]
        self.reqs = ring_exchange(acc, self.recv, self.group)

    def result(self) -> list:
        wait(self.reqs)  # after p hops each owner's complete gradient has come home
        return self.recv
