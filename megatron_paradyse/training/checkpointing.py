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

Atomicity: every rank writes into ``iter_N.tmp``; each rank then reads back its own shards
(size, crc32, fsync) and rank 0 writes ``paradyse_manifest.json`` (every file's size and
crc32) last, renames the folder to ``iter_N`` and replaces the tracker file through a
temporary file and ``os.replace``. A crash at any point (any rank, even SIGKILL) leaves the
tracker naming the previous complete checkpoint; stale ``.tmp`` folders are removed by the
next save. Rank 0's filesystem work is decided collectively (rank 0 acts and broadcasts the
outcome: every rank goes on or every rank raises :class:`CheckpointError`), never between
bare barriers. Loading: rank 0 picks the checkpoint and broadcasts it, every rank checks a
share of the files against the manifest, and a missing, truncated or corrupted file is a
:class:`CheckpointError` on every rank naming the file. Checkpoints without a manifest (stock
Megatron-LM) load unverified, with a warning.

CPU notes: the writer needs psutil (else ``cpu_compat``'s ``checkpoint`` shim) and forks
writer processes, so the calling process must not be daemonic. megatron's writer would also
start a spawn-context ``multiprocessing`` manager that re-imports ``__main__``; saves here run
synchronously with an in-process results queue instead (see :func:`_in_process_results_queue`),
but scripts should still keep their body under ``if __name__ == "__main__":``.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import shutil
import zlib

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


def _optimizer_metadata(args) -> dict:
    """The distributed optimizer's checkpoint layout as Megatron-LM 0.16 saves it
    (``_build_sharded_state_dict_metadata``: ``dp_reshardable``). megatron-core's own default,
    ``fully_sharded_model_space``, writes ShardedTensors with ``flattened_range``, which its
    torch_dist writer refuses (seen on an H100: "ShardedTensor.flattened_range is not
    supported"). Nothing for the plain optimizer (its layout is unchanged)."""
    if not getattr(args, "use_distributed_optimizer", False):
        return {}
    return {"metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}


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
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                       **_optimizer_metadata(args))
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


# ============================================================================ collective decisions


class CheckpointError(RuntimeError):
    """A save or load failed; raised on every rank together (never one rank alone)."""


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _decide(fn, what: str):
    """Rank 0 runs ``fn()`` and broadcasts its result: every rank returns it, or every rank
    raises :class:`CheckpointError` with rank 0's error. Replaces barrier + rank-0 work."""
    out = [None]
    if dist.get_rank() == 0:
        try:
            out = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - handed to every rank
            out = [("error", f"{type(e).__name__}: {e}")]
    if _world() > 1:
        dist.broadcast_object_list(out, src=0)
    status, value = out[0]
    if status != "ok":
        raise CheckpointError(f"{what} failed on rank 0: {value}")
    return value


def _agree(local_error: str | None, what: str) -> None:
    """One all-reduce of an error flag; if any rank failed, every rank raises with every message."""
    if _world() == 1:
        if local_error:
            raise CheckpointError(f"{what} failed: {local_error}")
        return
    from ..parallel.plan_check import collective_device

    flag = torch.tensor([1 if local_error else 0], dtype=torch.int64, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()) == 0:
        return
    errors = [None] * _world()
    dist.all_gather_object(errors, local_error)
    lines = [f"  rank {r}: {e}" for r, e in enumerate(errors) if e]
    raise CheckpointError(f"{what} failed on {len(lines)} rank(s):\n" + "\n".join(lines))


# ============================================================================ manifest


MANIFEST = "paradyse_manifest.json"
_CHUNK = 16 << 20


def file_digest(path: str, fsync: bool = False) -> dict:
    """``{"size": bytes, "crc32": int}`` of a file (read in 16 MiB chunks)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            crc = zlib.crc32(block, crc)
            size += len(block)
        if fsync:
            os.fsync(f.fileno())
    return {"size": size, "crc32": crc}


def _own_files(folder: str, rank: int) -> list:
    """The shard files this rank wrote (torch_dist names them ``__{rank}_{n}.distcp``)."""
    prefix = f"__{rank}_"
    return sorted(n for n in os.listdir(folder) if n.startswith(prefix) and n.endswith(".distcp"))


def _digest_own_files(folder: str) -> tuple:
    """(entries, error): digests of this rank's shards, each fsynced by its writer."""
    try:
        return {n: file_digest(os.path.join(folder, n), fsync=True)
                for n in _own_files(folder, dist.get_rank())}, None
    except Exception as e:  # noqa: BLE001 - agreed on collectively
        return {}, f"{type(e).__name__}: {e}"


def _gather_to_rank0(obj) -> list | None:
    if _world() == 1:
        return [obj]
    out = [None] * _world() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def read_manifest(folder: str) -> dict | None:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        manifest = json.load(f)
    if not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path}: not a ParaDySe checkpoint manifest")
    return manifest


