"""Where the cost model's measurements run: megatron's parallel state inside a rank, and the
ranks themselves (``megatron_paradyse.launch.run_ranks``).

``run_ranks`` (re-exported from ``megatron_paradyse.launch``): spawned gloo CPU ranks, or the
one process of the single-device mode; a failing rank is reported with its traceback, a world
that does not finish is killed at the deadline.
"""
from __future__ import annotations

import torch

from .. import cpu_compat
from ..launch import WorldError as RankError  # noqa: F401  (re-exported)
from ..launch import run_ranks  # noqa: F401  (re-exported)
from ..parallel import megatron_state


def init_parallel(p: int, seed: int = 1234, **kwargs) -> None:
    """Megatron's parallel state (TP = ``p``) over the initialised world, and its seeds; on the
    CPU the CPU shims first (``cpu_compat.apply`` is a no-op where the GPU was chosen)."""
    from megatron.core import tensor_parallel

    cpu_compat.apply()
    megatron_state.initialize(tensor_model_parallel_size=p, **kwargs)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
