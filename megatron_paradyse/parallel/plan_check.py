"""The cross-rank plan check: one all-reduce proves every rank of a switching group runs the same plans.

A divergence (or an error while planning on any rank) raises :class:`PlanMismatchError` on
every rank together, naming each rank's plan: never a hang. Used by the training iterator
and by ``set_plan(..., verify=True)``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..device import current
from .groups import host_group
from .plans import describe, plan_hash


class PlanMismatchError(RuntimeError):
    """Ranks of a switching group disagree on a plan or a micro-batch shape (raised on every rank)."""


_NEG_INF = -(1 << 63)


def collective_device():
    """The device collectives of this process take (the device decision: cuda under NCCL,
    cpu under gloo)."""
    return current()


def verify_plans(step: int, entries: list, num_expected: int, group_index: int, num_groups: int,
                 local_error: str | None = None, group=None, where: str | None = None) -> None:
    """Check that every rank of each switching group agrees on the step's plans and shapes.

    ``entries`` holds one ``(plan, shape)`` per micro-batch; ``group_index`` is this rank's
    switching group (its data-parallel rank) among ``num_groups``. One all-reduce (MAX) over
    ``group`` (default: the world) of a vector with, per group and micro-batch, ``h`` and
    ``-h`` (other groups' slots hold -inf), plus an error flag: afterwards every rank knows
    every group's min and max hash, so all ranks raise together or none does. ``where``
    names the check in messages (default ``iteration {step}``).
    """
    where = where or f"iteration {step}"
    n = num_expected
    width = 2 * (n + 1)
    vec = torch.full((num_groups * width + 1,), _NEG_INF, dtype=torch.int64)
    base = group_index * width
    hashes = [plan_hash(("step", step, n))] + [plan_hash(e) for e in entries]
    hashes += [plan_hash(("missing", i)) for i in range(len(hashes), n + 1)]
    for i, h in enumerate(hashes):
        vec[base + 2 * i] = h
        vec[base + 2 * i + 1] = -h
    vec[-1] = 1 if local_error else 0
    if group is None and host_group() is not None:
        group = host_group()  # host values on a host communicator: no device sync
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dev = torch.device("cpu") if dist.get_backend(group) == "gloo" else collective_device()
        t = vec.to(dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        vec = t.cpu()
    vals = vec.tolist()
    failed = vals[-1] > 0
    bad = []
    for g in range(num_groups):
        for i in range(n + 1):
            hi, lo = vals[g * width + 2 * i], -vals[g * width + 2 * i + 1]
            if hi != lo:
                bad.append((g, i - 1))  # i-1 == -1: the step header (micro-batch count) differs
    if not failed and not bad:
        return
    # Every rank reaches this point together: one more collective is safe.
    report = {
        "rank": dist.get_rank() if dist.is_initialized() else 0, "group": group_index,
        "error": local_error,
        "entries": [(describe(p) if p is not None else "stock", tuple(s)) for p, s in entries],
    }
    reports = [report]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        reports = [None] * dist.get_world_size(group)
        dist.all_gather_object(reports, report, group=group)
    lines = []
    if failed:
        for r in reports:
            if r["error"]:
                lines.append(f"  rank {r['rank']} failed while reading or planning the step:\n"
                             + "\n".join("    " + ln for ln in r["error"].rstrip().splitlines()[-6:]))
        head = (f"ParaDySe: preparing {where} failed on "
                f"{sum(1 for r in reports if r['error'])} rank(s); every rank stops here")
    else:
        g, i = bad[0]
        members = [r for r in reports if r["group"] == g]
        what = "the number of micro-batches" if i < 0 else f"micro-batch {i}"
        head = (f"ParaDySe plan mismatch at {where}, {what}: the ranks of switching "
                f"group {g} (global ranks {[r['rank'] for r in members]}) do not agree on the "
                "plan (or the micro-batch shape); running it would hang or corrupt the step")
        for r in members:
            if i < 0:
                lines.append(f"  rank {r['rank']}: {len(r['entries'])} micro-batches")
            elif i < len(r["entries"]):
                plan, shape = r["entries"][i]
                lines.append(f"  rank {r['rank']}: micro-batch shape {list(shape)} plan {plan}")
            else:
                lines.append(f"  rank {r['rank']}: no micro-batch {i}")
        if len(bad) > 1:
            lines.append(f"  ({len(bad)} mismatching (group, micro-batch) pairs in all)")
        lines.append("  A plan must be a deterministic function of data every rank of the group "
                     "has (the same micro-batch, the same --paradyse-plan).")
    raise PlanMismatchError("\n".join([head] + lines))
