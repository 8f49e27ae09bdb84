"""The named receive-buffer pool every strategy communicates into.

Receive buffers come from one pool, megatron-core's global memory buffer under names
prefixed ``paradyse:``, so communication memory is the maximum over strategies rather than
the sum, and does not grow with the layer count. With ParaDySe the pool is released before
each micro-batch (:func:`release_pool`), so it holds the buffers of one micro-batch's plan and
length, never those of the longest micro-batch seen so far. A pooled buffer is only ever a receive
target: it never aliases parameter storage, and a tensor that outlives the current
collective (a gradient, a saved activation) is never left in the pool.
"""
from __future__ import annotations

import torch

POOL_PREFIX = "paradyse:"


def weight_slot(k: int, slot: int) -> str:
    """Pool name of the ``k``-th weight tensor in flight, double-buffer ``slot`` (0/1).

    Every strategy names its gathered or travelling weights this way (ZeRO gathers use
    ``weight0_0``, and with prefetch ``weight0_1`` for the projection and fc2: ``prefetch.py``;
    METP's broadcast and ring shards ``weight{k}_{0|1}``), so the pool holds the largest use of
    each role, not one buffer per strategy.
    """
    return f"weight{k}_{slot}"


def block_slot(kind: str, slot: int) -> str:
    """Pool name of a visiting ring block (``kind`` "k" or "v"), double-buffer ``slot``."""
    return f"kv_{kind}{slot}"


_WRITES: dict = {}  # pool name -> (work, payload): an async write into that buffer still in flight


def post_write(name: str, work, payload=None) -> None:
    """Record an async collective writing into the pooled buffer ``name`` (``payload``: what
    :func:`settle` hands back), so that no later use of ``name`` starts before it is done."""
    settle(name)
    _WRITES[name] = (work, payload)


def settle(name: str):
    """Wait for the async write posted into ``name``, if any; its payload, else None."""
    entry = _WRITES.pop(name, None)
    if entry is None:
        return None
    entry[0].wait()
    return entry[1]


def settle_all() -> None:
    """Wait for every async write into the pool."""
    for name in list(_WRITES):
        settle(name)


def pool_buffer(name: str, shape, dtype, device=None) -> torch.Tensor:
    """A view of the pooled buffer ``name``; its contents are only valid until its next use
    (an async write still posted into it is waited for first: :func:`post_write`)."""
    from megatron.core import parallel_state

    settle(name)
    buf = parallel_state.get_global_memory_buffer().get_tensor(list(shape), dtype, POOL_PREFIX + name)
    if device is not None and not _same_device(buf.device, torch.device(device)):
        raise RuntimeError(
            f"pool buffer {name} is on {buf.device} but the tensors it serves are on {device}: "
            "megatron's global memory buffer allocates on torch.cuda.current_device(); CPU (gloo) "
            "ranks need megatron_paradyse.cpu_compat applied (megatron_paradyse.device.select('gloo') "
            "then cpu_compat.apply())")
    return buf


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.type == "cpu" or a.index is None or b.index is None or a.index == b.index


def _global_buffer():
    from megatron.core import parallel_state

    return getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)


def pool_sizes() -> dict:
    """Bytes held by each entry of megatron's global memory buffer, ``{"name/dtype": bytes}``:
    the ``paradyse:`` pool and megatron's own entries (``mpu``: the sequence-parallel all-gather)."""
    buf = _global_buffer()
    if buf is None:
        return {}
    return {f"{name}/{str(dtype).replace('torch.', '')}": int(t.numel() * t.element_size())
            for (name, dtype), t in buf.buffer.items()}


def release_pool() -> None:
    """Drop every entry of megatron's global memory buffer (ours and megatron's ``mpu``).

    Called before each micro-batch runs its plan: otherwise the longest micro-batch seen so far
    pins its buffers for the rest of training, and a micro-batch's memory would depend on its
    predecessors. After the release a micro-batch holds exactly the buffers of its own plan
    and length, which is what the cost model predicts (``CostModel.pool_bytes``). Entries are
    only ever used within one collective, so none is in use between micro-batches (a prefetched
    gather still in flight is waited for first).
    """
    settle_all()
    buf = _global_buffer()
    if buf is not None:
        buf.buffer.clear()
