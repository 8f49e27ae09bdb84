"""Run a function on N gloo ranks in fresh processes, with a timeout, and collect results
(``run_world``: the product's ``launch.run_ranks`` with the tests' hooks; ``run_forked_worlds``:
many worlds forked from processes that import once). Used by the tests, the benchmarks and
the demo on CPU machines. A failing rank is reported
with its traceback; a hung world is killed at the deadline instead of hanging its caller.
"""
from __future__ import annotations

import datetime
import functools
import importlib
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from ..cpu_compat import RANK_ENV
from ..device import select
from ..launch import START_ENV, WorldError, process_env, run_ranks  # noqa: F401  (WorldError re-exported)
from .. import trace as trace_mod


FAKE_CUDA_ENV = "PARADYSE_FAKE_CUDA_AVAILABLE"


def fake_cuda_available() -> None:
    """With ``$PARADYSE_FAKE_CUDA_AVAILABLE=1``, ``torch.cuda.is_available()`` answers True in this
    process (the CPU ranks then play a GPU host's: everything must still follow the gloo
    backend's device decision, not CUDA's presence). ``tests/conftest.py`` and every rank
    this module starts call it."""
    if os.environ.get(FAKE_CUDA_ENV) == "1":
        real = torch.cuda.is_available()
        torch.cuda.is_available = lambda: True
        # torch's own accelerator API keeps the truth: on a CUDA build of torch without a
        # driver, Adam's graph-capture check (``torch.accelerator.current_stream``) would
        # otherwise initialise CUDA and fail ("Found no NVIDIA driver"); the fake is for this
        # package's device decision, not torch's internals
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "is_available"):
            torch.accelerator.is_available = lambda: real


def run_world(fn, world_size: int, *args, timeout: float = 300.0, env: dict | None = None,
              grace: float = 5.0, trace: bool = False, traces: list | None = None, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks
    (``megatron_paradyse.launch.run_ranks``, with :func:`fake_cuda_available` first in each).

    Returns the list of per-rank return values (which must be picklable). Raises
    :class:`WorldError` with every failing rank's traceback if a rank raises, and with the
    list of silent ranks if the world does not finish within ``timeout`` seconds. Once one
    rank fails, the others get ``grace`` seconds to report before they are killed.

    ``trace=True`` (or a ``traces`` list): every rank records the collectives and
    point-to-point operations it posts (:mod:`megatron_paradyse.trace`), and NCCL's ordering rule is checked on
    the records (:func:`megatron_paradyse.trace.check` raises :class:`~megatron_paradyse.trace.TraceError`); ``traces`` receives
    the records, one list of :class:`~megatron_paradyse.trace.Op` per rank.
    """
    if trace or traces is not None:
        return _traced_world(fn, world_size, args, kwargs, traces, timeout=timeout, env=env, grace=grace)
    return _ranks(fn, world_size, *args, timeout=timeout, env=env, grace=grace, **kwargs)


# gloo's TCP mesh, set up inside ``init_process_group``, can fail with "Connection closed by
# peer" when a peer closes its socket before this rank finished connecting (seen under load,
# with two test files side by side): then the failing ranks have not run the test's function,
# and the world starts once more
CONNECT_FAILED = "connectFullMesh failed"


def _ranks(fn, world_size: int, *args, on_retry=None, **opts) -> list:
    """``run_ranks`` with the tests' hooks; a world whose every failing rank failed while gloo
    connected the ranks (:data:`CONNECT_FAILED`, inside ``init_process_group``, before ``fn``)
    starts once more, said on stderr, after ``on_retry()``. Any other failure is raised as it is."""
    try:
        return run_ranks(fn, world_size, *args, setup=fake_cuda_available, start_method=_forkserver(), **opts)
    except WorldError as e:
        failed = str(e).split("--- rank ")[1:]  # a silent rank ("--- ranks [..] did not finish") never retries
        if not failed or "--- ranks " in str(e) or not all(CONNECT_FAILED in f and "init_process_group" in f for f in failed):
            raise
        print(f"[run_world] gloo could not connect the ranks ({CONNECT_FAILED}); starting the world once more",
              file=sys.stderr)
    if on_retry is not None:
        on_retry()
    return run_ranks(fn, world_size, *args, setup=fake_cuda_available, start_method=_forkserver(), **opts)


def _traced_world(fn, world_size, args, kwargs, traces, **opts) -> list:
    """:func:`run_world` with every rank's posted operations recorded and checked. A world that
    fails or hangs is checked on what its ranks posted before they stopped: a difference there
    (the likely cause of the hang) is raised as :class:`~megatron_paradyse.trace.TraceError`, the world's own
    error attached."""
    with tempfile.TemporaryDirectory(prefix="paradyse_trace_") as folder:
        try:
            got = _ranks(functools.partial(trace_mod.traced, fn, folder), world_size, *args,
                         on_retry=functools.partial(_empty, folder), **opts, **kwargs)
        except WorldError as e:
            partial = [trace_mod.read(trace_mod.rank_path(folder, r)) for r in range(world_size)]
            if traces is not None:
                traces[:] = partial
            try:
                trace_mod.check(partial, partial=True)
            except trace_mod.TraceError as bad:
                raise trace_mod.TraceError(f"{bad}\n(the world failed: {str(e)[-2000:]})") from e
            raise
    records = [ops for _, ops in got]
    if traces is not None:
        traces[:] = records
    trace_mod.check(records)
    return [out for out, _ in got]


def _empty(folder: str) -> None:
    """Remove the files a failed start left in ``folder`` (a traced world's records)."""
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))


