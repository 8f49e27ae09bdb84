"""Run a function on N gloo ranks in fresh processes, with a timeout, and collect results.

Used by the tests, the benchmarks and the demo on CPU machines. A failing rank is reported
with its traceback; a hung world is killed at the deadline instead of hanging its caller.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import tempfile
import time
import traceback

import torch.multiprocessing as tmp


class WorldError(RuntimeError):
    """One or more ranks failed or the world timed out; the message holds each rank's report."""


def _worker(fn, rank, world_size, init_file, args, kwargs, results, env, coll_timeout):
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=coll_timeout),
        )
        out = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", pickle.dumps(out)))  # by value: the child may exit first
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_world(fn, world_size: int, *args, timeout: float = 300.0, env: dict | None = None,
              grace: float = 5.0, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Returns the list of per-rank return values (which must be picklable). Raises
    :class:`WorldError` with every failing rank's traceback if a rank raises, and with the
    list of silent ranks if the world does not finish within ``timeout`` seconds. Once one
    rank fails, the others get ``grace`` seconds to report before they are killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    child_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    child_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="paradyse_world_") as tmpdir:
        init_file = os.path.join(tmpdir, "store")
        procs = [
            ctx.Process(target=_worker, daemon=False,  # ranks may start children (checkpoint writers)
                        args=(fn, r, world_size, init_file, args, kwargs, results, child_env,
                              max(timeout, 1.0)))
            for r in range(world_size)
        ]
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
