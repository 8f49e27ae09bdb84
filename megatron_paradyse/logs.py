"""Logging for the command lines. Library modules log to ``logging.getLogger(__name__)`` (as
megatron-core does) and configure nothing; each command line's ``main`` calls :func:`setup`.

After :func:`setup`, the package's records (the ``megatron_paradyse`` logger, which then no
longer passes them to the root logger: Megatron-LM's root handler would print them again) go

* below WARNING: to stdout (or ``stream``) on rank 0 only, as the bare message, so that the
  iteration lines keep Megatron-LM's format;
* WARNING and above: to stderr on every rank, each line prefixed ``[rank R]`` in a world of
  more than one rank (as ``training.faults`` prefixes a failing rank's traceback).

The rank is read at each record: torch.distributed's where it is initialised (a fake group,
one process playing a rank, counts as one process), else torchrun's ``RANK``/``WORLD_SIZE``.
Ranks that :func:`megatron_paradyse.launch.run_ranks` starts log as the process that started
them (:func:`current`). Messages the same on every rank are logged on rank 0 only
(``megatron.core.utils.log_single_rank``), so that a world prints them once.
"""
from __future__ import annotations

import logging
import os
import sys

NAME = "megatron_paradyse"


def rank_and_world() -> tuple:
    """``(rank, world size)`` of this process, for the handlers."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "fake":
            return 0, 1
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class _Std(logging.StreamHandler):
    """A handler on ``sys.stdout`` or ``sys.stderr`` as it is at each record (redirected, or
    captured by pytest), never a stream that was replaced since."""

    def __init__(self, which: str):
        self.which = which
        super().__init__()

    @property
    def stream(self):
        return getattr(sys, self.which)

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ sets it: the property decides
        pass


class _RankFormatter(logging.Formatter):
    """The message (and traceback), each line prefixed ``[rank R]`` where there are several ranks."""

    def format(self, record):
        text = super().format(record)
        rank, world = rank_and_world()
        if world <= 1:
            return text
        return "\n".join(f"[rank {rank}] {line}" for line in text.splitlines())


def _rank0_below_warning(record) -> bool:
    return record.levelno < logging.WARNING and rank_and_world()[0] == 0


def setup(level: int = logging.INFO, stream: str = "stdout") -> logging.Logger:
    """Configure the package's logger for a command line (idempotent: replaces a previous
    setup). ``level``: the least level shown (WARNING: warnings and errors only). ``stream``:
    ``"stdout"`` or ``"stderr"``, where rank 0's records below WARNING go (a command whose
    stdout is its result logs to stderr)."""
    if stream not in ("stdout", "stderr"):
        raise ValueError(f"stream must be 'stdout' or 'stderr', got {stream!r}")
    logger = logging.getLogger(NAME)
    for h in [h for h in logger.handlers if isinstance(h, _Std)]:
        logger.removeHandler(h)
    info = _Std(stream)
    info.addFilter(_rank0_below_warning)
    info.setFormatter(logging.Formatter("%(message)s"))
    warn = _Std("stderr")
    warn.setLevel(logging.WARNING)
    warn.setFormatter(_RankFormatter("%(message)s"))
    logger.addHandler(info)
    logger.addHandler(warn)
    logger.setLevel(level)
    logger.propagate = False
    return logger


def current() -> dict | None:
    """The arguments of this process's :func:`setup` (for the ranks it starts), or None."""
    logger = logging.getLogger(NAME)
    std = [h for h in logger.handlers if isinstance(h, _Std)]
    if not std:
        return None
    return {"level": logger.level, "stream": std[0].which}
