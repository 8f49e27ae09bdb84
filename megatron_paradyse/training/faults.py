"""Fail fast: one rank's failure ends every rank of the job within seconds, with its error in the log.

A rank that raises while its peers sit in a collective would otherwise leave them waiting
until the process-group timeout. :class:`FailFast` (``main()`` runs the trainer inside it)
turns any exception on any rank into the end of the whole job:

1. the failing rank prints its traceback, prefixed ``[rank R]``;
2. it publishes a one-line summary under a key of the job's c10d store (the store that
   ``init_process_group`` rendezvoused through: torchrun's agent store, the TCPStore of
   MASTER_ADDR:MASTER_PORT, or a file store) and, under torchrun, writes the
   ``TORCHELASTIC_ERROR_FILE`` so the launcher's summary names it as the root cause;
3. it aborts its NCCL communicators (nothing to do on gloo: process exit closes the sockets)
   and exits with status 1 (``os._exit``: no barrier, no interpreter shutdown that could wait
   on a collective);
4. every other rank notices within ``poll_seconds`` (a daemon thread polls the store key) or
   at once through its own failing collective (gloo reports a closed connection immediately),
   prints ``[rank r] stopping: rank R failed: ...`` and exits with status 3.

torchrun also tears the remaining workers down as soon as one exits non-zero, so the job ends
by whichever comes first. A rank killed outright (SIGKILL, OOM killer, lost node) cannot
publish anything: its gloo peers fail at once on the closed connection and take over step 2;
on NCCL a dead peer is noticed by the launcher (torchrun's agent on that node, ``srun
--kill-on-bad-exit``) or, as a last resort, by the NCCL watchdog at the process-group timeout
(``--distributed-timeout-minutes``; keep ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``).

Errors raised together on every rank (a :class:`~megatron_paradyse.parallel.plan_check.PlanMismatchError`,
a :class:`~megatron_paradyse.training.checkpointing.CheckpointError`) need none of this to
avoid a hang; under ``FailFast`` they still end the job with status 1 on every rank.

Two kinds end the job without a traceback:

* a user's mistake (:class:`~megatron_paradyse.errors.UserError`: a corrupt cost model or
  checkpoint, a budget nothing fits): the first rank to publish it prints the one line
  ``PROG: error: ...`` (``errors.one_line``), every rank exits with status 2, the others
  quietly (a rank whose own mistake differs from the published one prints its own);
* Ctrl-C (``KeyboardInterrupt`` on any rank): rank 0 prints one line, with ``on_interrupt()``'s
  text (the trainer names the last complete checkpoint), and every rank exits with status 130.
  A rank whose collective failed because a peer was interrupted first exits quietly too.
After a failure inside ``FailFast`` the job is over (the store key stays set), even with
``exit_process=False``, which only lets the caller clean up before it exits.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

import torch.distributed as dist

from ..errors import EXIT_INTERRUPTED, EXIT_USER, PEER_PAUSE, UserError, one_line, record_for_torchrun, say

FAULT_KEY = "paradyse/fault"
FAULT_COUNT_KEY = "paradyse/fault_count"
EXIT_FAILED = 1        # this rank raised
EXIT_PEER_FAILED = 3   # this rank stopped because another rank failed

_COMM_ERROR_HINTS = ("Connection closed by peer", "Connection reset", "Broken pipe", "NCCL",
                     "Timed out", "timed out", "Socket", "ECONNRESET")


def _store():
    if not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - no store: nothing to publish to
        return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _say(text: str) -> None:
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    try:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass


def read_fault(store=None) -> dict | None:
    """The first failure published in this job, or None."""
    store = store if store is not None else _store()
    if store is None:
        return None
    try:
        if store.check([FAULT_KEY]):
            return json.loads(store.get(FAULT_KEY).decode())
    except Exception:  # noqa: BLE001
        return None
    return None


def is_communication_error(exc: BaseException) -> bool:
    """A failed collective (likely the consequence of another rank's failure, not the cause)."""
    text = f"{type(exc).__name__}: {exc}"
    return isinstance(exc, (ConnectionError, TimeoutError)) or any(h in text for h in _COMM_ERROR_HINTS) \
        or type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError")


class FailFast:
    """Context manager: an exception inside ends every rank of the job quickly (see module doc).

    ``poll_seconds``: how often the watcher thread reads the store key. ``exit_process``:
    exit with status 1 (the default, what ``main()`` does) or re-raise after telling the
    peers. ``store_lost_seconds``: a rank whose store stays unreachable this long (its host
    died) stops too. ``prog``: the command's name in a user's mistake's one line;
    ``on_interrupt``: a function whose text rank 0 adds to the Ctrl-C line.
    """

    def __init__(self, poll_seconds: float = 0.2, exit_process: bool = True,
                 store_lost_seconds: float = 30.0, prog: str = "error", on_interrupt=None):
        self.poll_seconds = poll_seconds
        self.exit_process = exit_process
        self.store_lost_seconds = store_lost_seconds
        self.prog = prog
        self.on_interrupt = on_interrupt
        self._said = threading.Lock()  # the Ctrl-C line: by the main thread or the watcher, once
        self._stop = threading.Event()
        self._thread = None
        self._store = None

    # ------------------------------------------------------------------ watcher
    def __enter__(self):
        self._store = _store()
        if self._store is not None and dist.get_world_size() > 1:
            self._thread = threading.Thread(target=self._watch, name="paradyse-failfast", daemon=True)
            self._thread.start()
        return self

    def _watch(self):
        rank, lost_since = _rank(), None
        while not self._stop.wait(self.poll_seconds):
            try:
                found = self._store.check([FAULT_KEY])
                lost_since = None
            except Exception as e:  # noqa: BLE001 - the store's host is gone (or slow)
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since >= self.store_lost_seconds and not self._stop.is_set():
                    _say(f"[rank {rank}] stopping: the job's c10d store has been unreachable for "
                         f"{self.store_lost_seconds:.0f} s ({type(e).__name__}: {e}); its host probably died")
                    os._exit(EXIT_PEER_FAILED)
                continue
            if found and not self._stop.is_set():
                fault = read_fault(self._store) or {}
                if fault.get("rank") == rank:
                    continue
                if fault.get("kind") in ("user", "interrupt"):  # said once, by the rank that raised it
                    if fault["kind"] == "interrupt" and rank == 0:
                        self._say_interrupted(fault.get("error", ""))  # a worker was interrupted alone
                    record_for_torchrun(fault.get("error", ""))
                    os._exit(EXIT_USER if fault["kind"] == "user" else EXIT_INTERRUPTED)
                _say(f"[rank {rank}] stopping: {_describe(fault)}")
                _record_peer_stop(rank, fault)
                os._exit(EXIT_PEER_FAILED)

    # ------------------------------------------------------------------ failure
    def __exit__(self, exc_type, exc, tb):
        self._stop.set()
        if exc is None:
            return False
        if isinstance(exc, SystemExit) and not exc.code:
            return False
        self.fail(exc)
        return False

    def fail(self, exc: BaseException) -> None:
        """Report ``exc``, tell the peers, abort communicators, exit (or return to re-raise)."""
        rank = _rank()
        store = self._store if self._store is not None else _store()
        if store is not None:
            try:
                store.set_timeout(datetime.timedelta(seconds=10))
            except Exception:  # noqa: BLE001
                pass
        first = read_fault(store)
        if isinstance(exc, (UserError, KeyboardInterrupt)) or (
                first is not None and first.get("kind") == "interrupt" and first.get("rank") != rank):
            code = self._quiet_end(exc, rank, store, first)
            _abort_communicators()
            if self.exit_process:
                os._exit(code)
            return
        summary = f"{type(exc).__name__}: {exc}".strip().splitlines()
        summary = summary[0] if summary else type(exc).__name__
        if first is not None and first.get("rank") != rank and is_communication_error(exc):
            # a consequence: the cause is already published (and printed by its rank)
            _say(f"[rank {rank}] stopping: {_describe(first)} (here: {summary[:160]})")
            _record_peer_stop(rank, first)
            code = EXIT_PEER_FAILED
        else:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            hint = ""
            if is_communication_error(exc):
                hint = (f"[rank {rank}] this is a failed collective: another rank probably died first "
                        "(killed, out of memory, lost node); look for its error or exit status\n")
            _say("".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()) + hint)
            if first is None:
                self._publish(store, rank, summary, is_communication_error(exc))
            _record_for_torchrun(f"[rank {rank}] {summary}", text)
            code = EXIT_FAILED
        _abort_communicators()
        if self.exit_process:
            os._exit(code)

    def _quiet_end(self, exc, rank: int, store, first) -> int:
        """A user's mistake or Ctrl-C (module doc): the one line by the rank that publishes it
        first (Ctrl-C: by rank 0), no traceback; the exit status."""
        interrupted = isinstance(exc, KeyboardInterrupt) or (first or {}).get("kind") == "interrupt"
        if interrupted:
            _ignore_sigint()  # torchrun forwards Ctrl-C again: no second KeyboardInterrupt in here
        kind = "interrupt" if interrupted else "user"
        line = (f"{self.prog}: interrupted (Ctrl-C)" if interrupted else one_line(self.prog, exc))
        published = self._publish(store, rank, line, kind=kind) if first is None else False
        if not published and first is None and store is not None:
            first = _wait_for_fault(store)  # another rank counted first: its line, once it is set
        if interrupted:
            if rank == 0 or store is None:
                self._say_interrupted(line)
            record_for_torchrun(line)
            return EXIT_INTERRUPTED
        if published or store is None or (first or {}).get("error") != line:
            say(line)
        record_for_torchrun(line)
        if not published and store is not None:
            time.sleep(PEER_PAUSE)  # the publishing rank prints before torchrun stops this one
        return EXIT_USER

    def _say_interrupted(self, line: str) -> None:
        """The Ctrl-C line with ``on_interrupt()``'s text, once per process."""
        if self._said.acquire(blocking=False):
            extra = _call(self.on_interrupt)
            say(line + (f"; {extra}" if extra else ""))

    @staticmethod
    def _publish(store, rank, summary, communication=False, kind="error") -> bool:
        """Publish this rank's failure if it is the job's first; whether it was."""
        if store is None:
            return False
        try:
            if store.add(FAULT_COUNT_KEY, 1) == 1:
                store.set(FAULT_KEY, json.dumps({"rank": rank, "host": socket.gethostname(),
                                                 "error": summary[:2000], "time": time.time(),
                                                 "communication": bool(communication), "kind": kind}))
                return True
        except Exception:  # noqa: BLE001 - the store is gone: peers learn it from their collectives
            pass
        return False


