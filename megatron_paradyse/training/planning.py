"""The planner built from the parsed ``--paradyse*`` flags, shared by both trainers
(``trainer.py`` and Megatron-LM's ``pretrain()`` through the ``megatron_lm`` package).
"""
from __future__ import annotations

import logging
import os

from ..costmodel import build_cost_model, extrapolation_note
from ..device import current as current_device
from ..device import is_cpu
from ..errors import UserError
from ..planner import MicroBatchView  # noqa: F401  (trainer.py takes the planner's view from here)
from ..planner import PipelinePlanner, build_planner, make_plan_fn, make_step_plan_fn

from ..units import GiB
from .arguments import default_memory_budget_gib
from .dims import dims_of, runtime_options
from .model_args import shape_from_args

log = logging.getLogger(__name__)


def cost_model_from_args(args):
    """``--paradyse-cost-model``, else the model shipped for the run's shape, else the analytic one;
    its pool priced with the run's weight prefetch (the runtime options of ``args``)."""
    return build_cost_model(shape_from_args(args), path=args.paradyse_cost_model,
                            prefetch=runtime_options(args).prefetch)


def calibrated_cost_model(args):
    """``--paradyse-calibrate``: the run's fitted cost model rescaled to this host
    (``costmodel.calibrate``), measured by every rank of the initialised world before the run's
    own parallel state and seeds (so the run trains as it would without it); the same model on
    every rank. Logs the factors (rank 0)."""
    from megatron.core.utils import log_single_rank

    from ..costmodel import calibrate
    from ..costmodel import measure as M

    cm = cost_model_from_args(args)
    if not isinstance(cm, calibrate.FittedCostModel):
        raise UserError("--paradyse-calibrate needs a fitted cost model: give --paradyse-cost-model (none is "
                        "shipped for this model's shape)")
    model_args = {k: getattr(args, k) for k in M.model_flag_names() if hasattr(args, k)}
    budget = args.paradyse_memory_budget  # None: measured once the model exists; every cell then
    out = calibrate.calibrate_in_world(cm, args.seq_length, model_args, None if budget is None else budget * GiB)
    cal = out.meta["calibration"]
    log_single_rank(log, logging.INFO, f"> calibrated the cost model to this host in {cal['seconds']:.1f} s "
                                       f"({cal['passes']} timed passes): {calibrate.summary(out)}")
    return out


def with_context_parallel(args, cm):
    """``cm`` for ``--context-parallel-size C`` > 1: ``costmodel.cp.CPCostModel`` (the in-node
    model at s/C plus the CP ring on ``--paradyse-cp-links``), planning the in-node strategy of
    each layer at the global length; ``cm`` itself without CP."""
    dims = dims_of(args)
    if not dims.cp_on:
        return cm
    from ..costmodel.cp import CPCostModel, Links

    links = args.paradyse_cp_links or ("cpu_gloo,cpu_gloo" if is_cpu() else "nvlink4,ib_ndr")
    return CPCostModel(cm, dims.cp, Links.from_config(*links.split(",")), shape_from_args(args))


