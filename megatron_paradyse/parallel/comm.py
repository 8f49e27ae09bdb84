"""Collectives and communication buffers shared by every strategy.

All communication runs over the switching group (the model's TP group). Receive buffers
come from one named pool, megatron-core's global memory buffer, so communication memory is
the maximum over strategies rather than the sum, and does not grow with the layer count.
A pooled buffer is only ever a receive target: it never aliases parameter storage, and a
tensor that outlives the current collective (a gradient, a saved activation) is never
left in the pool.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

POOL_PREFIX = "paradyse:"


def weight_slot(k: int, slot: int) -> str:
    """Pool name of the ``k``-th weight tensor in flight, double-buffer ``slot`` (0/1).

    Every strategy names its gathered or travelling weights this way (ZeRO gathers use
    slot ``weight0_0``, METP's broadcast and ring shards ``weight{k}_{0|1}``), so the pool
    holds the largest use of each role, not one buffer per strategy.
    """
    return f"weight{k}_{slot}"


def block_slot(kind: str, slot: int) -> str:
    """Pool name of a visiting ring block (``kind`` "k" or "v"), double-buffer ``slot``."""
    return f"kv_{kind}{slot}"


def pool_buffer(name: str, shape, dtype, device=None) -> torch.Tensor:
    """A view of the pooled buffer ``name``; its contents are only valid until its next use."""
    from megatron.core import parallel_state

    buf = parallel_state.get_global_memory_buffer().get_tensor(list(shape), dtype, POOL_PREFIX + name)
    if device is not None and buf.device != torch.device(device) and torch.device(device).type != "cpu":
        raise RuntimeError(f"pool buffer {name} is on {buf.device}, expected {device}")
    return buf


def group_info(group):
    """(rank in group, group size, list of global ranks) for the switching group."""
    ranks = dist.get_process_group_ranks(group)
    return dist.get_rank(group), len(ranks), ranks


def all_gather_dim0(shard: torch.Tensor, group, name: str) -> torch.Tensor:
    """Gather equal dim-0 shards into the pooled buffer ``name`` (rank order)."""
    size = dist.get_world_size(group)
    out = pool_buffer(name, (size * shard.shape[0],) + tuple(shard.shape[1:]), shard.dtype, shard.device)
    dist.all_gather_into_tensor(out, shard.contiguous(), group=group)
    return out


def reduce_scatter_dim0(full: torch.Tensor, group) -> torch.Tensor:
    """Sum ``full`` over the group and return this rank's dim-0 shard (a fresh tensor)."""
    size = dist.get_world_size(group)
    out = torch.empty((full.shape[0] // size,) + tuple(full.shape[1:]), dtype=full.dtype, device=full.device)
    dist.reduce_scatter_tensor(out, full.contiguous(), group=group)
    return out


def gather_shards(shard: torch.Tensor, shard_dim: int, group, name: str) -> torch.Tensor:
    """Rebuild a TP-sharded weight just in time (ZeRO-3 style) in the pool.

    ``shard_dim`` 0 (column-parallel) returns ``W``; ``shard_dim`` 1 (row-parallel) returns
    ``W^T`` gathered as dim-0 shards of the transposed weight, with no layout copy of ``W``.
    """
    src = shard if shard_dim == 0 else shard.t()
    return all_gather_dim0(src, group, name)


def scatter_grad(full_grad: torch.Tensor, shard_dim: int, group) -> torch.Tensor:
    """Inverse of :func:`gather_shards` for gradients: reduce-scatter back to the owner's shard."""
    g = reduce_scatter_dim0(full_grad, group)
    return g if shard_dim == 0 else g.t()


def ring_exchange(sends: list, recvs: list, group) -> list:
    """Post sends of ``sends`` to the next rank and receives into ``recvs`` from the previous one.

    Returns the requests; call :func:`wait` before touching ``recvs``. Ranks are ordered
    within the group and mapped to global ranks for the point-to-point ops.
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


def wait(reqs) -> None:
    for r in reqs:
        r.wait()


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


def broadcast_start(tensors: list, src: int, group, names: list):
    """Post async broadcasts of group rank ``src``'s ``tensors``; returns (tensors, works).

    Non-owners receive into the pooled buffers ``names``; the owner sends straight from its
    own tensors (parameters included: a broadcast only reads them). :func:`wait` the works
    before reading the returned tensors.
    """
    rank, _, ranks = group_info(group)
    out, works = [], []
    for t, name in zip(tensors, names):
        buf = t if rank == src else pool_buffer(name, t.shape, t.dtype, t.device)
        works.append(dist.broadcast(buf, src=ranks[src], group=group, async_op=True))
        out.append(buf)
    return out, works


def reduce_to(tensor: torch.Tensor, dst: int, group) -> torch.Tensor | None:
    """Sum ``tensor`` over the group onto group rank ``dst``; returns the sum there, else None."""
    rank, _, ranks = group_info(group)
    tensor = tensor.contiguous()
    dist.reduce(tensor, dst=ranks[dst], group=group)
    return tensor if rank == dst else None


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """``[s/p, b, heads, d]`` (all heads, local tokens) to ``[s, b, heads/p, d]``; autograd pair."""
    from megatron.core.tensor_parallel.mappings import all_to_all

    size = dist.get_world_size(group)
    s, b, n, d = x.shape
    # [s/p, b, p, n/p, d] -> [p, s/p, b, n/p, d]: chunk j goes to rank j
    y = x.reshape(s, b, size, n // size, d).permute(2, 0, 1, 3, 4).contiguous()
    y = all_to_all(group, y.reshape(size * s, b * (n // size) * d))
    return y.reshape(size * s, b, n // size, d)


def head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`seq_to_head`: ``[s, b, heads/p, d]`` to ``[s/p, b, heads, d]``."""
    from megatron.core.tensor_parallel.mappings import all_to_all

    size = dist.get_world_size(group)
    s, b, n, d = x.shape
    y = all_to_all(group, x.reshape(s, b * n * d)).reshape(size, s // size, b, n, d)
    return y.permute(1, 2, 0, 3, 4).reshape(s // size, b, size * n, d)
