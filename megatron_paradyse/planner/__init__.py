"""Planners: each micro-batch's per-layer plan from a cost model, the fastest that fits the budget.

    from megatron_paradyse.planner import build_planner
    planner = build_planner("optimal", cost_model, memory_budget_bytes=70 * 2**30)
    choice = planner.plan(seq_len=32768, micro_batch=1)
    choice.layers, choice.seconds, choice.peak_bytes, choice.fits, choice.reason
    planner.plan(PackShape((72, 900, 31)), 1)   # a pack: planned on its documents (b = 1)

Depends only on :mod:`megatron_paradyse.costmodel.base` (the ``CostModel`` interface; and
``costmodel.analytic.param_counts`` for a pipeline stage's share of the parameters),
:mod:`megatron_paradyse.units` and :mod:`megatron_paradyse.parallel.plans`. See ``README.md`` here and ``docs/planner.md``.
Pipeline stages (a step's micro-batches planned together): :class:`PipelinePlanner` (``pipeline.py``).
"""
from __future__ import annotations

import logging

from ..parallel.packing import PackShape
from .core import RECOMPUTE, NoFitError, PlanChoice, Planner, default_margin_fraction, pareto
from .heuristic import HeuristicPlanner
from .optimal import OptimalPlanner, solve_counts
from .pipeline import PipelinePlanner, StepPlan, make_step_plan_fn, simulate_1f1b, stage_cost_model
from .refine import Refinement

KINDS = {"heuristic": HeuristicPlanner, "optimal": OptimalPlanner}
ON_NO_FIT = ("error", "skip", "truncate")

log = logging.getLogger(__name__)

__all__ = ["build_planner", "Planner", "PlanChoice", "NoFitError", "HeuristicPlanner", "OptimalPlanner",
           "Refinement", "KINDS", "ON_NO_FIT", "make_plan_fn", "default_margin_fraction", "pareto",
           "solve_counts", "RECOMPUTE", "PipelinePlanner", "StepPlan", "make_step_plan_fn", "simulate_1f1b",
           "stage_cost_model"]


def build_planner(kind: str, cost_model, memory_budget_bytes: float, gamma: float | None = None,
                  margin_bytes: float | None = None, strategies=None, refinement=None,
                  device_kind: str | None = None, recompute: str = "auto", recompute_chunk: int = 1,
                  **kwargs) -> Planner:
    """A planner of ``kind`` (``heuristic`` | ``optimal``) for ``cost_model`` under the budget.

    ``gamma``: the hysteresis (keep the previous plan while it fits and is at most gamma
    slower); default 0.05 for ``heuristic`` (the paper's) and 0 for ``optimal`` (switching
    costs nothing here: ``set_plan`` only sets attributes, so the exact planner need not
    trade time for stability; give a gamma to damp switching on noisy, refined predictions).
    ``margin_bytes``: default 10% of the budget on GPU, 5% on CPU, by ``device_kind`` ("cuda" or
    "cpu": the device the plans are for; default the cost model's). ``strategies``: restrict
    to these (default: all the cost model predicts). ``refinement``: a :class:`Refinement`
    (``True`` builds one) whose all-reduced factors correct the predictions (a recomputed
    layer uses its strategy's). ``recompute``: the candidates per layer: ``auto`` (default)
    every strategy and, when the cost model prices them (``CostModel.recomputes()``; otherwise
    plain strategies, with one warning), each one recomputed in backward (plan entry
    ``tp_sp:rc``); ``off`` plain strategies only; ``only`` recomputed ones only (megatron's
    ``--recompute-granularity full --recompute-method uniform``; ValueError if the cost model
    cannot price them). ``recompute_chunk``: megatron's ``--recompute-num-layers`` under the
    uniform method, layers recomputed as one chunk: each ``:rc`` transient also holds
    ``chunk - 1`` more layers' saved bytes (the largest strategy's). Other keywords go to the
    planner's class (``order`` for ``optimal``).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown planner {kind!r}: one of {sorted(KINDS)}")
    if gamma is None:
        gamma = 0.05 if kind == "heuristic" else 0.0
    if refinement is True:
        refinement = Refinement(tuple(strategies) if strategies is not None else tuple(cost_model.strategies))
    return KINDS[kind](cost_model, memory_budget_bytes, gamma=gamma, margin_bytes=margin_bytes,
                       strategies=strategies, refinement=refinement, device_kind=device_kind,
                       recompute=recompute, recompute_chunk=recompute_chunk, **kwargs)


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