def planner_from_args(args, can_refine: bool = True, cost_model=None):
    """``(planner, plan_fn)`` for ``--paradyse`` without ``--paradyse-plan``.

    The cost model is ``--paradyse-cost-model`` or the one shipped for the model's shape (else
    the analytic model); the budget ``--paradyse-memory-budget`` GiB (default: what the device
    can hand out, see ``arguments.default_memory_budget_gib``); the margin by the training
    device (10% on GPU, 5% on CPU) unless ``--paradyse-memory-margin``. ``plan_fn`` is the iterator's
    ``plan_fn(mb, step, index)`` and keeps the last choices in ``plan_fn.choices``.
    ``can_refine=False``: a step loop that feeds no measurements back (Megatron-LM's) gets no
    online refinement, whatever ``--paradyse-refine`` says. ``cost_model``: the model to plan
    with (the trainer's calibrated one), default :func:`cost_model_from_args`'s. Logs the
    planner (every rank: the command line's handler shows rank 0's) and, on rank 0, a cost
    model profiled elsewhere or asked beyond its profiled lengths.
    """
    from megatron.core.utils import log_single_rank

    cm = with_context_parallel(args, cost_model if cost_model is not None else cost_model_from_args(args))
    budget, options, refine = planner_options(args, cm, can_refine)
    dims = dims_of(args)
    multiple = args.paradyse_pad_multiple or dims.seq_divisor
    if dims.pp_on:
        planner = PipelinePlanner(args.paradyse_planner, cm, budget, dims.pp, num_chunks=dims.vpp or 1,
                                  **options)  # block recompute and refinement: per stage
        plan_fn = make_step_plan_fn(planner, args.paradyse_on_no_fit, multiple=multiple)
    else:
        planner = build_planner(args.paradyse_planner, cm, budget, **options)
        plan_fn = make_plan_fn(planner, args.paradyse_on_no_fit, multiple=multiple)  # plans packs too
    log.info(f"> planner: {describe_planner(planner)}; cost model {type(cm).__name__}"
             + (f" ({args.paradyse_cost_model})" if args.paradyse_cost_model else "")
             + f"; on no fit: {args.paradyse_on_no_fit}; refinement {'on' if refine else 'off'}"
             + (" (per stage)" if refine and dims.pp_on else ""))
    for note in (allocator_mismatch(cm), extrapolation_note(cm, args.seq_length)):
        if note:
            log_single_rank(log, logging.WARNING, f"> warning: {note}")
    return planner, plan_fn


def planner_options(args, cm, can_refine: bool = True) -> tuple:
    """``(budget bytes, build_planner options, refinement on)`` from the planner's flags (see
    :func:`planner_from_args`), for the cost model ``cm``."""
    from megatron.core.utils import log_single_rank

    budget = args.paradyse_memory_budget
    if budget is None:
        budget = args.paradyse_memory_budget = default_memory_budget_gib()
    margin = None if args.paradyse_memory_margin is None else args.paradyse_memory_margin * GiB
    refine = can_refine and {"on": True, "off": False}.get(args.paradyse_refine, not is_cpu())
    mode, chunk, first = recompute_plan(args)
    if mode == "only" and not cm.recomputes():
        log_single_rank(log, logging.WARNING, "> warning: megatron recomputes every layer (--recompute-method "
                        "uniform) but the cost model cannot price recomputed layers: the planner plans them as "
                        "not recomputed (its peaks are upper bounds, its times too low)")
        mode, chunk = "off", 1
    options = dict(gamma=args.paradyse_gamma, margin_bytes=margin, strategies=args.paradyse_planner_strategies,
                   refinement=True if refine else None, device_kind=current_device().type,
                   recompute=mode, recompute_chunk=chunk, recompute_first=first)
    return budget * GiB, options, refine


def dynamic_cp_planners(args, cost_model=None) -> dict:
    """``--dynamic-context-parallel`` with the planner: ``{c: planner}`` for every power-of-two
    CP size c of the pool (``planner.dynamic_cp.cp_planners``: the in-node cost model at c = 1,
    ``CPCostModel`` on ``--paradyse-cp-links`` above), each with :func:`planner_options`'
    budget and options, without online refinement (the Dynamic CP step feeds none back). Logs
    the planner."""
    from ..costmodel.cp import Links
    from ..planner.dynamic_cp import cp_planners

    cm = cost_model if cost_model is not None else cost_model_from_args(args)
    budget, options, _ = planner_options(args, cm, can_refine=False)
    dims = dims_of(args)
    links = args.paradyse_cp_links or ("cpu_gloo,cpu_gloo" if is_cpu() else "nvlink4,ib_ndr")
    planners = cp_planners(args.paradyse_planner, cm, budget, dims.dp, Links.from_config(*links.split(",")),
                           shape_from_args(args), **options)
    log.info(f"> planner: Dynamic CP over a pool of {dims.dp} nodes (a CP size and a plan per micro-batch, "
             f"planner/dynamic_cp.py), each size's {planners[1].describe()}; links {links}")
    return planners


