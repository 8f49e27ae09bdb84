"""The trainers' hooks: each micro-batch's plan (``make_plan_fn``), a pipelined step's plans
(``make_step_plan_fn``), and the no-fit policies both apply (``ON_NO_FIT``: error, skip,
truncate), identically on every rank, before any collective of the step."""
from __future__ import annotations

import logging
import math

from ..parallel.packing import PackShape
from .core import NoFitError, Planner, last_true
from .stages import PipelinePlanner, StepPlan

ON_NO_FIT = ("error", "skip", "truncate")

log = logging.getLogger(__package__)  # the warnings are the planner's (megatron_paradyse.planner)


def make_plan_fn(planner: Planner, on_no_fit: str = "error", multiple: int = 1):
    """The trainer's ``plan_fn(mb, step, index)``: the planner's plan for the micro-batch.

    When nothing fits, ``on_no_fit`` decides, identically on every rank (the planner and its
    all-reduced refinement are the same everywhere, and so is the micro-batch within a
    switching group), before any collective of the step:

    * ``error``: raise :class:`NoFitError` with the numbers (the iterator's plan check reports
      it on every rank together);
    * ``truncate``: cut the micro-batch to the longest length that fits (a multiple of
      ``multiple``), with a warning;
    * ``skip``: cut it to ``multiple`` tokens with an all-zero loss mask (it contributes
      nothing to loss or gradients, and the step keeps its micro-batch count), with a warning.

    Rank 0 logs the warnings (this module's logger; its switching group decides the same).

    A packed micro-batch (its ``plan_length`` a ``PackShape``: several documents in one row)
    is planned on its documents; when nothing fits it, :class:`NoFitError` whatever the policy
    (the packing scheduler asks the planner which packs fit before it forms them).

    The returned function records the last choices in ``plan_fn.choices`` (index -> PlanChoice).
    """
    if on_no_fit not in ON_NO_FIT:
        raise ValueError(f"on_no_fit must be one of {ON_NO_FIT}, got {on_no_fit!r}")
    from megatron.core.utils import log_single_rank

    mult = max(1, int(multiple))

    def plan_fn(mb, step, index):
        b, s = int(mb.tokens.shape[0]), int(mb.tokens.shape[1])
        packed = isinstance(getattr(mb, "plan_length", None), PackShape)
        choice = planner.plan(mb.plan_length if packed else s, b)
        if not choice.fits:
            what = (f"step {step} micro-batch {index} (documents of lengths "
                    f"{', '.join(str(int(x)) for x in mb.lengths)})")
            if on_no_fit == "error" or packed:  # a pack is not cut: its scheduler packs what fits
                raise NoFitError(f"{what}: {choice.reason} (--paradyse-on-no-fit "
                                 f"{on_no_fit}{'; a pack is never truncated or skipped' if packed else ''})")
            keep = planner.longest_fit(b, multiple=mult, upper=s) if on_no_fit == "truncate" else 0
            if on_no_fit == "truncate" and keep == 0:
                raise NoFitError(f"{what}: {choice.reason}; nothing to truncate to (--paradyse-on-no-fit truncate)")
            new_s = keep if on_no_fit == "truncate" else mult
            _cut(mb, new_s, zero_loss=(on_no_fit == "skip"))
            log_single_rank(log, logging.WARNING, f"WARNING: {what}: {choice.reason}; "
                            + (f"truncated to {new_s} tokens" if on_no_fit == "truncate"
                               else "skipped (no loss, no gradient)"))
            choice = planner.plan(new_s, b)
            if not choice.fits:  # cannot happen for truncate (longest_fit); for skip the minimum
                raise NoFitError(f"{what}: even {new_s} tokens do not fit: {choice.reason}")
        plan_fn.choices[index] = choice
        return choice.layers

    plan_fn.choices = {}
    plan_fn.planner = planner
    return plan_fn