def check_files(folder: str, manifest: dict, names=None) -> list:
    """Problems (one line each, naming the file) of ``names`` (default: all) against the manifest."""
    problems = []
    for name in sorted(manifest["files"]) if names is None else names:
        want = manifest["files"][name]
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{path}: missing (the manifest lists {want['size']} bytes)")
            continue
        size = os.path.getsize(path)
        if size != want["size"]:
            problems.append(f"{path}: {size} bytes, the manifest says {want['size']} (truncated or overwritten)")
            continue
        if file_digest(path)["crc32"] != want["crc32"]:
            problems.append(f"{path}: checksum mismatch (crc32 differs from the manifest; corrupted)")
    return problems


# ============================================================================ save


def _prepare_save(root: str, tmp: str) -> None:
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):  # leftovers of interrupted saves
        if name.startswith("iter_") and name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    os.makedirs(tmp)


def _finalize_save(root: str, tmp: str, final: str, iteration: int, digests: list) -> str:
    """Rank 0: manifest (every file's size and crc32, written last), rename, tracker."""
    files, errors = {}, []
    for r, (entries, error) in enumerate(digests):
        if error:
            errors.append(f"rank {r}: {error}")
        files.update(entries)
    if errors:
        raise OSError("reading back the written shards failed: " + "; ".join(errors))
    for dirpath, _, names in os.walk(tmp):  # common.pt, metadata.json, .metadata, anything else
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), tmp)
            if rel not in files and rel != MANIFEST:
                files[rel] = file_digest(os.path.join(dirpath, name), fsync=True)
    _write_file_atomically(os.path.join(tmp, MANIFEST),
                           json.dumps({"format": 1, "iteration": int(iteration), "files": files},
                                      indent=1, sort_keys=True))
    _fsync_dir(tmp)
    _publish(root, tmp, final, iteration)
    return final


def _publish(root: str, tmp: str, final: str, iteration: int) -> None:
    """Rank 0: ``iter_N.tmp`` -> ``iter_N``, then the tracker (each step atomic)."""
    if os.path.exists(final):  # re-saving an iteration: swap the old one out
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    _write_file_atomically(os.path.join(root, TRACKER), str(iteration))
    _fsync_dir(root)


def _write_file_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(args, iteration: int, model, optimizer=None, scheduler=None) -> str:
    """Save atomically under ``args.save``; returns the checkpoint folder. Collective.

    Rank 0's filesystem work (preparing ``iter_N.tmp``; the manifest, rename and tracker) is
    decided collectively: if it fails, every rank raises :class:`CheckpointError` and the
    tracker still names the previous checkpoint. An exception inside megatron's collective
    writer on one rank is not recoverable here (its peers are inside the writer's own
    collectives): it propagates, and :class:`~megatron_paradyse.training.faults.FailFast`
    ends the job; the half-written ``iter_N.tmp`` is never loaded and the next save removes it.
    """
    from megatron.core import dist_checkpointing

    root = args.save
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    _decide(lambda: _prepare_save(root, tmp), f"preparing checkpoint {tmp}")
    sd = sharded_state_dict(model, None if getattr(args, "no_save_optim", False) else optimizer,
                            scheduler, iteration, args, with_rng=not getattr(args, "no_save_rng", False))
    with _in_process_results_queue():
        dist_checkpointing.save(sd, tmp)
    digests = _gather_to_rank0(_digest_own_files(tmp))
    return _decide(lambda: _finalize_save(root, tmp, final, iteration, digests),
                   f"finishing checkpoint {final}")


# ============================================================================ load


def _complete_iterations(root: str) -> list:
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith("iter_") and name[5:].isdigit() and \
                os.path.isfile(os.path.join(root, name, MANIFEST)):
            out.append(int(name[5:]))
    return sorted(out)


def _locate(root: str | None, iteration: int | None, exit_on_missing: bool) -> dict | None:
    """Rank 0: which checkpoint to load (None: none) and its manifest."""
    if iteration is None:
        iteration = read_tracker(root) if root and os.path.isdir(root) else None
        if iteration is None:
            if exit_on_missing:
                raise FileNotFoundError(f"--load {root}: no {TRACKER} found")
            return None
        why = f"{os.path.join(root, TRACKER)} names iteration {iteration}"
    else:
        why = f"--ckpt-step {iteration}"
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such checkpoint folder ({why})")
    return {"iteration": int(iteration), "path": path, "manifest": read_manifest(path)}


