"""Planners: each micro-batch's per-layer plan from a cost model, the fastest that fits the budget.

    from megatron_paradyse.planner import build_planner
    planner = build_planner("optimal", cost_model, memory_budget_bytes=70 * 2**30)
    choice = planner.plan(seq_len=32768, micro_batch=1)
    choice.layers, choice.seconds, choice.peak_bytes, choice.fits, choice.reason
    planner.plan(PackShape((72, 900, 31)), 1)   # a pack: planned on its documents (b = 1)

Depends only on :mod:`megatron_paradyse.costmodel` (the ``CostModel`` interface, the pipeline
stage model and the 1F1B schedule), :mod:`megatron_paradyse.units` and
:mod:`megatron_paradyse.parallel`. See ``README.md`` here and ``docs/planner.md``. This file
only re-exports: ``build.py`` (``build_planner``), ``hooks.py`` (the trainers' hooks),
``stages.py`` (pipeline stages: :class:`PipelinePlanner`), ``views.py`` (``MicroBatchView``),
``dynamic_cp.py`` (Dynamic CP planning: :func:`plan_dynamic_cp`).
"""
from __future__ import annotations

from ..costmodel.schedule import simulate_1f1b
from ..costmodel.stage import stage_cost_model
from .build import KINDS, build_planner
from .core import RECOMPUTE, NoFitError, PlanChoice, Planner, default_margin_fraction, pareto
from .dynamic_cp import Assignment, DCPSchedule, cp_planners, megatron_dcp, plan_dynamic_cp
from .heuristic import HeuristicPlanner
from .hooks import ON_NO_FIT, make_plan_fn, make_step_plan_fn
from .optimal import OptimalPlanner, solve_counts
from .refine import Refinement
from .stages import PipelinePlanner, StepPlan
from .views import MicroBatchView

__all__ = ["build_planner", "Planner", "PlanChoice", "NoFitError", "HeuristicPlanner", "OptimalPlanner",
           "Refinement", "KINDS", "ON_NO_FIT", "make_plan_fn", "default_margin_fraction", "pareto",
           "solve_counts", "RECOMPUTE", "PipelinePlanner", "StepPlan", "make_step_plan_fn", "simulate_1f1b",
           "stage_cost_model", "MicroBatchView", "Assignment", "DCPSchedule", "plan_dynamic_cp", "megatron_dcp",
           "cp_planners"]
