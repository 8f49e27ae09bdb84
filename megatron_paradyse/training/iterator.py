"""The per-step iterator hook: plan each micro-batch of a step, verify the plans agree.

megatron's schedule pulls micro-batches lazily, so on the first pull of a step
:class:`PlannedIterator` prefetches the step's micro-batches, decides one plan per
micro-batch, and checks with one all-reduce (:func:`~megatron_paradyse.parallel.plan_check.verify_plans`)
that every rank of each switching group holds the same plans and shapes.
"""
from __future__ import annotations

import collections
import time
import traceback

from ..errors import UserError
from ..parallel.plan_check import PlanMismatchError, verify_plans
from ..parallel.plans import validate_names


class PlannedIterator:
    """Wraps an iterator of :class:`~megatron_paradyse.data.MicroBatch` for megatron's schedule.

    On the first ``next()`` of a step (or on :meth:`prefetch`) it reads the step's
    ``num_microbatches`` micro-batches, sets ``mb.plan = plan_fn(mb, step, index)`` on each
    (``None`` = stock code), or with pipeline stages ``step_plan_fn`` plans (and may reorder)
    them together, and calls :func:`verify_plans`. ``plan_fn`` must be a
    deterministic function of the data; ``plan_fn=None`` leaves every plan ``None``.
    """

    def __init__(self, source, plan_fn, num_microbatches, group_index: int = 0, num_groups: int = 1,
                 start_step: int = 0, check: bool = True, group=None, counts=None, step_plan_fn=None,
                 min_count: int = 1):
        self.source = source
        # pipeline stages: the step's micro-batches planned together, ``step_plan_fn(mbs, step)
        # -> (run order, plans, step plan)`` (planner/stages.py), instead of plan_fn one by one
        self.step_plan_fn = step_plan_fn
        self.last_step_plan = None
        self.counts = counts  # step -> (this group's micro-batches, the most any group runs)
        self.min_count = min_count  # fewer micro-batches in a step is an error (the interleaved schedule's P)
        self.plan_fn = plan_fn
        self._nmb = num_microbatches
        self.group_index, self.num_groups = group_index, num_groups
        self.step = start_step
        self.check = check
        self.group = group
        self._buffer = collections.deque()
        self.current: list = []  # the micro-batches of the step being run
        self.last_check_seconds = 0.0
        self._ahead = None  # the next step, read, planned and checked ahead (read_ahead)
        self.critical_seconds = 0.0  # the last step's reading and planning at its start
        self.ahead_seconds = 0.0  # the last read_ahead's (host work overlapping the step before)
        self.plan_seconds = 0.0  # the planning of the current step's micro-batches (plan_fn, step_plan_fn)
    def num_microbatches(self) -> int:
        """This group's micro-batches at the next step (packed steps differ per group)."""
        if self.counts is not None:
            return int(self.counts(self.step)[0])
        return int(self._nmb() if callable(self._nmb) else self._nmb)

    def _check_width(self, n: int) -> int:
        """Micro-batch slots of the plan check: the same on every rank (the most any group runs)."""
        return int(self.counts(self.step)[1]) if self.counts is not None else n

    def __iter__(self):
        return self

    def prefetch(self) -> list:
        """Read, plan and verify the next step's micro-batches (no-op if already done): the
        ones :meth:`read_ahead` prepared while the previous step ran, else now."""
        if self._buffer:
            return self.current
        t0 = time.perf_counter()
        items, step_plan, self.plan_seconds = self._ahead if self._ahead is not None else self._read()
        self._ahead = None
        self.last_step_plan = step_plan
        self.current = items
        self._buffer.extend(items)
        self.critical_seconds = time.perf_counter() - t0
        return items

    def read_ahead(self) -> None:
        """Read, plan and verify the step after the one running (the trainer calls it once the
        running step's kernels are queued, so that on a GPU this host work overlaps them)."""
        if self._ahead is None and not self._buffer:
            t0 = time.perf_counter()
            self._ahead = self._read()
            self.ahead_seconds = time.perf_counter() - t0

    def _read(self) -> tuple:
        """The next step's ``(micro-batches, step plan, planning seconds)``, read, planned and
        verified; each micro-batch keeps its planner's choice (``mb.choice``: what was predicted
        for it)."""
        step_plan, planning = None, 0.0
        n = self.num_microbatches()
        items, error, mistake = [], None, None
        try:
            if n < self.min_count:
                raise UserError(f"step {self.step} has {n} packed micro-batches on replica {self.group_index}: the "
                                f"interleaved schedule needs at least --pipeline-model-parallel-size {self.min_count} "
                                "(raise --global-batch-size or lower --paradyse-pack-tokens)")
            for i in range(n):
                mb = next(self.source)
                if self.plan_fn is not None:
                    t_plan = time.perf_counter()
                    plan = self.plan_fn(mb, self.step, i)
                    planning += time.perf_counter() - t_plan
                    if plan is not None:
                        plan = tuple(plan)
                        validate_names(plan)
                    mb.plan = plan
                    mb.choice = getattr(self.plan_fn, "choices", {}).get(i)
                items.append(mb)
            if self.step_plan_fn is not None:
                t_plan = time.perf_counter()
                items, step_plan = self._plan_step(items)
                planning += time.perf_counter() - t_plan
        except StopIteration:
            error = f"the data iterator ran out after {len(items)} of {n} micro-batches"
        except UserError as e:  # a budget nothing fits: the one line, after the ranks agree
            error, mistake = f"{type(e).__name__}: {e}", e
        except Exception:  # noqa: BLE001 - reported to every rank by verify_plans
            error = traceback.format_exc()
        t0 = time.perf_counter()
        try:
            if self.check:
                verify_plans(self.step, [_entry(mb) for mb in items], self._check_width(n),
                             self.group_index, self.num_groups, error, self.group)
            else:
                # check=False skips comparing the plans, not agreeing on errors: a rank that failed
                # to read or plan alone must not leave its peers in the step's first collective.
                # Three integers in one all-reduce: the step header and the error flag.
                verify_plans(self.step, [], 0, 0, 1, error, self.group)
        except PlanMismatchError:
            if mistake is not None:
                raise mistake from None
            raise
        self.last_check_seconds = time.perf_counter() - t0
        self.step += 1
        return items, step_plan, planning

    def _plan_step(self, items: list) -> tuple:
        """The step's micro-batches in the step planner's run order, each with its plan, and
        the step plan."""
        order, plans, step_plan = self.step_plan_fn(items, self.step)
        for i in order:
            items[i].plan = tuple(plans[i])
            validate_names(items[i].plan)
        return [items[i] for i in order], step_plan

    def __next__(self):
        if not self._buffer:
            self.prefetch()
        return self._buffer.popleft()


def _entry(mb) -> tuple:
    """What every rank of a switching group must agree on for a micro-batch: its plan and shape,
    and a pack's document boundaries."""
    cu = getattr(mb, "cu_seqlens", None)
    return (mb.plan, mb.shape) if cu is None else (mb.plan, mb.shape, tuple(cu))