def _inspect(path: str) -> dict:
    """Rank 0: what the (verified) checkpoint holds, for every rank to decide alike."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(path)
    keys = set(common)
    metadata = os.path.join(path, ".metadata")
    if os.path.isfile(metadata):  # torch_dist: prefixes of the sharded entries
        from torch.distributed.checkpoint import FileSystemReader

        for k in FileSystemReader(path).read_metadata().state_dict_metadata:
            keys.add(k.split("/", 1)[0].split(".", 1)[0])
    else:  # another sharded format: try everything
        keys.update({"optimizer", "rng_state"})
    return {"keys": sorted(keys), "iteration": common.get("iteration"),
            "layout": common.get("paradyse_layout"), "scheduler": common.get("opt_param_scheduler")}


def verify_checkpoint(path: str, manifest: dict) -> None:
    """Collective: each rank checks a share of the manifest's files (size, crc32); any problem
    raises :class:`CheckpointError` on every rank, naming each bad file."""
    names = sorted(manifest["files"])
    mine = names[dist.get_rank()::_world()]
    try:
        problems = check_files(path, manifest, mine)
        error = "\n    ".join(problems) if problems else None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    try:
        _agree(error, f"verifying checkpoint {path}")
    except CheckpointError as e:
        root = os.path.dirname(path)
        older = [i for i in _complete_iterations(root) if checkpoint_dir(root, i) != path]
        hint = (f"\n  other checkpoints with a manifest under {root}: {older} (load one with --ckpt-step N; "
                "they are verified the same way)" if older else "")
        raise CheckpointError(f"{e}{hint}") from None


def load_checkpoint(args, model, optimizer=None, scheduler=None, iteration: int | None = None) -> int:
    """Load the latest (or the given) checkpoint under ``args.load``; returns its iteration.

    Returns 0 (and loads nothing) when ``args.load`` holds no checkpoint, unless
    ``args.exit_on_missing_checkpoint``. Works across ParaDySe and stock runs and across TP
    sizes (dist_checkpointing reshards); RNG states are restored only when the TP and DP
    sizes match the saving run's, and optimizer/scheduler/iteration are skipped with
    ``--finetune``. Collective: rank 0 decides what to load and broadcasts it, the files are
    checked against the manifest by all ranks together, so every rank loads the same
    checkpoint or every rank raises :class:`CheckpointError` (naming the damaged file).
    """
    from megatron.core import dist_checkpointing

    root = args.load
    where = _decide(lambda: _locate(root, iteration, getattr(args, "exit_on_missing_checkpoint", False)),
                    f"finding a checkpoint under --load {root}")
    if where is None:
        if dist.get_rank() == 0:
            print(f"WARNING: --load {root}: no checkpoint found, training from scratch", flush=True)
        return 0
    path, iteration = where["path"], where["iteration"]
    if where["manifest"] is not None:
        verify_checkpoint(path, where["manifest"])
    elif dist.get_rank() == 0:
        print(f"WARNING: {path} has no {MANIFEST} (not saved by megatron_paradyse): loading it unverified",
              flush=True)
    info = _decide(lambda: _inspect(path), f"reading checkpoint {path}")
    keys = set(info["keys"])
    finetune = getattr(args, "finetune", False)
    load_optim = optimizer is not None and not finetune and not getattr(args, "no_load_optim", False) \
        and "optimizer" in keys
    load_rng = (not finetune and not getattr(args, "no_load_rng", False) and info["layout"] == _layout()
                and "rng_state" in keys)
    sd = sharded_state_dict(model, optimizer if load_optim else None,
                            None, iteration, args, with_rng=load_rng, is_loading=True)
    loaded = dist_checkpointing.load(sd, path, strict="assume_ok_unexpected")
    _unwrap(model).load_state_dict(loaded["model"], strict=True)
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and not finetune and info["scheduler"] is not None:
        scheduler.load_state_dict(info["scheduler"])
    if load_rng:
        from megatron.core import parallel_state

        states = loaded["rng_state"]
        _set_rng_state(states[parallel_state.get_data_parallel_rank()])
    if dist.get_rank() == 0:
        what = ["model"] + (["optimizer"] if load_optim else []) + (["rng"] if load_rng else [])
        verified = "verified" if where["manifest"] is not None else "unverified"
        print(f"  loaded checkpoint {path} ({', '.join(what)}; {verified}) at iteration {iteration}", flush=True)
    return 0 if finetune else int(info["iteration"] if info["iteration"] is not None else iteration)
