"""The per-step training hooks: plan each micro-batch, verify the plans agree, install them.

* :class:`PlannedIterator`: megatron's schedule pulls micro-batches lazily, so on the first
  pull of a step the wrapper prefetches the step's micro-batches, decides one plan per
  micro-batch, and checks with one all-reduce over the world (MAX of each plan's hash and
  of its negation) that every rank of each switching group holds the same plans and shapes.
  A divergence, or a data or planning error on any rank, raises :class:`PlanMismatchError`
  on every rank together, naming each rank's plan: never a hang.
* :func:`forward_step`: megatron's ``forward_step_func``: ``mp.set_plan(model, plan)``, then
  the stock GPT forward with labels, and megatron's per-token loss (:func:`loss_func`).
"""
from __future__ import annotations

import collections
import hashlib
import time
import traceback
from functools import partial

import torch
import torch.distributed as dist


# ============================================================================ plan check


class PlanMismatchError(RuntimeError):
    """Ranks of a switching group disagree on a plan or a micro-batch shape (raised on every rank)."""


_HASH_BITS = 62
_NEG_INF = -(1 << 63)


def _hash(obj) -> int:
    """A deterministic 62-bit hash (Python's ``hash`` is salted per process)."""
    digest = hashlib.blake2b(repr(obj).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << _HASH_BITS) - 1)


def _check_device():
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def verify_plans(step: int, entries: list, num_expected: int, group_index: int, num_groups: int,
                 local_error: str | None = None, group=None) -> None:
    """Check that every rank of each switching group agrees on the step's plans and shapes.

    ``entries`` holds one ``(plan, shape)`` per micro-batch; ``group_index`` is this rank's
    switching group (its data-parallel rank) among ``num_groups``. One all-reduce (MAX) over
    ``group`` (default: the world) of a vector with, per group and micro-batch, ``h`` and
    ``-h`` (other groups' slots hold -inf), plus an error flag: afterwards every rank knows
    every group's min and max hash, so all ranks raise together or none does.
    """
    n = num_expected
    width = 2 * (n + 1)
    vec = torch.full((num_groups * width + 1,), _NEG_INF, dtype=torch.int64)
    base = group_index * width
    hashes = [_hash(("step", step, n))] + [_hash(e) for e in entries]
    hashes += [_hash(("missing", i)) for i in range(len(hashes), n + 1)]
    for i, h in enumerate(hashes):
        vec[base + 2 * i] = h
        vec[base + 2 * i + 1] = -h
    vec[-1] = 1 if local_error else 0
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dev = _check_device()
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
    from .patch import describe

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
        head = (f"ParaDySe: preparing iteration {step} failed on "
                f"{sum(1 for r in reports if r['error'])} rank(s); every rank stops here")
    else:
        g, i = bad[0]
        members = [r for r in reports if r["group"] == g]
        where = "the number of micro-batches" if i < 0 else f"micro-batch {i}"
        head = (f"ParaDySe plan mismatch at iteration {step}, {where}: the ranks of switching "
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


# ============================================================================ iterator hook


class PlannedIterator:
    """Wraps an iterator of :class:`~megatron_paradyse.data.MicroBatch` for megatron's schedule.

    On the first ``next()`` of a step (or on :meth:`prefetch`) it reads the step's
    ``num_microbatches`` micro-batches, sets ``mb.plan = plan_fn(mb, step, index)`` on each
    (``None`` = stock code), and calls :func:`verify_plans`. ``plan_fn`` must be a
    deterministic function of the data; ``plan_fn=None`` leaves every plan ``None``.
    """

    def __init__(self, source, plan_fn, num_microbatches, group_index: int = 0, num_groups: int = 1,
                 start_step: int = 0, check: bool = True, group=None):
        self.source = source
        self.plan_fn = plan_fn
        self._nmb = num_microbatches
        self.group_index, self.num_groups = group_index, num_groups
        self.step = start_step
        self.check = check
        self.group = group
        self._buffer = collections.deque()
        self.current: list = []  # the micro-batches of the step being run
        self.last_check_seconds = 0.0

    def num_microbatches(self) -> int:
        return int(self._nmb() if callable(self._nmb) else self._nmb)

    def __iter__(self):
        return self

    def prefetch(self) -> list:
        """Read, plan and verify the next step's micro-batches (no-op if already done)."""
        if self._buffer:
            return self.current
        n = self.num_microbatches()
        items, error = [], None
        try:
            for i in range(n):
                mb = next(self.source)
                if self.plan_fn is not None:
                    plan = self.plan_fn(mb, self.step, i)
                    if plan is not None:
                        plan = tuple(plan)
                        for name in plan:
                            from . import strategies

                            strategies.get(name)
                    mb.plan = plan
                items.append(mb)
        except StopIteration:
            error = f"the data iterator ran out after {len(items)} of {n} micro-batches"
        except Exception:  # noqa: BLE001 - reported to every rank by verify_plans
            error = traceback.format_exc()
        t0 = time.perf_counter()
        if self.check:
            verify_plans(self.step, [(mb.plan, mb.shape) for mb in items], n, self.group_index,
                         self.num_groups, error, self.group)
        elif error:
            raise RuntimeError(error)
        self.last_check_seconds = time.perf_counter() - t0
        self.current = items
        self._buffer.extend(items)
        self.step += 1
        return items

    def __next__(self):
        if not self._buffer:
            self.prefetch()
        return self._buffer.popleft()


# ============================================================================ forward step


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's per-token GPT loss: (sum of masked token losses, real tokens, report)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model, paradyse: bool = True):
    """megatron ``forward_step_func``: install this micro-batch's plan, then the stock forward."""
    mb = next(data_iterator)
    if paradyse:
        import megatron_paradyse as mp

        mp.set_plan(model, mb.plan)
    dev = next(model.parameters()).device
    mb = mb.to(dev)
    output = model(mb.tokens, mb.position_ids, None, labels=mb.labels)
    return output, partial(loss_func, mb.loss_mask)