def _cut(mb, s: int, zero_loss: bool) -> None:
    mb.tokens = mb.tokens[:, :s].contiguous()
    mb.labels = mb.labels[:, :s].contiguous()
    mb.loss_mask = mb.loss_mask[:, :s].contiguous()
    if zero_loss:
        mb.loss_mask = mb.loss_mask * 0
    mb.position_ids = mb.position_ids[:, :s].contiguous()
    mb.lengths = tuple(min(int(x), s) for x in mb.lengths) if not zero_loss else tuple(0 for _ in mb.lengths)


def _mb_shape(mb) -> tuple:
    """``(s, b)`` of a micro-batch: its pack (``plan_length``) or its tokens' length."""
    b, s = int(mb.tokens.shape[0]), int(mb.tokens.shape[1])
    pack = getattr(mb, "plan_length", None)
    return (pack, b) if isinstance(pack, PackShape) else (s, b)


def make_step_plan_fn(pipeline_planner: PipelinePlanner, on_no_fit: str = "error", multiple: int = 1):
    """The trainer's ``fn(mbs, step) -> (order, plans, step_plan)`` for one step's micro-batches
    (each with ``.tokens`` [b, s], optionally ``.plan_length`` a ``PackShape``, ``.lengths``).

    When nothing fits, ``on_no_fit``: ``error`` raises :class:`NoFitError` with the message;
    ``truncate`` cuts the longest micro-batch in flight at the failing point to the longest
    length (a multiple of ``multiple`` and p) at which the step fits, or to that multiple when
    none does, and plans again; ``skip`` cuts it to that multiple with an all-zero loss mask;
    each with a warning (rank 0), repeated until the step fits; a pack is never cut
    (``NoFitError`` when only packs are left to cut). The last StepPlan is ``fn.last``.
    """
    if on_no_fit not in ON_NO_FIT:
        raise ValueError(f"on_no_fit must be one of {ON_NO_FIT}, got {on_no_fit!r}")
    mult = max(1, int(multiple))
    mult = mult * pipeline_planner.multiple // math.gcd(mult, pipeline_planner.multiple)

    def fn(mbs, step):
        shapes = [_mb_shape(mb) for mb in mbs]
        sp = pipeline_planner.plan_step(shapes)
        if not sp.fits and on_no_fit != "error":
            sp = _cut_until_fits(pipeline_planner, mbs, shapes, sp, step, on_no_fit, mult)
        if not sp.fits:
            raise NoFitError(f"step {step}: {sp.message} (--paradyse-on-no-fit {on_no_fit})")
        fn.last = sp
        return sp.order, sp.plans, sp

    fn.last = None
    fn.planner = pipeline_planner
    return fn


def _cut_until_fits(planner: PipelinePlanner, mbs, shapes, sp: StepPlan, step, policy: str, mult: int) -> StepPlan:
    """``truncate`` / ``skip`` (:func:`make_step_plan_fn`): cut offenders until the step fits;
    the failing StepPlan back when only packs (or micro-batches of ``mult`` tokens) are left."""
    from megatron.core.utils import log_single_rank

    while not sp.fits:
        cut = [j for j in sp.offenders if not isinstance(shapes[j][0], PackShape) and shapes[j][0] > mult]
        if not cut:
            return sp._replace(message=sp.message + "; nothing left to cut (a pack is never truncated or skipped)")
        j = max(cut, key=lambda k: (shapes[k][0], -k))
        s, b = shapes[j]
        new = mult
        if policy == "truncate":
            def fits(k, j=j, b=b):
                return planner.plan_step(shapes[:j] + [(k * mult, b)] + shapes[j + 1:]).fits
            new = max(mult, last_true(fits, (s - 1) // mult) * mult)
        what = (f"step {step} micro-batch {j} (documents of lengths "
                f"{', '.join(str(int(x)) for x in mbs[j].lengths)})")
        _cut(mbs[j], new, zero_loss=(policy == "skip"))
        log_single_rank(log, logging.WARNING, f"WARNING: {what}: {sp.message}; "
                        + (f"truncated to {new} tokens" if policy == "truncate" else "skipped (no loss, no gradient)"))
        shapes[j] = (new, b)
        sp = planner.plan_step(shapes)
    return sp
