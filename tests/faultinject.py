"""Test-only fault injection for tests/test_faults.py (never imported by the product).

``install(spec)`` monkey-patches, in the calling rank only, one place selected by
``spec["kind"]``; the fault fires on global rank ``spec["rank"]`` while it runs iteration
``spec["iteration"]`` (1-based, the step being computed or saved), after writing
``time.time()`` to ``spec["stamp"]`` (with ``spec["losses"]``, each rank also writes its
per-step losses to ``{losses}.{rank}``):

* ``raise_forward`` / ``raise_backward`` / ``kill_forward``: inside the ``ring`` strategy's
  K/V ring, at its second block (peers are mid-ring), in the forward or the backward;
  ``raise_*`` raises RuntimeError, ``kill_*`` sends SIGKILL to the rank.
* ``save_rank0``: rank 0's filesystem work of the save (just before the rename and the
  tracker update) raises ``OSError(ENOSPC)``.
* ``kill_save``: SIGKILL to the rank while megatron's checkpoint writer is writing its shard
  (from inside the writer; the half-written file stays in ``iter_N.tmp``).

tests/fault_site/sitecustomize.py calls ``install`` in torchrun workers when
``PARADYSE_FAULT`` holds a JSON spec, so the real launcher and entry script run unchanged.
"""
from __future__ import annotations

import errno
import functools
import json
import os
import signal
import sys
import time

STATE = {"iteration": 0, "rank_pid": None}


def _stamp(spec):
    with open(spec["stamp"], "w") as f:
        f.write(repr(time.time()))


def _fires(spec) -> bool:
    return int(os.environ.get("RANK", "-1")) == spec["rank"] and STATE["iteration"] == spec["iteration"]


def install(spec: dict) -> None:
    from megatron_paradyse.training import trainer

    STATE["rank_pid"] = os.getpid()
    original_step = trainer.Trainer.train_step
    original_save = trainer.Trainer.save

    def train_step(self):
        STATE["iteration"] = self.iteration + 1
        stats = original_step(self)
        if spec.get("losses"):  # the per-step losses, for comparisons with resumed runs
            STATE.setdefault("losses", []).append(stats.loss)
            with open(f"{spec['losses']}.{os.environ.get('RANK')}", "w") as f:
                json.dump(STATE["losses"], f)
        return stats

    def save(self):
        STATE["iteration"] = self.iteration
        return original_save(self)

    trainer.Trainer.train_step = train_step
    trainer.Trainer.save = save
    kind = spec["kind"]
    if kind in ("raise_forward", "raise_backward", "kill_forward"):
        from megatron_paradyse.parallel.strategies import ring

        original_stream = ring.kv_stream
        phase = "backward" if kind.endswith("backward") else "forward"

        def kv_stream(*a, **k):
            # the frame that iterates the ring: RingAttention.forward's ring_forward, or backward
            caller = sys._getframe(1).f_code.co_name
            callers = ("forward", "ring_forward") if phase == "forward" else ("backward",)
            for n, item in enumerate(original_stream(*a, **k)):
                if n == 1 and caller in callers and _fires(spec):
                    _stamp(spec)
                    if kind.startswith("kill"):
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise RuntimeError(f"injected fault in the ring {phase} at iteration {spec['iteration']}")
                yield item

        ring.kv_stream = kv_stream
    elif kind == "save_rank0":
        from megatron_paradyse.training.checkpointing import atomic

        original_publish = atomic.publish

        def publish(*a, **k):
            if _fires(spec):
                _stamp(spec)
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return original_publish(*a, **k)

        atomic.publish = publish
    elif kind == "kill_save":
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

        original_write = fa._write_item

        @functools.wraps(original_write)  # megatron inspects its signature
        def write_item(*a, **k):
            result = original_write(*a, **k)  # at least one item of the shard is on disk
            if _fires(spec):
                _stamp(spec)
                os.kill(STATE["rank_pid"], signal.SIGKILL)  # the rank, mid-write
                if os.getpid() != STATE["rank_pid"]:
                    os.kill(os.getpid(), signal.SIGKILL)  # and its writer process
            return result

        fa._write_item = write_item
    else:
        raise ValueError(f"unknown fault kind {kind!r}")
