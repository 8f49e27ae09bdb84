"""The :class:`~megatron_paradyse.training.iterator.PlannedIterator` behind Megatron-LM's
forward step: one for training and one for evaluation, reading through Megatron-LM's
TP-rank-0 broadcast, planned by ``--paradyse-plan`` or the planner, logged on rank 0."""
from __future__ import annotations

import logging

import torch

from ...units import MiB
from ...parallel.plans import describe_plans, parse_plan, rule_plan_fn
from ..dims import dims_of
from ..iterator import PlannedIterator
from ...planner import MicroBatchView
from ...planner import make_plan_fn
from ..planning import dynamic_cp_planners, planner_from_args
from .args import pad_multiple
from .batches import tp_batches
from .dynamic_cp import dynamic_cp_source

_MEGATRON_ITERATORS: dict = {}
_MEGATRON_PLANNER: dict = {}
_EVAL_MICROBATCHES = [1]  # micro-batches an evaluation step reads (pipeline stages: the schedule's)

log = logging.getLogger(__name__)


def planned_iterator(data_iterator, model):
    """The :class:`PlannedIterator` for training, or the one for evaluation.

    Keyed by train/eval only, not by the data iterator: on TP ranks other than 0 Megatron-LM's
    data iterators are ``None`` (the batch comes by broadcast), so their identity cannot tell
    the validation and test sets apart there, while it does on TP rank 0. Every rank calls the
    forward step equally often, so the step counters agree; the micro-batches are read from
    the iterator of the current call.
    """
    from megatron.core import parallel_state
    from megatron.training import get_args

    args = get_args()
    key = bool(model.training)
    cached = _MEGATRON_ITERATORS.get(key)
    if cached is not None:
        holder, it = cached
        holder[0] = data_iterator
        return it
    multiple = pad_multiple(args)  # TP, or 2 x CP x TP: this CP rank's chunks split over TP
    holder = [data_iterator]
    if model.training:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        nmb = get_num_microbatches
    else:
        # evaluation: plan and check each micro-batch on its own, or with pipeline stages the
        # schedule call's micro-batches together, read ahead (prefetch_step)
        nmb = lambda: _EVAL_MICROBATCHES[0]  # noqa: E731
    plan_fn, step_plan_fn = _plan_fns(args)
    source, counts = tp_batches(holder, args, multiple), None
    if model.training and args.paradyse and dims_of(args).dynamic_cp:  # the step's rounds (dynamic_cp.py)
        source, plan_fn = dynamic_cp_source(holder, args, megatron_dynamic_cp_planners(args))
        counts = source.counts
    it = _LoggedPlannedIterator(source, plan_fn, nmb,
                                group_index=parallel_state.get_data_parallel_rank(),
                                num_groups=parallel_state.get_data_parallel_world_size(),
                                start_step=int(getattr(args, "iteration", 0) or 0),
                                step_plan_fn=step_plan_fn, counts=counts)
    it.log_steps = model.training and torch.distributed.get_rank() == 0
    it.ahead_only = _pipelined(args)
    _MEGATRON_ITERATORS[key] = (holder, it)
    return it


def prefetch_step(data_iterator, model, num_microbatches: int) -> list:
    """Read, plan and check one schedule call's ``num_microbatches`` micro-batches before the
    schedule runs (pipeline stages: every stage, before the first transfer; ``schedule.py``);
    its forward steps then take them in order."""
    if not model.training:
        _EVAL_MICROBATCHES[0] = int(num_microbatches)
    it = planned_iterator(data_iterator, model)
    items = it.prefetch()
    if len(items) != num_microbatches:
        raise RuntimeError(f"ParaDySe: the schedule runs {num_microbatches} micro-batches, the planned "
                           f"iterator read {len(items)} ahead")
    return items


def _plan_fns(args) -> tuple:
    """``(plan_fn, step_plan_fn)``: each micro-batch's plan from ``--paradyse-plan``, or the
    planner's, or none (stock layers); with pipeline stages the planner plans a step's
    micro-batches together (``step_plan_fn``, as in pretrain_gpt_paradyse.py)."""
    if args.paradyse and args.paradyse_plan is not None:
        return rule_plan_fn(parse_plan(args.paradyse_plan, args.num_layers)), None
    if not args.paradyse:
        return None, None
    fn = _megatron_planner(args)
    return (None, fn) if _pipelined(args) else (fn, None)


