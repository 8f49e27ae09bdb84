"""The :class:`~megatron_paradyse.training.iterator.PlannedIterator` behind Megatron-LM's
forward step: one for training and one for evaluation, reading through Megatron-LM's
TP-rank-0 broadcast, planned by ``--paradyse-plan`` or the planner, logged on rank 0."""
from __future__ import annotations

import logging

import torch

from ...units import MiB
from ...parallel.plans import describe_plans, parse_plan, rule_plan_fn
from ..iterator import PlannedIterator
from ..planning import planner_from_args
from .batches import tp_batches

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
    multiple = args.paradyse_pad_multiple or args.tensor_model_parallel_size
    holder = [data_iterator]
    if model.training:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        nmb = get_num_microbatches
    else:
        # evaluation: plan and check each micro-batch on its own, or with pipeline stages the
        # schedule call's micro-batches together, read ahead (prefetch_step)
        nmb = lambda: _EVAL_MICROBATCHES[0]  # noqa: E731
    it = _LoggedPlannedIterator(tp_batches(holder, args, multiple), _plan_fn(args), nmb,
                                group_index=parallel_state.get_data_parallel_rank(),
                                num_groups=parallel_state.get_data_parallel_world_size(),
                                start_step=int(getattr(args, "iteration", 0) or 0))
    it.log_steps = model.training and torch.distributed.get_rank() == 0
    it.ahead_only = int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1
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


def _plan_fn(args):
    """Each micro-batch's plan: ``--paradyse-plan``'s, the planner's, or None (stock layers)."""
    if args.paradyse and args.paradyse_plan is not None:
        return rule_plan_fn(parse_plan(args.paradyse_plan, args.num_layers))
    if args.paradyse:
        return _megatron_planner(args)
    return None


def _megatron_planner(args):
    """The planner's ``plan_fn`` (built once: training and evaluation share it and its cache)."""
    if "planner" not in _MEGATRON_PLANNER:
        _MEGATRON_PLANNER["planner"] = planner_from_args(args, can_refine=False)
    return _MEGATRON_PLANNER["planner"][1]


def megatron_planner(args):
    """The planner itself (built once, with its ``plan_fn``)."""
    _megatron_planner(args)
    return _MEGATRON_PLANNER["planner"][0]


class _LoggedPlannedIterator(PlannedIterator):
    """Logs each training step's micro-batch lengths and plans on global rank 0, one line per
    step, next to Megatron-LM's own iteration lines (rank 0's micro-batches); with the planner,
    also the step's predicted time (sum over micro-batches, plus the update once) and peak
    (largest)."""

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
            line = (f" [paradyse] iteration {self.step:8d} | seq len: {lens} | plan: "
                    f"{describe_plans([mb.plan for mb in items])}")
            choices = getattr(self.plan_fn, "choices", None)
            if choices:
                got = [choices.get(i) for i in range(len(items))]
                got = [c for c in got if c is not None]
                if got:
                    update = self.plan_fn.planner.update_seconds()  # once per step
                    line += (f" | pred: {sum(c.seconds for c in got) + update:.3f} s, peak "
                             f"{max(c.peak_bytes for c in got) / MiB:.1f} MiB")
            log.info(line)
        return items
