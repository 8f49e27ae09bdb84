"""Saving: megatron-core's ``dist_checkpointing.save`` into ``iter_N.tmp``, every rank's shards
read back, rank 0's manifest, rename and tracker decided collectively."""
from __future__ import annotations

import contextlib
import queue

from ... import runtime
from . import atomic
from .atomic import checkpoint_dir
from .collective import decide, gather_to_rank0
from .manifest import digest_own_files, write_manifest
from .state import sharded_state_dict


@contextlib.contextmanager
def in_process_results_queue():
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
    # the registry's patch named ``checkpoint_results_queue`` (``runtime.py``), for the save
    runtime.install("checkpoint_results_queue", runtime.Patch(fa, "_results_queue", queue.Queue()))
    try:
        yield
    finally:
        runtime.restore("checkpoint_results_queue")


def _finalize_save(root: str, tmp: str, final: str, iteration: int, digests: list) -> str:
    """Rank 0: the manifest (written last into the folder), then the rename and the tracker."""
    write_manifest(tmp, iteration, digests)
    atomic.publish(root, tmp, final, iteration)
    return final


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
    decide(lambda: atomic.prepare(root, tmp), f"preparing checkpoint {tmp}")
    sd = sharded_state_dict(model, None if args.no_save_optim else optimizer,
                            scheduler, iteration, args, with_rng=not args.no_save_rng)
    with in_process_results_queue():
        dist_checkpointing.save(sd, tmp)
    digests = gather_to_rank0(digest_own_files(tmp))
    return decide(lambda: _finalize_save(root, tmp, final, iteration, digests),
                  f"finishing checkpoint {final}")
