"""Time-limited jobs: when the trainer stops early, saves and exits cleanly (Megatron-LM's flags).

* ``--exit-interval N``: stop after the iteration where ``iteration % N == 0``.
* ``--exit-duration-in-mins M``: stop after the first iteration that ends more than ``M``
  minutes after the process started (the import of this module, as Megatron-LM's
  ``_TRAIN_START_TIME``); checked after every iteration with one all-reduce (MAX) over the
  world, so every rank stops at the same iteration even when their clocks disagree.
* ``--exit-signal-handler``: stop after the iteration in which any rank received SIGTERM
  (what SLURM sends before the wall time), in the same all-reduce.

:meth:`ExitCheck.reason` says why to stop after an iteration (None: go on); the trainer then
saves a checkpoint (with ``--save``), logs the reason and returns, and the process exits with
status 0. A resumed run (``--load``) continues exactly where it stopped.
"""
from __future__ import annotations

import contextlib
import signal
import time

import torch
import torch.distributed as dist

from ..parallel.plan_check import collective_device

PROCESS_START = time.time()  # as Megatron-LM's _TRAIN_START_TIME: when the trainer was imported


class ExitCheck:
    """The exit decision after each iteration, the same on every rank."""

    def __init__(self, exit_interval: int | None = None, exit_duration_in_mins: float | None = None,
                 signal_handler: bool = False, start_time: float | None = None):
        self.exit_interval = exit_interval
        self.exit_duration_in_mins = exit_duration_in_mins
        self.signal_handler = signal_handler
        self.start_time = PROCESS_START if start_time is None else start_time
        self.signalled = False  # set by the SIGTERM handler inside :meth:`handling_signals`

    @classmethod
    def from_args(cls, args) -> "ExitCheck":
        return cls(getattr(args, "exit_interval", None), getattr(args, "exit_duration_in_mins", None),
                   bool(getattr(args, "exit_signal_handler", False)))

    def minutes(self) -> float:
        return (time.time() - self.start_time) / 60.0

    def reason(self, iteration: int) -> str | None:
        """Why to stop after ``iteration``, or None. With a duration or the signal handler, one
        all-reduce over the world (every rank calls this after every iteration)."""
        if self.exit_duration_in_mins or self.signal_handler:
            minutes = self.minutes()
            flags = torch.tensor([float(bool(self.exit_duration_in_mins) and minutes > self.exit_duration_in_mins),
                                  float(self.signalled)], dtype=torch.float64)
            if dist.is_initialized() and dist.get_world_size() > 1:
                t = flags.to(collective_device())
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                flags = t.cpu()
            if flags[1] > 0:
                return f"after receiving SIGTERM (--exit-signal-handler) at iteration {iteration}"
            if flags[0] > 0:
                return (f"after {minutes:.2f} minutes at iteration {iteration} "
                        f"(--exit-duration-in-mins {self.exit_duration_in_mins:g})")
        if self.exit_interval and iteration % self.exit_interval == 0:
            return f"at iteration {iteration} (--exit-interval {self.exit_interval})"
        return None

    @contextlib.contextmanager
    def handling_signals(self):
        """With ``--exit-signal-handler``: SIGTERM only sets :attr:`signalled` inside this (the
        previous handler back afterwards); else nothing."""
        if not self.signal_handler:
            yield
            return

        def received(signum, frame):
            self.signalled = True

        try:
            previous = signal.signal(signal.SIGTERM, received)
        except ValueError:  # not the main thread: no handler
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
