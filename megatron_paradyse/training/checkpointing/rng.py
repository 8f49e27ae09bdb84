"""Every rank's RNG states (Python, NumPy, torch, CUDA, megatron's tracker), saved as
Megatron-LM stores ``rng_state``: a ``ShardedObject`` per TP rank holding the list over DP ranks."""
from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """This rank's RNG states, as Megatron-LM saves them."""
    from megatron.core import tensor_parallel

    np_state = np.random.get_state()
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": (np_state[0], torch.from_numpy(np.array(np_state[1])), int(np_state[2]),
                         int(np_state[3]), float(np_state[4])),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def portable(x):
    """``x`` with every tensor as a numpy array (tagged), for ``all_gather_object``: torch 2.13's
    unpickling of a tensor's storage there fails ("UntypedStorage has no attribute dtype")."""
    if torch.is_tensor(x):
        return ("__tensor__", x.cpu().numpy())
    if isinstance(x, dict):
        return {k: portable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(portable(v) for v in x)
    return x


def from_portable(x):
    """The inverse of :func:`portable`."""
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and x[0] == "__tensor__":
        return torch.from_numpy(x[1])
    if isinstance(x, dict):
        return {k: from_portable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(from_portable(v) for v in x)
    return x


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    name, keys, pos, has_gauss, cached = state["np_rng_state"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def rng_sharded_object(state_list=None):
    """The ``rng_state`` entry of this TP rank: the list over DP ranks (None: a load template);
    one writer per (PP, TP) rank over DP x CP, as Megatron-LM keys it (CP ranks replicate it)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state", state_list,
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )
