"""Data-parallel gradient reductions launched in bucket order on every replica, whatever the plans.

With ``--overlap-grad-reduce`` megatron's ``DistributedDataParallel`` launches a bucket group's
reduce-scatter or all-reduce the moment its last gradient of the step's last micro-batch is
ready (``register_grad_ready`` -> ``start_grad_sync``, from the second step on). Which bucket
completes first depends on the plan: ``metp`` returns all of a layer's weight gradients from one
autograd node, the other strategies produce fc2's gradient long before fc1's, and recompute
moves a layer's gradients later. Replicas plan their own micro-batches, so two replicas can
launch the same buckets in different orders on the data-parallel communicator: NCCL then hangs
(different sizes) or sums the wrong buckets (equal sizes).

:func:`order_grad_sync` makes every replica launch in bucket-group order, the order megatron
lists them (the last layers' first): a group whose gradients are ready waits until every group
before it has launched, and a launch takes the ready groups right behind it along. The
reductions, their buffers, scaling and waits stay megatron's own. It also checks megatron's
per-parameter ready counts, recorded at the first step, on every later step: a plan that
produced a gradient more or fewer times than the first step did would launch a bucket early
(a silent wrong sum) or never; that is an error naming the parameters.

:func:`install` applies it to every ``DistributedDataParallel`` built while the plugin is
installed (both trainers build theirs after ``install``).
"""
from __future__ import annotations

import functools

from .. import runtime

_NAME = "grad_order"  # the registry's name of the patch (``runtime.py``)


class GradCountError(RuntimeError):
    """A step produced some parameter's gradient a different number of times than the first step."""


class _Order:
    """The launch order of one list of bucket groups (dense, or expert-parallel)."""

    def __init__(self, groups: list):
        self.groups = groups
        self.start = [g.start_grad_sync for g in groups]  # megatron's, bound
        self.ready = [None] * len(groups)  # None, or the force_all_reduce it was made ready with
        self.next = 0
        for i, g in enumerate(groups):
            g.start_grad_sync = functools.partial(self.make_ready, i)
            g.reset = _after(g.reset, functools.partial(self.reset, i))
            g.register_grad_ready = _checked(g, g.register_grad_ready)
            g.finish_grad_sync = _before(g.finish_grad_sync, functools.partial(self.check_launched, i))

    def make_ready(self, i: int, force_all_reduce: bool | None = False) -> None:
        """Group ``i`` asks to launch: launch it and the ready groups behind it, in order, once
        every group before it has launched."""
        if i < self.next:  # launched already this step (megatron's first-step path asks again)
            return
        self.ready[i] = bool(force_all_reduce)
        while self.next < len(self.groups) and self.ready[self.next] is not None:
            self.start[self.next](force_all_reduce=self.ready[self.next])
            self.next += 1

    def check_launched(self, i: int) -> None:
        """Before megatron waits for group ``i``'s reduction: from the second step on it must
        have launched; if not, some parameter's gradient came fewer times than at the first step."""
        g = self.groups[i]
        if g.is_first_batch or i < self.next:
            return
        golden, got = g.golden_per_param_grad_ready_counts, g.per_param_grad_ready_counts
        diff = {p: got.get(p, 0) for p in golden if got.get(p, 0) != golden[p]}
        if diff:
            raise GradCountError(_count_message(g, diff))

    def reset(self, i: int) -> None:
        self.ready[i] = None
        if i == 0:
            self.next = 0


def _after(fn, then):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        then()
        return out
    return call


def _before(fn, first):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        first()
        return fn(*args, **kwargs)
    return call


def _checked(group, register):
    """``register_grad_ready`` that raises once a parameter's count passes the first step's."""
    @functools.wraps(register)
    def call(param, *args, **kwargs):
        out = register(param, *args, **kwargs)
        golden = group.golden_per_param_grad_ready_counts
        if golden and group.is_last_microbatch:
            got = group.per_param_grad_ready_counts.get(param, 0)
            if got > golden.get(param, 0):
                raise GradCountError(_count_message(group, {param: got}))
        return out
    return call


def _count_message(group, counts: dict) -> str:
    golden = group.golden_per_param_grad_ready_counts
    names = getattr(group, "param_to_name", None) or {}
    parts = [f"{names.get(p, tuple(p.shape))}: {n} (first step: {golden.get(p, 0)})" for p, n in counts.items()]
    return ("ParaDySe: a gradient bucket's parameters produced their gradients a different number "
            "of times in this step's last micro-batch than in the first step's, so megatron's "
            "--overlap-grad-reduce would launch the bucket's reduction before all of them (a wrong "
            "sum) or never: " + "; ".join(parts))


def order_grad_sync(ddp) -> None:
    """Launch ``ddp``'s gradient reductions in bucket-group order (idempotent; nothing to do
    without ``overlap_grad_reduce``, where megatron launches them in order at the step's end)."""
    if getattr(ddp, "_paradyse_grad_order", None) is not None:
        return
    orders = []
    if ddp.ddp_config.overlap_grad_reduce:
        for groups in (ddp.bucket_groups, getattr(ddp, "expert_parallel_bucket_groups", [])):
            if groups:
                orders.append(_Order(list(groups)))
    ddp._paradyse_grad_order = orders


def install() -> None:
    """Order the gradient reductions of every megatron ``DistributedDataParallel`` built from now on."""
    if runtime.is_installed(_NAME):
        return
    from megatron.core.distributed import DistributedDataParallel

    init = DistributedDataParallel.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        order_grad_sync(self)

    runtime.install(_NAME, runtime.Patch(DistributedDataParallel, "__init__", __init__))


def uninstall() -> None:
    """Restore megatron's constructor (models built meanwhile keep their order)."""
    runtime.restore(_NAME)
