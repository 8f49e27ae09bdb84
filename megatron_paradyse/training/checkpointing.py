"""``--save`` / ``--load`` in megatron-core's distributed checkpoint format (``torch_dist``).

Layout, as Megatron-LM's::

    SAVE/latest_checkpointed_iteration.txt     the last complete iteration, written last
    SAVE/iter_0000010/                         dist_checkpointing.save of the state below
        metadata.json  common.pt  __*_*.distcp  .metadata

The sharded state is ``model.sharded_state_dict()`` (the stock TP shards: ParaDySe moves no
weight, so a ParaDySe checkpoint is a stock Megatron TP+SP checkpoint and the reverse),
``optimizer.sharded_state_dict(...)``, the learning-rate scheduler's state, the iteration,
and every rank's RNG states (a ``ShardedObject`` per TP rank holding the list over DP ranks,
as Megatron-LM stores ``rng_state``).

Atomicity: every rank writes into ``iter_N.tmp``; after a barrier rank 0 fsyncs it, renames
it to ``iter_N`` and then replaces the tracker file through a temporary file and
``os.replace``. A crash at any point leaves the tracker naming the previous complete
checkpoint; stale ``.tmp`` folders are removed by the next save.

CPU notes: the writer needs psutil (else ``cpu_compat``'s ``checkpoint`` shim) and forks
writer processes, so the calling process must not be daemonic. megatron's writer would also
start a spawn-context ``multiprocessing`` manager that re-imports ``__main__``; saves here run
synchronously with an in-process results queue instead (see :func:`_in_process_results_queue`),
but scripts should still keep their body under ``if __name__ == "__main__":``.
"""
from __future__ import annotations

import contextlib
import os
import queue
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    """The last complete iteration under ``root``, or None if there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        raise ValueError(f"{path}: 'release' checkpoints are not supported; give an iteration")
    return int(text)


def _fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _rng_state() -> dict:
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


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    name, keys, pos, has_gauss, cached = state["np_rng_state"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _layout() -> dict:
    from megatron.core import parallel_state

    return {"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "data_parallel_size": parallel_state.get_data_parallel_world_size()}


def _rng_sharded_object(state_list=None):
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state", state_list,
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(),
    )


def _unwrap(model):
    from ..parallel.dispatch import unwrap

    return unwrap(model)


def sharded_state_dict(model, optimizer=None, scheduler=None, iteration: int = 0, args=None,
                       with_rng: bool = True, is_loading: bool = False) -> dict:
    """The state saved (or, with ``is_loading``, the template loaded)."""
    from megatron.core import parallel_state

    gpt = _unwrap(model)
    model_sd = gpt.sharded_state_dict()
    sd = {"model": model_sd, "checkpoint_version": CHECKPOINT_VERSION, "iteration": int(iteration),
          "paradyse_layout": _layout()}
    if args is not None:
        sd["consumed_train_samples"] = int(iteration) * int(args.global_batch_size)
        # flags a loading run may want to check (primitives only: common.pt is read with weights_only)
        sd["paradyse_args"] = {k: getattr(args, k) for k in (
            "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
            "padded_vocab_size", "swiglu", "seq_length", "global_batch_size") if hasattr(args, k)}
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    if scheduler is not None:
        sd["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        if is_loading:
            sd["rng_state"] = _rng_sharded_object(None)
        else:
            local = _rng_state()
            states = [local]
            dp = parallel_state.get_data_parallel_world_size()
            if dp > 1:
                states = [None] * dp
                dist.all_gather_object(states, local, group=parallel_state.get_data_parallel_group())
            sd["rng_state"] = _rng_sharded_object(states)
    return sd


@contextlib.contextmanager
def _in_process_results_queue():
    """Run megatron's synchronous writer without its spawn-context ``Manager``.

    ``filesystem_async`` returns its writers' results through a global queue that it creates
    as ``mp.get_context("spawn").Manager().Queue()``, for the case where the writer runs in
    another process (async saves). A synchronous save runs it in this process, so a plain
    in-process queue carries the result. This avoids the manager process: its re-import of
    ``__main__`` (a script without a ``__main__`` guard hangs there), its 3-7 s start on the
    first save, and managers orphaned when a rank is killed. The global is restored after.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        yield
        return
    if getattr(fa, "_results_queue", "absent") is not None:  # absent, or the user's own queue
        yield
        return
    fa._results_queue = queue.Queue()
    try:
        yield
    finally:
        fa._results_queue = None


