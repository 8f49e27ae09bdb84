"""Every communicator a run uses, created at start-up, before its memory budget is measured.

NCCL creates a group's communicator at the group's first collective, and each takes hundreds
of MB to over 1 GB of device memory outside torch's allocator. Left alone, the weight twins
(``groups.py``), the CP group, the data-parallel and pipeline groups would each be created
inside the first step, after the planner measured what the device can hand out: a tight plan
would then run out of memory there, and a rank that fails inside a collective leaves its
peers waiting until the timeout.

:func:`create_all` posts one all-reduce of one element on every process group this rank is a
member of (megatron's parallel-state groups, the plugin's twins, torch's default group), in
torch's creation order, the same on every rank: a rank visits its groups in increasing order,
so the lowest group not yet done always has all its members at it, and no two ranks wait on
each other. It returns the device memory that took (CUDA: free memory before and after; None on
the CPU). With ``init_process_group(device_id=...)`` torch creates every later group by
``ncclCommSplit`` of the default one, sharing its resources (``trainer.init_distributed``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..device import current as current_device


@dataclasses.dataclass(frozen=True)
class Created:
    """What :func:`create_all` did: ``groups`` warmed up, ``device_bytes`` of device memory they
    took (None on the CPU, where it is not measured)."""

    groups: int
    device_bytes: int | None

    def describe(self) -> str:
        mem = ("memory not measured on the CPU" if self.device_bytes is None
               else f"{self.device_bytes / 2**20:.0f} MiB of device memory outside torch's allocator")
        return f"{self.groups} communicators created before the budget ({mem})"


def _order(name: str):
    return (0, int(name)) if name.isdigit() else (1, name)


def member_groups() -> list:
    """The process groups this rank belongs to (more than one member), in torch's creation order
    (group names; the same order on every rank)."""
    from torch.distributed import distributed_c10d as c10d

    out = []
    for pg, ranks in c10d._world.pg_group_ranks.items():
        if len(ranks) > 1 and dist.get_rank() in ranks:
            out.append(pg)
    return sorted(out, key=lambda pg: _order(pg.group_name))


def create_all() -> Created:
    """One all-reduce on every group this rank is a member of (collective over the world: every
    rank calls it at the same point)."""
    if not dist.is_initialized() or "fake" in str(dist.get_backend()):
        return Created(0, None)
    dev = current_device()
    before = _free(dev)
    groups = member_groups()
    for pg in groups:
        on = torch.device("cpu") if dist.get_backend(pg) == "gloo" else dev
        dist.all_reduce(torch.zeros(1, device=on), group=pg)
    after = _free(dev)
    return Created(len(groups), None if before is None else max(0, before - after))


def _free(dev) -> int | None:
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    return torch.cuda.mem_get_info(dev)[0]
