"""Collectives over the switching group that strategies call inside their own autograd functions.

These are plain (non-autograd) operations: each strategy's ``torch.autograd.Function``
calls the forward one in ``forward`` and its pair in ``backward`` (weight gather /
gradient reduce-scatter, broadcast / reduce). Autograd-level collectives come from
megatron-core's ``tensor_parallel.mappings`` directly in the strategies (the Ulysses
all-to-alls, the ZeRO bias gather). Ring point-to-point machinery is in ``ring_comm.py``.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..device import current as current_device
from .buffers import pool_buffer

_READY = weakref.WeakValueDictionary()  # id -> the group itself, while it lives (so an id reused by a
# later group is not taken for it; a destroyed group is not kept alive, ``megatron_state.py``)


def ensure_ready(group) -> None:
    """Make ``group``'s communicator exist before a point-to-point batch some rank may skip.

    torch's ``batch_isend_irecv`` requires every rank of the group to take part when it is the
    group's first collective (NCCL; torch 2.13 ``distributed_c10d.batch_isend_irecv``'s note:
    "if this API is the first collective call in the group ... all ranks of the group must
    participate"; later batches may involve a subset). The plugin's rings and re-layouts skip
    batches a rank has nothing for, so every rank of the group calls this at the same point
    before its first batch: one all-reduce of one element, once per group and process.
    """
    if _READY.get(id(group)) is group:
        return
    dist.all_reduce(torch.zeros(1, device=current_device()), group=group)
    _READY[id(group)] = group


def group_info(group):
    """(rank in group, group size, list of global ranks) for the switching group."""
    ranks = dist.get_process_group_ranks(group)
    return dist.get_rank(group), len(ranks), ranks


def wait(works) -> None:
    """Wait for every async work / request in ``works``."""
    for w in works:
        w.wait()


def gather_dim0(shard: torch.Tensor, group, name: str, async_op: bool = False):
    """All-gather equal dim-0 shards (rank order) into the pooled buffer ``name``.

    Not megatron's ``_gather_along_first_dim``: that one writes into fresh memory or its single
    ``"mpu"`` slot (which megatron's own TP+SP linears use), never into a named pool slot.
    ``async_op``: returns ``(buffer, work)``, the gather in flight (wait on ``work`` before reading).
    """
    size = dist.get_world_size(group)
    out = pool_buffer(name, (size * shard.shape[0],) + tuple(shard.shape[1:]), shard.dtype, shard.device)
    if not shard.is_contiguous():
        # Stage a strided shard in the pool: a fresh copy would be kept alive by the backend's
        # work object for an unknowable while after the wait (gloo frees it on its own thread).
        shard = pool_buffer(name + "_in", shard.shape, shard.dtype, shard.device).copy_(shard)
    work = dist.all_gather_into_tensor(out, shard, group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_dim0(full: torch.Tensor, group) -> torch.Tensor:
    """Sum ``full`` over the group; this rank's dim-0 shard, a fresh tensor (megatron's own
    first-dimension reduce-scatter, called outside autograd)."""
    from megatron.core.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region

    with torch.no_grad():
        return reduce_scatter_to_sequence_parallel_region(full, group=group)


def gather_shards(shard: torch.Tensor, shard_dim: int, group, name: str, async_op: bool = False):
    """Rebuild a TP-sharded weight (ZeRO-3 style) in the pool.

    ``shard_dim`` 0 (column-parallel) returns ``W``; ``shard_dim`` 1 (row-parallel) returns
    ``W^T`` gathered as dim-0 shards of the transposed weight, with no layout copy of ``W``.
    ``async_op``: ``(buffer, work)`` (:func:`gather_dim0`). The pair of :func:`scatter_grad`.
    """
    src = shard if shard_dim == 0 else shard.t()
    return gather_dim0(src, group, name, async_op)


def scatter_grad(full_grad: torch.Tensor, shard_dim: int, group) -> torch.Tensor:
    """The pair of :func:`gather_shards` for gradients: reduce-scatter back to the owner's shard."""
    g = reduce_scatter_dim0(full_grad, group)
    return g if shard_dim == 0 else g.t()


def broadcast_flat_start(tensors: list, src: int, group, name: str):
    """Post one async broadcast of group rank ``src``'s ``tensors`` (one dtype) packed in one flat
    buffer, the pooled buffer ``name``; returns ``(views of the buffer shaped as tensors, works)``.

    Every rank, the owner included, uses the pool buffer (the owner packs its tensors into it:
    one copy of its own shards), so the group pays one launch and one latency instead of one
    per tensor. :func:`wait` the works before reading the views. The pair of
    :func:`reduce_scatter_flat`.
    """
    rank, _, ranks = group_info(group)
    dtype, device = tensors[0].dtype, tensors[0].device
    if any(t.dtype != dtype for t in tensors):
        raise TypeError(f"broadcast_flat_start: one dtype per flat buffer, got {[t.dtype for t in tensors]}")
    sizes = [t.numel() for t in tensors]
    buf = pool_buffer(name, (sum(sizes),), dtype, device)
    if rank == src:
        torch.cat([t.detach().reshape(-1) for t in tensors], out=buf)
    work = dist.broadcast(buf, src=ranks[src], group=group, async_op=True)
    views = [v.view(t.shape) for v, t in zip(buf.split(sizes), tensors)]
    return views, [work]


def reduce_scatter_flat(rows: torch.Tensor, group) -> torch.Tensor:
    """Sum ``rows`` ``[p, n]`` over the group; this rank's row, a fresh ``[n]`` tensor (one
    reduce-scatter where a reduce per row's owner would take p collectives)."""
    return reduce_scatter_dim0(rows.reshape(-1), group)