def save_checkpoint(args, iteration: int, model, optimizer=None, scheduler=None) -> str:
    """Save atomically under ``args.save``; returns the checkpoint folder. Collective."""
    from megatron.core import dist_checkpointing

    root = args.save
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of interrupted saves
            if name.endswith(".tmp") and name.startswith("iter_"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    sd = sharded_state_dict(model, None if getattr(args, "no_save_optim", False) else optimizer,
                            scheduler, iteration, args, with_rng=not getattr(args, "no_save_rng", False))
    with _in_process_results_queue():
        dist_checkpointing.save(sd, tmp)
    dist.barrier()
    if rank == 0:
        _fsync_tree(tmp)
        if os.path.exists(final):  # re-saving an iteration: swap the old one out
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
        _fsync_dir(root)
    dist.barrier()
    return final


def load_checkpoint(args, model, optimizer=None, scheduler=None, iteration: int | None = None) -> int:
    """Load the latest (or the given) checkpoint under ``args.load``; returns its iteration.

    Returns 0 (and loads nothing) when ``args.load`` holds no checkpoint, unless
    ``args.exit_on_missing_checkpoint``. Works across ParaDySe and stock runs and across TP
    sizes (dist_checkpointing reshards); RNG states are restored only when the TP and DP
    sizes match the saving run's, and optimizer/scheduler/iteration are skipped with
    ``--finetune``. Collective.
    """
    from megatron.core import dist_checkpointing

    root = args.load
    if iteration is None:
        iteration = read_tracker(root) if root and os.path.isdir(root) else None
    if iteration is None:
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise FileNotFoundError(f"--load {root}: no {TRACKER} found")
        if dist.get_rank() == 0:
            print(f"WARNING: --load {root}: no checkpoint found, training from scratch", flush=True)
        return 0
    path = checkpoint_dir(root, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    finetune = getattr(args, "finetune", False)
    load_optim = optimizer is not None and not finetune and not getattr(args, "no_load_optim", False) \
        and "optimizer" in _saved_top_keys(path, common)
    same_layout = common.get("paradyse_layout") == _layout()
    load_rng = (not finetune and not getattr(args, "no_load_rng", False) and same_layout
                and "rng_state" in _saved_top_keys(path, common))
    sd = sharded_state_dict(model, optimizer if load_optim else None,
                            None, iteration, args, with_rng=load_rng, is_loading=True)
    loaded = dist_checkpointing.load(sd, path, strict="assume_ok_unexpected")
    _unwrap(model).load_state_dict(loaded["model"], strict=True)
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and not finetune and "opt_param_scheduler" in common:
        scheduler.load_state_dict(common["opt_param_scheduler"])
    if load_rng:
        from megatron.core import parallel_state

        states = loaded["rng_state"]
        _set_rng_state(states[parallel_state.get_data_parallel_rank()])
    if dist.get_rank() == 0:
        what = ["model"] + (["optimizer"] if load_optim else []) + (["rng"] if load_rng else [])
        print(f"  loaded checkpoint {path} ({', '.join(what)}) at iteration {iteration}", flush=True)
    return 0 if finetune else int(common.get("iteration", iteration))


def _saved_top_keys(path: str, common: dict) -> set:
    """Top-level names in a checkpoint: its common keys plus the prefixes of its sharded entries
    (``optimizer.state...``, ``rng_state/shard_...``)."""
    keys = set(common)
    try:
        from torch.distributed.checkpoint import FileSystemReader

        for k in FileSystemReader(path).read_metadata().state_dict_metadata:
            keys.add(k.split("/", 1)[0].split(".", 1)[0])
    except Exception:  # noqa: BLE001 - not a torch_dist checkpoint: try everything
        keys.update({"optimizer", "rng_state"})
    return keys