def dynamic_cp_schedule_fn(args, planners):
    """The Dynamic CP loader's ``schedule_fn(lengths) -> rounds``: the step's schedule from
    ``planner.dynamic_cp.plan_dynamic_cp`` (each micro-batch's c and plan chosen together,
    rounds of aligned blocks over the pool, under ``--min-dynamic-context-parallel-size`` and
    ``--max-seqlen-per-dp-cp-rank``); the last schedule is kept as ``schedule_fn.last``."""
    from ..planner.dynamic_cp import plan_dynamic_cp

    dims = dims_of(args)

    def schedule_fn(lengths):
        got = plan_dynamic_cp(lengths, dims.dp, planners, dims.tp, min_size=dims.dcp_min_size,
                              per_node=args.max_seqlen_per_dp_cp_rank)
        schedule_fn.last = got
        return got.rounds

    schedule_fn.last = None
    return schedule_fn


def describe_planner(planner) -> str:
    """The planner's one-line description; a pipeline's names its stages."""
    stages = getattr(planner, "stages", None)
    if stages is None:
        return planner.describe()
    schedule = "1F1B" if planner.num_chunks == 1 else f"interleaved ({planner.num_chunks} chunks per stage)"
    return (f"{stages[0].describe()}, one per pipeline stage ({planner.num_stages} stages, a step's "
            f"micro-batches planned together over the {schedule} schedule)")


def recompute_plan(args) -> tuple:
    """``(planner recompute mode, chunk, first)`` from ``--paradyse-recompute`` and megatron's
    own flags, which fix recompute where they apply: ``full`` + ``uniform`` recomputes every
    layer in chunks of ``--recompute-num-layers`` (the planner plans ``:rc`` entries only);
    ``full`` + ``block`` the first ``--recompute-num-layers`` layers (the planner plans the rest,
    ``Planner.recompute_first``); selective recompute changes no plan (its savings are not
    counted: the predicted peak stays an upper bound)."""
    mode = getattr(args, "paradyse_recompute", "auto") or "auto"
    if getattr(args, "recompute_granularity", None) != "full":
        return mode, 1, 0
    n = int(args.recompute_num_layers or 0)
    if args.recompute_method == "uniform":
        return "only", max(1, n), 0
    return mode, 1, n


class BudgetError(UserError):
    """The memory budget fits no micro-batch the data can produce (refused at start-up)."""


def longest_trainable(planner, args) -> int:
    """The longest padded length some plan fits under the budget (at most ``--seq-length``; the
    data are cut to it, ``--paradyse-long-docs``); a :class:`BudgetError` with the numbers at
    start-up when even the shortest micro-batch (one multiple of the layout's divisor) fits no
    plan."""
    from ..data import longest_fitting

    m = args.paradyse_pad_multiple or dims_of(args).seq_divisor
    top = longest_fitting(planner, args.micro_batch_size, args.seq_length, m)
    if top < m:
        raise BudgetError(f"--paradyse-memory-budget {planner.budget / GiB:.4g} GiB per rank fits no "
                          f"micro-batch: {planner.no_fit_message(m, args.micro_batch_size)}; raise "
                          "the budget (or lower --micro-batch-size)")
    return top


def allocator_mismatch(cm) -> str | None:
    """On CPU, why ``cm``'s times may not hold here: its profile's ranks had other allocator
    settings (``cpu_compat.ALLOCATOR_ENV``; a profile from before 2026-11-25 recorded only
    ``THP_MEM_ALLOC_ENABLE``) than this process; else None."""
    hw = (getattr(cm, "meta", None) or {}).get("profile", {}).get("hardware") or {}
    then = hw.get("allocator_env")
    if then is None and "thp_mem_alloc_enable" in hw:
        then = {"THP_MEM_ALLOC_ENABLE": hw["thp_mem_alloc_enable"]}
    if not is_cpu() or not then:
        return None
    differ = [f"{k}={v} (this rank: {os.environ.get(k)})" for k, v in then.items() if os.environ.get(k) != v]
    if not differ:
        return None
    return ("the cost model was profiled with other allocator settings: " + ", ".join(differ)
            + "; CPU times of large tensors differ (cpu_compat.ALLOCATOR_ENV; "
            "scripts/pretrain_gpt_paradyse_cpu.sh sets them)")
