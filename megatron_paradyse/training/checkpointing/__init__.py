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
synchronously with an in-process results queue instead (``save.py``, ``in_process_results_queue``),
but scripts should still keep their body under ``if __name__ == "__main__":``.
"""
from __future__ import annotations

from .atomic import TRACKER, checkpoint_dir, read_tracker
from .collective import CheckpointError, CheckpointLoadError
from .load import load_checkpoint, verify_checkpoint
from .manifest import MANIFEST, check_files, file_digest, read_manifest
from .save import save_checkpoint
from .state import CHECKPOINT_VERSION, sharded_state_dict

__all__ = ["CHECKPOINT_VERSION", "MANIFEST", "TRACKER", "CheckpointError", "CheckpointLoadError", "check_files", "checkpoint_dir",
           "file_digest", "load_checkpoint", "read_manifest", "read_tracker", "save_checkpoint",
           "sharded_state_dict", "verify_checkpoint"]
