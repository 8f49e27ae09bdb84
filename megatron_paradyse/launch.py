"""Ranks on this machine: ``run_ranks`` starts a world of fresh processes and collects what each
returns, with a timeout instead of a hang.

* ``run_ranks(fn, n, ..., backend="gloo")``: ``n`` CPU ranks of one gloo world
  (``device.select("gloo")`` before ``init_process_group``, also on a machine with GPUs),
  started with ``cpu_compat.RANK_ENV``;
* ``run_ranks(fn, 1, ..., backend="fake")``: one process with no process group, on the device
  a real rank of this machine computes on (the GPU where there is one; ``fake_device="gloo"``
  forces the CPU); ``fn`` joins torch's fake group itself (``costmodel.measure.init_fake``).

A failing rank is reported with its traceback; a world that does not finish is killed at the
deadline; a rank whose parent is gone (killed) ends itself. Each rank logs as the process that started it (``logs.current``). Used by the
profiler (``--nproc``), the cost-model report and calibration, and, through
``testing.spawn.run_world``, the tests and benchmarks.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from . import device, logs
from .cpu_compat import RANK_ENV


# the start method of ``run_ranks``' processes when its caller names none (the tests set
# ``forkserver``: ``testing.spawn``'s fork server, torch and megatron-core imported once)
START_ENV = "PARADYSE_RANKS_START"


class WorldError(RuntimeError):
    """One or more ranks failed or the world timed out; the message holds each rank's report."""


@contextlib.contextmanager
def process_env(env: dict):
    """``env`` in this process's environment while children start (torch reads
    ``THP_MEM_ALLOC_ENABLE`` at its first allocation, before a worker runs)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _exit_with_parent(parent: int, every: float = 1.0) -> None:
    """End this rank once the process that started it is gone: a parent killed by SIGTERM or
    SIGKILL runs no cleanup, and its ranks would go on computing (a killed profile's ranks did,
    at full CPU, beside the next one). A daemon thread polls once per ``every`` whether the
    parent lives (a rank forked by a fork server is not its child)."""
    def alive() -> bool:
        if os.getppid() == parent:
            return True
        try:
            os.kill(parent, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:  # a pid taken by another user's process: ours is gone
            return False

    def watch():
        while alive():
            time.sleep(every)
        os._exit(1)

    threading.Thread(target=watch, name="paradyse-parent-watch", daemon=True).start()


def _worker(fn, rank, world_size, init_file, backend, fake_device, args, kwargs, results, env, coll_timeout,
            setup, log_setup, parent):
    _exit_with_parent(parent)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    try:
        if log_setup is not None:
            logs.setup(**log_setup)
        if setup is not None:
            setup()
        if backend == "fake":
            dev = device.select(fake_device or device.default_backend())
            if dev.type == "cpu":
                torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        else:
            torch.set_num_threads(1)
            device.select("gloo")  # CPU ranks, also on a machine with GPUs
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                    world_size=world_size,
                                    timeout=datetime.timedelta(seconds=coll_timeout))
        out = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", pickle.dumps(out)))  # by value: the child may exit first
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, backend: str = "gloo",
              fake_device: str | None = None, grace: float = 5.0, env: dict | None = None,
              setup=None, start_method: str | None = None, **kwargs) -> list:
    """``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; the per-rank results
    (picklable). ``backend``: ``"gloo"`` (CPU ranks of one world) or ``"fake"`` (one process,
    no group; ``fake_device``: ``"nccl"`` plays a GPU rank, ``"gloo"`` a CPU one, default this
    machine's). Ranks start with ``cpu_compat.RANK_ENV`` updated by ``env``; ``setup`` (a
    picklable function) runs first in each rank; ``kwargs`` go to ``fn``. Raises
    :class:`WorldError` naming every failing rank (with its traceback) and the ranks that did
    not finish within ``timeout`` seconds; once one rank fails, the others get ``grace``
    seconds to report before they are killed. ``start_method``: multiprocessing's (default
    ``$PARADYSE_RANKS_START``, else ``"spawn"``); ``"forkserver"`` (the tests') forks each rank
    from one server process that imported torch once, where ``"spawn"`` imports it in every rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "fake"):
        raise ValueError(f"backend must be 'gloo' or 'fake', got {backend!r}")
    if backend == "fake" and world_size != 1:
        raise ValueError("the fake backend runs one process")
    ctx = tmp.get_context(start_method or os.environ.get(START_ENV) or "spawn")
    results = ctx.Queue()
    env = {**RANK_ENV, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="paradyse_world_") as tmpdir:
        init_file = os.path.join(tmpdir, "store")
        procs = [ctx.Process(target=_worker, daemon=False,
                             args=(fn, r, world_size, init_file, backend, fake_device, args, kwargs,
                                   results, env, max(timeout, 1.0), setup, logs.current(), os.getpid()))
                 for r in range(world_size)]
        with process_env(env):
            for p in procs:
                p.start()
        reports: dict = {}
        deadline = time.monotonic() + timeout
        first_error_at = None
        try:
            while len(reports) < world_size:
                now = time.monotonic()
                limit = deadline if first_error_at is None else min(deadline, first_error_at + grace)
                if now >= limit:
                    break
                try:
                    rank, status, payload = results.get(timeout=min(0.5, limit - now))
                except queue.Empty:
                    for r, p in enumerate(procs):
                        if r not in reports and not p.is_alive() and p.exitcode not in (None, 0):
                            reports[r] = ("error", f"rank {r} died with exit code {p.exitcode}")
                            first_error_at = first_error_at or time.monotonic()
                    continue
                reports[rank] = (status, payload)
                if status == "error" and first_error_at is None:
                    first_error_at = time.monotonic()
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
    errors = {r: v for r, (s, v) in reports.items() if s == "error"}
    missing = [r for r in range(world_size) if r not in reports]
    if errors or missing:
        parts = [f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(errors.items())]
        if missing:
            why = "after another rank failed" if errors else f"within the {timeout:.0f} s timeout"
            parts.append(f"--- ranks {missing} did not finish {why}; killed ---")
        raise WorldError("\n".join(parts))
    return [pickle.loads(reports[r][1]) for r in range(world_size)]