def _pipelined(args) -> bool:
    return dims_of(args).pp_on


def _megatron_planner(args):
    """The planner's ``plan_fn`` (pipeline stages: its ``step_plan_fn``), built once: training
    and evaluation share it and its cache. Under Dynamic CP the planner at c = 1 of the Dynamic
    CP planners (``planning.dynamic_cp_planners``, kept too): evaluation's, one node a micro-batch."""
    if "planner" not in _MEGATRON_PLANNER and dims_of(args).dynamic_cp:
        planners = _MEGATRON_PLANNER["dynamic_cp"] = dynamic_cp_planners(args)
        _MEGATRON_PLANNER["planner"] = (planners[1], make_plan_fn(planners[1], args.paradyse_on_no_fit,
                                                                  multiple=dims_of(args).seq_divisor))
    if "planner" not in _MEGATRON_PLANNER:
        planner, fn = planner_from_args(args, can_refine=False)
        if _pipelined(args):  # the data side asks it per micro-batch (the longest trainable length)
            planner = MicroBatchView(planner)
        _MEGATRON_PLANNER["planner"] = (planner, fn)
    return _MEGATRON_PLANNER["planner"][1]


def megatron_dynamic_cp_planners(args):
    """The Dynamic CP planner's ``{c: planner}`` (built once), or None with ``--paradyse-plan``."""
    if args.paradyse_plan is not None:
        return None
    _megatron_planner(args)
    return _MEGATRON_PLANNER["dynamic_cp"]


def megatron_planner(args):
    """The planner itself (built once, with its ``plan_fn``; pipeline stages: its
    :class:`MicroBatchView`)."""
    _megatron_planner(args)
    return _MEGATRON_PLANNER["planner"][0]


class _LoggedPlannedIterator(PlannedIterator):
    """Logs each training step's micro-batch lengths and plans on global rank 0, one line per
    step, next to Megatron-LM's own iteration lines (rank 0's micro-batches, in run order); with
    the planner, also the step's predicted time (sum over micro-batches, plus the update once)
    and peak (largest; pipeline stages: the step plan's time and each stage's peak)."""

    log_steps = False
    ahead_only = False  # pipeline stages: a step's micro-batches are read before its schedule runs

    def __next__(self):
        if self.ahead_only and not self._buffer:
            # reading here, inside the schedule, would leave the other stages waiting in a transfer
            raise RuntimeError("ParaDySe with pipeline stages: a forward step ran with no micro-batch read "
                               "ahead; the schedule was not called through the plugin's wrapper of "
                               "get_forward_backward_func (megatron_lm/schedule.py)")
        return super().__next__()

    def prefetch(self):
        fresh = not self._buffer
        items = super().prefetch()
        if fresh and self.log_steps:
            lens = ",".join(str(mb.seq_length) for mb in items)
            log.info(f" [paradyse] iteration {self.step:8d} | seq len: {lens} | plan: "
                     f"{describe_plans([mb.plan for mb in items])}{_cp_sizes(items)}{self._prediction(items)}")
        return items

    def _prediction(self, items) -> str:
        """The planner's prediction for the step just read: its time and peak (pipeline stages:
        each stage's peak), or nothing with a fixed plan."""
        sp = self.last_step_plan if self.step_plan_fn is not None else None
        if sp is not None:
            peaks = "/".join(f"{p / MiB:.1f}" for p in sp.stage_peaks)
            return f" | pred: {sp.seconds:.3f} s, stage peaks {peaks} MiB"
        got = [mb.choice for mb in items if getattr(mb, "choice", None) is not None]
        if not got:
            return ""
        update = self.plan_fn.planner.update_seconds()  # once per step
        return (f" | pred: {sum(c.seconds for c in got) + update:.3f} s, peak "
                f"{max(c.peak_bytes for c in got) / MiB:.1f} MiB")


def _cp_sizes(items) -> str:
    """Under Dynamic CP: the CP size each micro-batch ran at (``| cp: 2,1,1``), else nothing."""
    blocks = [getattr(mb, "cp_block", None) for mb in items]
    if all(b is None for b in blocks):
        return ""
    return " | cp: " + ",".join(str(b[1] if b else 1) for b in blocks)
