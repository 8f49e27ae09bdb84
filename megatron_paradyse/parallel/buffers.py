"""The named receive-buffer pool every strategy communicates into.

Receive buffers come from one pool, megatron-core's global memory buffer under names
prefixed ``paradyse:``, so communication memory is the maximum over strategies rather than
the sum, and does not grow with the layer count. A pooled buffer is only ever a receive
target: it never aliases parameter storage, and a tensor that outlives the current
collective (a gradient, a saved activation) is never left in the pool.
"""
from __future__ import annotations

import torch

POOL_PREFIX = "paradyse:"


def weight_slot(k: int, slot: int) -> str:
    """Pool name of the ``k``-th weight tensor in flight, double-buffer ``slot`` (0/1).

    Every strategy names its gathered or travelling weights this way (ZeRO gathers use
    ``weight0_0`` / ``weight2_0``, METP's broadcast and ring shards ``weight{k}_{0|1}``), so
    the pool holds the largest use of each role, not one buffer per strategy.
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