def _wait_for_fault(store, seconds: float = PEER_PAUSE) -> dict | None:
    """The published failure, waiting up to ``seconds`` for the rank that counted first to set it."""
    end = time.monotonic() + seconds
    while True:
        got = read_fault(store)
        if got is not None or time.monotonic() >= end:
            return got
        time.sleep(0.02)


def _ignore_sigint() -> None:
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass


def _call(fn) -> str:
    """``fn()``'s text, or "" (no function, or it failed: the Ctrl-C line goes out anyway)."""
    if fn is None:
        return ""
    try:
        return fn() or ""
    except Exception:  # noqa: BLE001
        return ""


def _describe(fault: dict) -> str:
    if not fault:
        return "another rank failed"
    if fault.get("communication"):
        return (f"rank {fault.get('rank')} ({fault.get('host')}) lost a peer in a collective, so "
                "another rank probably died (killed, out of memory, lost node; see the launcher's "
                f"exit statuses): {fault.get('error', '')[:160]}")
    return f"rank {fault.get('rank')} ({fault.get('host')}) failed: {fault.get('error')}"


def _record_for_torchrun(message: str, callstack: str = "", timestamp: float | None = None) -> None:
    """Write torchrun's per-worker error file (what its end-of-job summary prints).

    torchrun names the failure with the smallest timestamp (whole seconds) the root cause; a
    rank stopped by another's failure records that failure's message with a timestamp 2 s
    later, so the summary names the failing rank even when all exit within the same second."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        stamp = int(time.time() if timestamp is None else timestamp)
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": callstack, "timestamp": str(stamp)}}}, f)
    except Exception:  # noqa: BLE001
        pass


def _record_peer_stop(rank: int, fault: dict) -> None:
    _record_for_torchrun(f"[rank {rank}] stopped because {_describe(fault)}", "",
                         float(fault.get("time", time.time())) + 2)


def _abort_communicators() -> None:
    """NCCL: abort every communicator, so nothing of this rank lingers in a collective. Gloo:
    nothing (exiting the process closes its connections; its peers' collectives fail at once)."""
    try:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
    except Exception:  # noqa: BLE001
        pass
