"""Loading: rank 0 picks the checkpoint, every rank verifies a share of its files against the
manifest, then megatron-core's ``dist_checkpointing.load`` (RNG states only where the TP and DP
sizes match the saving run's)."""
from __future__ import annotations

import logging
import os

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from .atomic import TRACKER, checkpoint_dir, read_tracker
from .collective import CheckpointError, CheckpointLoadError, agree, decide, world
from .manifest import MANIFEST, check_files, read_manifest
from .rng import set_rng_state
from .state import layout, model_states, sharded_state_dict

log = logging.getLogger(__name__)


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
    mine = names[dist.get_rank()::world()]
    try:
        problems = check_files(path, manifest, mine)
        error = "\n    ".join(problems) if problems else None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    try:
        agree(error, f"verifying checkpoint {path}", error=CheckpointLoadError)
    except CheckpointError as e:
        root = os.path.dirname(path)
        older = [i for i in _complete_iterations(root) if checkpoint_dir(root, i) != path]
        hint = (f"\n  other checkpoints with a manifest under {root}: {older} (load one with --ckpt-step N; "
                "they are verified the same way)" if older else "")
        raise CheckpointLoadError(f"{e}{hint}") from None


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
    where = _find_verified(args, iteration)
    if where is None:
        return 0
    path, iteration = where["path"], where["iteration"]
    info = decide(lambda: _inspect(path), f"reading checkpoint {path}", error=CheckpointLoadError)
    what = _restore(args, path, iteration, info, model, optimizer, scheduler)
    if dist.get_rank() == 0:
        verified = "verified" if where["manifest"] is not None else "unverified"
        log.info(f"  loaded checkpoint {path} ({', '.join(what)}; {verified}) at iteration {iteration}")
    return 0 if args.finetune else int(info["iteration"] if info["iteration"] is not None else iteration)


def _find_verified(args, iteration: int | None) -> dict | None:
    """Rank 0's choice under ``args.load`` (None: nothing to load, said on rank 0), its files
    verified against its manifest by every rank (a checkpoint without one is said unverified)."""
    root = args.load
    where = decide(lambda: _locate(root, iteration, args.exit_on_missing_checkpoint),
                   f"finding a checkpoint under --load {root}", error=CheckpointLoadError)
    if where is None:
        if dist.get_rank() == 0:
            log.warning(f"WARNING: --load {root}: no checkpoint found, training from scratch")
        return None
    path = where["path"]
    if where["manifest"] is not None:
        verify_checkpoint(path, where["manifest"])
    elif dist.get_rank() == 0:
        log.warning(f"WARNING: {path} has no {MANIFEST} (not saved by megatron_paradyse): loading it unverified")
    return where


def _restore(args, path: str, iteration: int, info: dict, model, optimizer, scheduler) -> list:
    """Load the model and what ``args`` and the checkpoint allow (optimizer, scheduler, RNG
    states); returns the names of what was loaded, for the log line."""
    from megatron.core import dist_checkpointing

    keys = set(info["keys"])
    finetune = args.finetune
    load_optim = optimizer is not None and not finetune and not args.no_load_optim and "optimizer" in keys
    load_rng = (not finetune and not args.no_load_rng and info["layout"] == layout()
                and "rng_state" in keys)
    sd = sharded_state_dict(model, optimizer if load_optim else None,
                            None, iteration, args, with_rng=load_rng, is_loading=True)
    try:
        loaded = dist_checkpointing.load(sd, path, strict="assume_ok_unexpected")
        for key, gpt in model_states(model).items():
            gpt.load_state_dict(loaded[key], strict=True)
    except Exception as e:  # noqa: BLE001 - a checkpoint of another model (shapes, keys)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise CheckpointLoadError(f"{path} cannot be loaded into this model (was it saved with other "
                                  f"model flags?): {type(e).__name__}: {first}") from None
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and not finetune and info["scheduler"] is not None:
        scheduler.load_state_dict(info["scheduler"])
    if load_rng:
        from megatron.core import parallel_state

        states = loaded["rng_state"]
        set_rng_state(states[parallel_state.get_data_parallel_rank()])
    return ["model"] + (["optimizer"] if load_optim else []) + (["rng"] if load_rng else [])
