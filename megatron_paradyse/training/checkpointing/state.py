"""The state a checkpoint holds: the model's and optimizer's sharded state dicts, the
scheduler, the iteration, the parallel layout and every rank's RNG states."""
from __future__ import annotations

import torch.distributed as dist

from ...parallel.dispatch import unwrap
from .rng import from_portable, portable, rng_sharded_object, rng_state

CHECKPOINT_VERSION = 3.0


def layout() -> dict:
    """This run's TP and DP sizes (RNG states load only into the same layout)."""
    from megatron.core import parallel_state

    return {"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "data_parallel_size": parallel_state.get_data_parallel_world_size()}


def _optimizer_metadata(args) -> dict:
    """The distributed optimizer's checkpoint layout as Megatron-LM 0.16 saves it
    (``_build_sharded_state_dict_metadata``: ``dp_reshardable``). megatron-core's own default,
    ``fully_sharded_model_space``, writes ShardedTensors with ``flattened_range``, which its
    torch_dist writer refuses (seen on an H100: "ShardedTensor.flattened_range is not
    supported"). Nothing for the plain optimizer (its layout is unchanged)."""
    if args is None or not args.use_distributed_optimizer:
        return {}
    return {"metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}


def model_states(model) -> dict:
    """Each model chunk's ``GPTModel`` by its key in the checkpoint, as Megatron-LM names them:
    ``model`` for one, ``model0``, ``model1``, ... for the interleaved schedule's list of chunks
    (each chunk's sharded keys carry its layers' global numbers, so the checkpoint loads into
    any other split of the layers too)."""
    chunks = [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
    if len(chunks) == 1:
        return {"model": chunks[0]}
    return {f"model{i}": gpt for i, gpt in enumerate(chunks)}


def sharded_state_dict(model, optimizer=None, scheduler=None, iteration: int = 0, args=None,
                       with_rng: bool = True, is_loading: bool = False) -> dict:
    """The state saved (or, with ``is_loading``, the template loaded); ``model``: the model, or
    the list of its chunks (:func:`model_states`)."""
    from megatron.core import parallel_state

    models = {key: gpt.sharded_state_dict() for key, gpt in model_states(model).items()}
    model_sd = models["model"] if len(models) == 1 else models  # the optimizer finds every chunk's params
    sd = {**models, "checkpoint_version": CHECKPOINT_VERSION, "iteration": int(iteration),
          "paradyse_layout": layout()}
    if args is not None:
        sd["consumed_train_samples"] = int(iteration) * int(args.global_batch_size)
        # flags a loading run may want to check (primitives only: common.pt is read with weights_only)
        sd["paradyse_args"] = {k: getattr(args, k) for k in (
            "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
            "padded_vocab_size", "swiglu", "seq_length", "global_batch_size") if hasattr(args, k)}
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                       **_optimizer_metadata(args))
    if scheduler is not None:
        sd["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        if is_loading:
            sd["rng_state"] = rng_sharded_object(None)
        else:
            local = rng_state()
            states = [local]
            dp = parallel_state.get_data_parallel_world_size()
            if dp > 1:
                states = [None] * dp
                dist.all_gather_object(states, portable(local), group=parallel_state.get_data_parallel_group())
                states = [from_portable(x) for x in states]
            sd["rng_state"] = rng_sharded_object(states)
    return sd
