"""Validation as Megatron-LM runs it, in ``pretrain_gpt_paradyse.py``'s trainer.

* The validation and test splits of ``--split`` (megatron-core's document split of
  ``--data-path`` or of the mock corpus, :func:`megatron_paradyse.data.build_dataset`), read in
  the training's micro-batch shapes: Megatron's sample order, or with ``--paradyse-pack`` packs
  of the same scheduler settings; each split's iterator persists over the run (Megatron-LM's
  ``consumed_valid_samples``; on resume it starts after the evaluations already run).
* :meth:`Evaluation.evaluate`: ``--eval-iters`` global batches forward-only with megatron-core's
  schedule (``forward_only=True``) under ``torch.no_grad()``, the model in ``eval()`` mode;
  the loss summed over the tokens of every micro-batch and replica (Megatron-LM's
  ``evaluate``), reduced as the training loss (the last pipeline stage's, CP, DP).
* Under ``--paradyse`` each micro-batch runs the plan of the training's plan source: a fixed
  plan, a ``plan_fn``, or the planner. The planner prices a micro-batch's forward and
  backward; a forward-only pass keeps no activations for a backward, so the training peak it
  plans within the budget bounds the forward-only peak: no validation step exceeds the budget.
  With a planner the pass runs under the peak-memory tracker and its measured peak (bytes live
  before it included, as the training steps') is logged beside the budget.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from functools import partial

import torch

from .. import data as pdata
from ..memory import PeakMemory, static_bytes
from ..parallel.buffers import release_pool
from ..units import MiB
from . import p2p_shapes
from .forward_step import forward_step
from .iterator import PlannedIterator
from .run_report import max_over_ranks, pool_bytes

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EvalResult:
    """One evaluation: where (Megatron-LM's prefix), the loss, its PPL, the measured peak
    (bytes, max over ranks; None when not measured), the budget (None: no planner) and its
    wall time."""

    prefix: str
    iteration: int
    split: str
    loss: float
    ppl: float
    peak_bytes: float | None = None
    budget_bytes: float | None = None
    seconds: float = 0.0


def format_eval_lines(result: EvalResult) -> list:
    """Megatron-LM's ``evaluate_and_print_results`` lines: the loss and PPL framed by dashes."""
    text = (f" validation loss at {result.prefix} | lm loss value: {result.loss:.6E} | "
            f"lm loss PPL: {result.ppl:.6E} | ")
    dashes = "-" * (len(text) + 1)
    return [dashes, text, dashes]


class Evaluation:
    """The validation and test iterators of a :class:`~megatron_paradyse.training.trainer.Trainer`
    and its forward-only passes over them. ``plan_fn`` / ``step_plan_fn``: the training's
    plan sources (None: stock code)."""

    def __init__(self, trainer, plan_fn, max_length=None):
        self.trainer = trainer
        args = trainer.args
        self.eval_iters, self.eval_interval = args.eval_iters, args.eval_interval
        self.plan_fn = plan_fn
        self.results: list = []
        done = (trainer.iteration // self.eval_interval) * self.eval_iters if self.eval_interval else 0
        self.iterators = {}
        for index, name in ((1, "validation"), (2, "test")):
            ds = None if self.eval_iters == 0 else pdata.build_dataset(trainer.data, max_length=max_length, split=index)
            self.iterators[name] = None if ds is None else self._iterator(ds, done if index == 1 else 0)

    def _iterator(self, dataset, start_step: int) -> PlannedIterator:
        """A split's planned iterator in the training's micro-batch shapes."""
        t, args = self.trainer, self.trainer.args
        if t.data.packed:
            cost_fn = fits_fn = None
            if t.planner is not None:
                cost_fn, fits_fn = pdata.make_pack_fns(t.planner)
            packer = pdata.PackScheduler(
                dataset.length, args.global_batch_size, t.dp_size, token_cap=t.data.pack_tokens,
                seed=t.data.seed, mode=t.data.pack, cost_fn=cost_fn, fits_fn=fits_fn)
            loader = pdata.PackedLoader(dataset, packer, t.dp_rank, multiple=t.data.pad_multiple,
                                        start_step=start_step)
            counts = loader.counts
        else:
            loader = pdata.MicroBatchLoader(
                dataset, args.micro_batch_size, args.global_batch_size, t.dp_rank, t.dp_size,
                t.data.pad_multiple, consumed_samples=start_step * args.global_batch_size)
            counts = None
        return PlannedIterator(loader, self.plan_fn, args.num_microbatches, group_index=t.dp_rank,
                               num_groups=t.dp_size, start_step=start_step, counts=counts,
                               step_plan_fn=t._step_plan_fn)

    def due(self, iteration: int) -> bool:
        """Megatron-LM's check after a training step: every ``--eval-interval`` iterations."""
        return (self.iterators["validation"] is not None and bool(self.eval_interval)
                and iteration % self.eval_interval == 0)

    def run(self, prefix: str, split: str = "validation") -> EvalResult | None:
        """Evaluate ``split`` (None where it has no data or ``--eval-iters`` is 0), log
        Megatron-LM's lines and keep the result."""
        it = self.iterators.get(split)
        if it is None:
            return None
        t, t0 = self.trainer, time.perf_counter()
        loss, peak = self.evaluate(it)
        budget = None if t.planner is None else t.planner.budget
        res = EvalResult(prefix=prefix, iteration=t.iteration, split=split, loss=loss,
                         ppl=math.exp(min(20.0, loss)), peak_bytes=peak, budget_bytes=budget,
                         seconds=time.perf_counter() - t0)
        self.results.append(res)
        for line in format_eval_lines(res):
            log.info(line)
        if peak is not None:
            log.info(f"  {split} forward-only peak: {peak / MiB:.1f} MiB (planned as training steps "
                     f"within the budget of {budget / MiB:.1f} MiB)")
        return res

    def evaluate(self, iterator) -> tuple:
        """``--eval-iters`` global batches forward-only: ``(loss per token, measured peak)``."""
        t = self.trainer
        measure = t.planner is not None
        static = static_bytes(t.whole_model, t.optimizer) if measure else 0
        total, peak = torch.zeros(3, dtype=torch.float64), 0.0
        for chunk in t.chunks:
            chunk.eval()
        try:
            with t._params_gathered(), torch.no_grad():
                for _ in range(self.eval_iters):
                    held = pool_bytes() if measure else 0
                    with PeakMemory() if measure else contextlib.nullcontext() as m:
                        reports, micro = self._forward_only(iterator)
                    if measure:
                        peak = max(peak, m.peak_bytes + held + static)
                    total += t._reduce_losses(reports, micro)
        finally:
            for chunk in t.chunks:
                chunk.train()
        loss = float(total[0] / max(total[1], 1))
        return loss, (max_over_ranks(peak) if measure else None)

    def _forward_only(self, iterator) -> tuple:
        """One global batch forward-only with megatron-core's schedule."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        t, args = self.trainer, self.trainer.args
        micro = iterator.prefetch()
        reports = get_forward_backward_func()(
            forward_step_func=partial(forward_step, paradyse=args.paradyse, cp=t.dims.cp),
            **t.schedule_inputs(iterator, micro, forward_only=True), num_microbatches=len(micro),
            seq_length=max(mb.seq_length for mb in micro), micro_batch_size=args.micro_batch_size,
            forward_only=True)
        if args.paradyse:
            release_pool()
            p2p_shapes.clear()
        return reports, micro
