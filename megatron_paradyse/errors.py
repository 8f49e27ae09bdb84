"""A user's mistake ends a command with one line and exit status 2, never a traceback.

A mistake is a bad flag or flag combination, a file that is missing, corrupt, truncated or
made for another model (cost models, datasets, checkpoints, the tracker), an output that
cannot be written, a memory budget nothing fits, a length the model cannot hold. Each is
raised as a :class:`UserError` (its subclasses keep their older base classes too:
``training.arguments.ArgumentError`` is also a ``ValueError``), before any work, on every
rank. Anything else is an internal error and keeps its traceback.

* Command lines wrap their body in :func:`exit_on_user_error`: the line
  ``PROG: error: MESSAGE`` on stderr (rank 0 only, when several ranks raise it together; the
  others wait a moment, so torchrun, which stops the rest of a job when one rank exits, does
  not stop rank 0 before it has printed), then exit status 2.
* Inside ``training.faults.FailFast`` (ranks of an initialised job), the first rank to raise
  prints the line and the others exit quietly (docs/faults.md).
* Under torchrun each rank also writes the line to its ``TORCHELASTIC_ERROR_FILE``, so
  torchrun's end-of-job summary names it as the root cause. torchrun itself then exits 1 and
  prints that summary, as it does for any failed worker; the launch scripts of ``scripts/``
  check the flags before they start torchrun (``pretrain_gpt_paradyse.py`` with
  ``PARADYSE_CHECK_FLAGS=1``) and exit 2 with the one line.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time

from .logs import rank_and_world

EXIT_USER = 2          # a user's mistake (argparse's status for bad flags)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, the shell's convention)
PEER_PAUSE = 1.0       # seconds a rank other than 0 waits before exiting, so rank 0 prints first


class UserError(Exception):
    """A mistake of the user's: reported as one line and exit status 2, without a traceback."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors (an unknown flag, a bad value) are a :class:`UserError`:
    one line naming the flag, not the usage text (``--help`` shows it)."""

    def error(self, message):
        own = message.startswith(("unrecognized arguments", "the following arguments are required",
                                  "argument ", "ambiguous option"))
        raise UserError(f"{message} (--help lists the flags)" if own else message)


def one_line(prog: str, exc: BaseException) -> str:
    """``PROG: error: MESSAGE``, a multi-line message joined with ``; ``."""
    parts = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{prog}: error: {'; '.join(parts) or type(exc).__name__}"


def say(line: str) -> None:
    """``line`` on stderr, after whatever stdout holds."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    print(line, file=sys.stderr, flush=True)


def record_for_torchrun(line: str) -> None:
    """Under torchrun, ``line`` as this worker's error (the launcher's summary prints it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:  # torchrun's format (its ErrorHandler): the summary prints py_callstack
            json.dump({"message": {"message": line, "extraInfo": {
                "py_callstack": line, "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass


def report(prog: str, exc: BaseException, every_rank: bool = False) -> None:
    """The one line for ``exc``: printed on rank 0 (on every rank with ``every_rank``: a
    mistake only this rank saw), recorded for torchrun on every rank."""
    line = one_line(prog, exc)
    rank, world = rank_and_world()
    if rank == 0 or every_rank:
        say(line if world <= 1 or rank == 0 else f"[rank {rank}] {line}")
    record_for_torchrun(line)


@contextlib.contextmanager
def exit_on_user_error(prog: str, every_rank: bool = False):
    """Turn a :class:`UserError` raised inside into the one line and ``SystemExit(2)``
    (:func:`report`); other exceptions pass unchanged."""
    try:
        yield
    except UserError as exc:
        report(prog, exc, every_rank=every_rank)
        rank, world = rank_and_world()
        if world > 1 and rank != 0 and not every_rank:
            time.sleep(PEER_PAUSE)
        raise SystemExit(EXIT_USER) from None


def command(prog: str):
    """Decorate a command line's ``main(argv=None)``: a :class:`UserError` inside becomes the
    one line and ``SystemExit(2)`` (:func:`exit_on_user_error`)."""
    def wrap(fn):
        @functools.wraps(fn)
        def main(argv=None):
            with exit_on_user_error(prog):
                return fn(argv)
        return main
    return wrap
