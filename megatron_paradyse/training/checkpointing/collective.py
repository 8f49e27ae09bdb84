"""Collective decisions: rank 0 acts and broadcasts the outcome, or every rank reports and all
agree; every rank goes on or every rank raises :class:`CheckpointError`, never one alone."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import UserError
from ...parallel.plan_check import collective_device


class CheckpointError(RuntimeError):
    """A save or load failed; raised on every rank together (never one rank alone)."""


class CheckpointLoadError(CheckpointError, UserError):
    """``--load`` names a checkpoint that is missing, damaged, or made for another model: a
    user's mistake (one line, exit status 2; ``errors``), raised on every rank together."""


def world() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def decide(fn, what: str, error=CheckpointError):
    """Rank 0 runs ``fn()`` and broadcasts its result: every rank returns it, or every rank
    raises :class:`CheckpointError` with rank 0's error. Replaces barrier + rank-0 work."""
    out = [None]
    if dist.get_rank() == 0:
        try:
            out = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - handed to every rank
            out = [("error", f"{type(e).__name__}: {e}")]
    if world() > 1:
        dist.broadcast_object_list(out, src=0)
    status, value = out[0]
    if status != "ok":
        raise error(f"{what} failed on rank 0: {value}")
    return value


def agree(local_error: str | None, what: str, error=CheckpointError) -> None:
    """One all-reduce of an error flag; if any rank failed, every rank raises ``error`` with
    every message."""
    if world() == 1:
        if local_error:
            raise error(f"{what} failed: {local_error}")
        return
    flag = torch.tensor([1 if local_error else 0], dtype=torch.int64, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()) == 0:
        return
    errors = [None] * world()
    dist.all_gather_object(errors, local_error)
    lines = [f"  rank {r}: {e}" for r, e in enumerate(errors) if e]
    raise error(f"{what} failed on {len(lines)} rank(s):\n" + "\n".join(lines))


def gather_to_rank0(obj) -> list | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere)."""
    if world() == 1:
        return [obj]
    out = [None] * world() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out