# what every test world imports: the fork server imports it once, each rank is a fork of it
PRELOAD = ["torch", "torch.distributed", "megatron_paradyse", "megatron.core", "megatron.core.models.gpt",
           "megatron_paradyse.testing.models"]


def _forkserver() -> str:
    """The start method of the tests' worlds: ``forkserver`` with :data:`PRELOAD` (ranks start
    in well under a second instead of importing torch and megatron-core each, seconds apiece on
    this machine), or ``spawn`` with ``$PARADYSE_WORLD_START=spawn``."""
    method = os.environ.get("PARADYSE_WORLD_START", "forkserver")
    if method == "forkserver":
        tmp.set_forkserver_preload(PRELOAD)
    return method


def fork_server_for_ranks() -> None:
    """Every world this process starts from now on, also ``launch.run_ranks``' where its caller
    names no start method (the profiler's, the cost-model report's), forked from the fork server
    of :func:`_forkserver` (``$PARADYSE_RANKS_START``; tests/conftest.py calls this)."""
    if _forkserver() == "forkserver":
        os.environ.setdefault(START_ENV, "forkserver")


# ============================================================================ forked worlds


def _case_child(fn, args, rank, world_size, store_path, result_path, log_path, coll_timeout):
    """In a forked child of a zygote: a fresh gloo world, ``fn``, the result to a file."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 0
    try:
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
        fake_cuda_available()
        select("gloo")
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=coll_timeout))
        out = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the zygote
        out, code = ("error", traceback.format_exc()), 1
    try:
        with open(result_path + ".part", "wb") as f:
            pickle.dump(out, f)
        os.replace(result_path + ".part", result_path)
    except Exception:  # noqa: BLE001 - an unpicklable result: report why
        with open(result_path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter shutdown (it could wait on the process group)


def _zygote(rank, world_size, cases, tmpdir, preload, env, timeout, results):
    """Import once, then fork one child per case; report each child's outcome and exit time."""
    os.environ.update(env)
    try:
        torch.set_num_threads(1)
        for name in preload:
            importlib.import_module(name)
        for i, (fn, args) in enumerate(cases):
            store = os.path.join(tmpdir, f"store_{i}")
            result_path = os.path.join(tmpdir, f"result_{i}_{rank}.pkl")
            log_path = os.path.join(tmpdir, f"log_{i}_{rank}.txt")
            start = time.time()
            pid = os.fork()
            if pid == 0:
                _case_child(fn, args, rank, world_size, store, result_path, log_path, max(timeout, 1.0))
            deadline = time.monotonic() + timeout
            status = None
            while time.monotonic() < deadline:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = st
                    break
                time.sleep(0.02)
            exited_at = time.time()
            timed_out = status is None
            if timed_out:
                os.kill(pid, 9)
                _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            out = None
            if os.path.exists(result_path):
                with open(result_path, "rb") as f:
                    out = pickle.load(f)
            with open(log_path, errors="replace") as f:
                log = f.read()
            results.put((i, rank, dict(exitcode=code, timed_out=timed_out, started_at=start,
                                       exited_at=exited_at, outcome=out, log=log)))
    except BaseException:  # noqa: BLE001
        results.put((-1, rank, traceback.format_exc()))


def run_forked_worlds(cases, world_size: int, timeout: float = 120.0, preload=(), env=None) -> list:
    """Run several fresh ``world_size``-rank gloo worlds, one per case, paying imports once.

    ``cases`` is a list of ``(fn, args)``; each is run as ``fn(rank, world_size, *args)`` in a
    new process per rank, forked from one long-lived process per rank (a zygote) that imported
    ``preload`` once (the zygotes are forked by the tests' fork server, :data:`PRELOAD` already
    imported there), with a new process group (its own file store). A case may fail, exit or
    be killed on any rank (fault-injection tests): nothing is raised for that. Returns, per
    case, a list over ranks of dicts: ``exitcode`` (negative: killed by that signal),
    ``timed_out`` (killed at ``timeout`` seconds), ``started_at`` / ``exited_at``
    (``time.time()``), ``outcome`` (``("ok", value)``, ``("error", traceback)`` or None when
    the process ended without returning) and ``log`` (its stdout and stderr). Raises
    :class:`WorldError` only when a zygote itself fails or the whole run overruns.
    """
    ctx = tmp.get_context(_forkserver())
    results = ctx.Queue()
    child_env = dict(RANK_ENV)
    child_env.update(env or {})
    out = [[None] * world_size for _ in cases]
    with tempfile.TemporaryDirectory(prefix="paradyse_forked_") as tmpdir:
        procs = [ctx.Process(target=_zygote, daemon=False,
                             args=(r, world_size, list(cases), tmpdir, tuple(preload), child_env, timeout, results))
                 for r in range(world_size)]
        with process_env(child_env):
            for p in procs:
                p.start()
        deadline = time.monotonic() + 60.0 + timeout * max(len(cases), 1)
        missing = len(cases) * world_size
        try:
            while missing:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorldError(f"forked worlds did not finish; {missing} case reports missing")
                try:
                    i, rank, report = results.get(timeout=min(1.0, left))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (None, 0)]
                    if dead:
                        raise WorldError(f"zygote(s) {dead} died") from None
                    continue
                if i < 0:
                    raise WorldError(f"--- zygote {rank} failed ---\n{report}")
                out[i][rank] = report
                missing -= 1
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return out
