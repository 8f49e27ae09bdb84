"""The megatron-core trainer of ``pretrain_gpt_paradyse.py``: a GPT trained with optional ParaDySe switching.

* :func:`build_model`, :func:`build_optimizer`: the stock GPTModel of the flags (the builder
  of :mod:`megatron_paradyse.model`), megatron's optimizer (``get_megatron_optimizer``:
  ``--optimizer``, gradient clipping) and ``OptimizerParamScheduler``.
* :class:`Trainer`: megatron-core's training path: ``DistributedDataParallel``,
  ``get_forward_backward_func``, ``finalize_model_grads``, data parallelism over replicas of
  the switching group (world = dp x p), ``--save`` / ``--load``. Its data come from
  :mod:`megatron_paradyse.data` through the planning iterator (``iterator.py``), the plan of
  each micro-batch from a ``plan_fn``, ``--paradyse-plan`` or the planner (``planning.py``).
  :meth:`Trainer.measured_step` is the one step of :meth:`Trainer.train`: with a planner it
  adds the predictions, the measured peak and the online refinement, with
  ``--paradyse-run-report`` the report's record (``run_report.py``).
* :class:`StepStats`, :func:`format_log_line`, :func:`describe_setup`: a step's numbers and the
  Megatron-LM-style iteration line.
* :func:`init_distributed`, :func:`main`: ``pretrain_gpt_paradyse.py``'s entry point
  (torchrun's environment or a single process; a rank's failure ends every rank, ``faults.py``).
"""


import contextlib
import dataclasses
import datetime
import logging
import os
import random
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from .. import cpu_compat
from .. import data as pdata
from .. import logs
from ..errors import EXIT_INTERRUPTED, exit_on_user_error
from ..device import select as select_device
from ..device import synchronize
from ..memory import PeakMemory, static_bytes
from ..model import build_gpt_for
from ..costmodel.schedule import interleaved_group, interleaved_receives
from .. import runtime
from ..parallel import dynamic_cp, groups, megatron_state
from ..parallel.buffers import release_pool
from ..paths import shown
from ..parallel.dispatch import install
from ..parallel.plan_check import collective_device
from ..parallel.plans import describe_plans, parse_plan, rule_plan_fn
from ..units import GiB, MiB
from . import checkpointing, p2p_shapes
from .arguments import parse_args, transformer_config_from_args
from .dims import data_config, dims_of, runtime_options
from .dynamic_cp import DynamicCPLoader, assigned_plan, placeholder_schedule
from .exits import ExitCheck
from .model_args import model_flags
from .faults import FailFast
from .forward_step import forward_step
from .evaluation import Evaluation
from .iterator import PlannedIterator
from ..planner import make_plan_fn
from .planning import (MicroBatchView, calibrated_cost_model, dynamic_cp_planners, dynamic_cp_schedule_fn,
                       longest_trainable, planner_from_args)
from .run_report import RunReport, max_over_ranks, max_per_stage, pool_bytes
from .scalars import ScalarWriter

log = logging.getLogger(__name__)

# ============================================================================ model & optimizer


def build_model(args, config):
    """The stock GPTModel for the parsed flags (megatron_paradyse.model: the builder the
    profiler and the check use too), on this process's device."""
    return build_gpt_for(model_flags(args), config, seed=args.seed)


def model_chunks(args, config, ddp_config, vpp: int | None) -> list:
    """The stock GPT in megatron-core's DDP: one module, or under the interleaved schedule
    (``vpp`` V) its V model chunks, one DDP each (as Megatron-LM's ``get_model``: bucketing on
    the first only). The trainer's and the benchmark's one builder."""
    from megatron.core.distributed import DistributedDataParallel

    modules = ([build_model(args, config)] if vpp is None else
               [build_gpt_for(model_flags(args), config, seed=args.seed if i == 0 else None, vp_stage=i)
                for i in range(vpp)])
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
            for i, m in enumerate(modules)]


def interleaved_inputs(config, chunks, iterator, micro, shapes, pp_rank: int, dims, forward_only: bool) -> dict:
    """megatron's interleaved schedule's ``model`` and ``data_iterator`` for a step of ``micro``:
    every model chunk reads the same micro-batches (the first from ``iterator``, the others
    from copies), in groups of ``costmodel.schedule.interleaved_group`` (set on ``config``);
    ``shapes`` (ParaDySe's p2p shapes per micro-batch, None: megatron's own exchange) queued
    in the order this stage receives them."""
    group = interleaved_group(len(micro), dims.pp)
    config.microbatch_group_size_per_vp_stage = group
    if shapes is not None:
        fwd, bwd = interleaved_receives(pp_rank, dims.pp, len(micro), dims.vpp, group, forward_only)
        p2p_shapes.expect([shapes[j] for j in fwd], [shapes[j] for j in bwd])
    return dict(model=list(chunks), data_iterator=[iterator] + [iter(list(micro)) for _ in chunks[1:]])


def build_optimizer(args, model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, bf16=args.bf16,
        params_dtype=args.params_dtype, use_distributed_optimizer=args.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, model if isinstance(model, list) else [model])
    gbs = args.global_batch_size
    warmup = (args.lr_warmup_iters * gbs if getattr(args, "lr_warmup_fraction", None) is None
              else args.lr_warmup_fraction * args.lr_decay_iters * gbs)  # as Megatron-LM
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
    )
    return optimizer, scheduler


# ============================================================================ trainer


@dataclasses.dataclass
class StepStats:
    iteration: int
    loss: float
    grad_norm: float | None
    lr: float
    seconds: float
    tokens: int          # real tokens in the global batch (all replicas)
    padded_tokens: int   # tokens the model ran, padding included
    seq_lengths: tuple   # padded lengths of this rank's micro-batches
    plans: tuple         # this rank's plans, one per micro-batch
    skipped: bool = False

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class Trainer:
    """megatron-core training of a GPT with optional ParaDySe switching.

    Expects ``torch.distributed`` to be initialised (world = dp x p). ``plan_fn(mb, step,
    index)`` overrides ``--paradyse-plan`` (tests, planners); it must be deterministic in the
    data every rank of the switching group has.
    """

    def __init__(self, args, plan_fn=None):
        self.args = args
        self.dims = dims_of(args)  # the parallel layout, built and checked with the flags
        self.plan_fn = plan_fn
        self.history: list = []
        self.iteration = 0
        self._read_ahead_until = 0  # train() reads each step ahead up to its last iteration
        self._setup()

    # ------------------------------------------------------------------ setup
    def _setup(self):
        """The phases of a run's start, in order; each sets the attributes the next ones read."""
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed first (init_distributed does)")
        if dist.get_world_size() != self.args.world_size:
            raise RuntimeError(f"arguments were validated for world size {self.args.world_size}, "
                               f"but the process group has {dist.get_world_size()} ranks")
        self.options = runtime_options(self.args)  # prefetch, kernels, determinism
        runtime.set_options(self.options)
        self._calibrate()
        self._init_parallel()
        self._build_model_and_optimizer()
        if self.args.load:
            self.iteration = checkpointing.load_checkpoint(self.args, self.chunks, self.optimizer,
                                                           self.scheduler, iteration=self.args.ckpt_step)
        self._build_planner()
        self._build_data()
        # TensorBoard / wandb (scalars.py): the last rank's writer, None elsewhere and without the flags
        self.scalars = ScalarWriter.from_args(self.args, dist.get_rank(), dist.get_world_size(), cp_size=self.cp_size)
        self.evaluation = Evaluation(self, self._data_plan_fn, max_length=getattr(self, "_eval_max", self._max_fit))

    def _calibrate(self):
        """``--paradyse-calibrate`` with the planner: the cost model rescaled to this host
        (``planning.calibrated_cost_model``), before megatron's parallel state and seeds are set
        for the run; else nothing (``self.cost_model`` None: the planner loads its own)."""
        args = self.args
        self.cost_model = None
        if args.paradyse and self.plan_fn is None and args.paradyse_plan is None and args.paradyse_calibrate:
            cpu_compat.apply()
            install()
            self.cost_model = calibrated_cost_model(args)

    def _init_parallel(self):
        """The CPU shims where the CPU was chosen, the plugin, megatron's parallel state, seeds."""
        from megatron.core import parallel_state, tensor_parallel

        args = self.args
        cpu_compat.apply()
        if args.paradyse:
            install()
        dims = self.dims
        megatron_state.initialize("trainer", tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
                                  virtual_pipeline_model_parallel_size=dims.vpp, context_parallel_size=dims.cp)
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_group = parallel_state.get_context_parallel_group() if dims.cp_on else None
        made = groups.created() if args.paradyse else None
        if made is not None:
            log.info(f"> {made.describe()}")
        dynamic_cp.disable()
        if dims.dynamic_cp:  # every CP group of the pool, made once here on every rank (dynamic_cp.py)
            with megatron_state.owned():
                dynamic_cp.enable(dynamic_cp.DynamicCPGroups(dims.tp, min_size=dims.dcp_min_size))

    def _build_model_and_optimizer(self):
        """The stock GPT in megatron-core's DDP, its optimizer and scheduler, the grad hooks.
        Under the interleaved schedule (``dims.vpp``) its model chunks, one DDP each (as
        Megatron-LM's ``get_model``: bucketing on the first only), in ``self.chunks``;
        ``self.model`` is the first."""
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        args = self.args
        self.config = transformer_config_from_args(args)
        for note in args.model_notes:
            log.info(f"> {note}")
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
            overlap_grad_reduce=args.overlap_grad_reduce,
            use_distributed_optimizer=args.use_distributed_optimizer,
            overlap_param_gather=args.overlap_param_gather,
            bucket_size=args.ddp_bucket_size,
        )
        vpp = self.dims.vpp
        self.chunks = model_chunks(args, self.config, ddp_config, vpp)
        self.model = self.chunks[0]
        self.whole_model = self.model if vpp is None else torch.nn.ModuleList(self.chunks)  # every chunk's parameters
        self.optimizer, self.scheduler = build_optimizer(args, self.chunks)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync if vpp is None else [c.no_sync for c in self.chunks]
        self.config.grad_scale_func = self.optimizer.scale_loss

    def _build_planner(self):
        """``--paradyse`` without ``--paradyse-plan`` (and no ``plan_fn``): the planner
        (planning.py) and its plan_fn; else none."""
        args = self.args
        self.planner, self._planner_fn, self._step_plan_fn, self._dcp_planners = None, None, None, None
        if args.paradyse and self.plan_fn is None and args.paradyse_plan is None and self.dims.dynamic_cp:
            # a CP size and plan per micro-batch (planning.dynamic_cp_planners); validation and
            # the data's longest document at c = 1, where one node runs a micro-batch alone
            self._dcp_planners = dynamic_cp_planners(args, cost_model=self.cost_model)
            self.planner = self._dcp_planners[1]
            return
        if args.paradyse and self.plan_fn is None and args.paradyse_plan is None:
            planner, fn = planner_from_args(args, cost_model=self.cost_model)
            if self.dims.pp_on:  # a step's micro-batches planned together over the stages
                self.planner, self._step_plan_fn = MicroBatchView(planner), fn
            else:
                self.planner, self._planner_fn = planner, fn

    def _build_data(self):
        """The dataset (documents longer than any plan fits follow --paradyse-long-docs), the
        sampler, the loader and the planned iterator that gives each micro-batch its plan."""
        args = self.args
        top = self.planner if self._dcp_planners is None else self._dcp_planners[max(self._dcp_planners)]
        max_fit = None if top is None else longest_trainable(top, args)
        if self._dcp_planners is not None and args.max_seqlen_per_dp_cp_rank:  # the whole pool under the cap
            max_fit = min(max_fit, self.dims.dp * args.max_seqlen_per_dp_cp_rank)
        self._max_fit = max_fit
        self.data = data_config(args)
        self.dataset = pdata.build_dataset(self.data, max_length=max_fit)
        self.sampler = self.packer = None
        plan_fn = self.plan_fn or self._planner_fn
        if plan_fn is None and args.paradyse and self._step_plan_fn is None and self._dcp_planners is None:
            plan_fn = rule_plan_fn(parse_plan(args.paradyse_plan, args.num_layers))
        self._data_plan_fn = plan_fn if args.paradyse else None  # validation plans the same way
        if self.dims.dynamic_cp:
            self._build_dynamic_cp_data(plan_fn)
            return
        if self.data.packed:
            self._build_packed_data(plan_fn if args.paradyse else None)
            return
        if args.paradyse_sampler == "length":
            self.sampler = pdata.LengthAwareSampler(
                self.dataset, args.micro_batch_size, args.global_batch_size, self.dp_size, seed=args.seed,
                window_steps=args.paradyse_sampler_window, multiple=self.data.pad_multiple,
                cost_fn=pdata.make_cost_fn(planner=self.planner))
        loader = pdata.MicroBatchLoader(
            self.dataset, args.micro_batch_size, args.global_batch_size, self.dp_rank, self.dp_size,
            self.data.pad_multiple, consumed_samples=self.iteration * args.global_batch_size,
            sampler=self.sampler)
        self.data_iterator = PlannedIterator(
            loader, plan_fn if args.paradyse else None, args.num_microbatches,
            group_index=self.dp_rank, num_groups=self.dp_size, start_step=self.iteration,
            step_plan_fn=self._step_plan_fn)

    def _build_packed_data(self, plan_fn):
        """``--paradyse-pack``: the packing scheduler (with a planner: packs that fit its budget,
        replicas balanced by its predicted seconds), this replica's packed loader, the planned
        iterator with per-step micro-batch counts (replicas run different numbers of packs)."""
        args = self.args
        cost_fn = fits_fn = None
        if self.planner is not None:
            cost_fn, fits_fn = pdata.make_pack_fns(self.planner)
        self.packer = pdata.PackScheduler(
            self.dataset.length, args.global_batch_size, self.dp_size, token_cap=self.data.pack_tokens,
            seed=self.data.seed, mode=self.data.pack, cost_fn=cost_fn, fits_fn=fits_fn)
        loader = pdata.PackedLoader(self.dataset, self.packer, self.dp_rank, multiple=self.data.pad_multiple,
                                    start_step=self.iteration)
        self.data_iterator = PlannedIterator(
            loader, plan_fn, args.num_microbatches, group_index=self.dp_rank, num_groups=self.dp_size,
            start_step=self.iteration, counts=loader.counts, step_plan_fn=self._step_plan_fn,
            min_count=self.dims.pp if self.dims.vpp else 1)

    def _build_dynamic_cp_data(self, plan_fn):
        """``--dynamic-context-parallel``: every rank reads the step's global batch and runs its
        node's micro-batch of each round of the step's schedule (``dynamic_cp.py``): with the
        planner, the Dynamic CP planner's (a c and a plan per micro-batch; validation planned at
        c = 1); with ``--paradyse-plan``, the placeholder schedule and the plan rule."""
        args, dims = self.args, self.dims
        if self._dcp_planners is not None:  # the Dynamic CP planner: each micro-batch's c and plan
            schedule_fn = dynamic_cp_schedule_fn(args, self._dcp_planners)
            self._data_plan_fn = make_plan_fn(self.planner, args.paradyse_on_no_fit, multiple=dims.seq_divisor)
            self._eval_max = longest_trainable(self.planner, args)
            plan_fn = assigned_plan
        else:
            schedule_fn = partial(placeholder_schedule, nodes=dims.dp, min_size=dims.dcp_min_size,
                                  max_seqlen=args.max_seqlen_per_dp_cp_rank)
        loader = DynamicCPLoader(self.dataset, args.global_batch_size, dims.dp, self.dp_rank, dims.tp, schedule_fn,
                                 start_step=self.iteration)
        self.data_iterator = PlannedIterator(
            loader, plan_fn, args.num_microbatches, group_index=self.dp_rank, num_groups=self.dp_size,
            start_step=self.iteration, counts=loader.counts)

    # ------------------------------------------------------------------ one step, measured
    def measured_step(self, report=None):
        """One step as :meth:`train` runs it; returns ``(stats, text appended to its log line)``.

        Without a planner and without a run report: :meth:`train_step` alone. Otherwise the
        step runs under the peak-memory tracker, to which the bytes live before it are added
        (static: parameters, gradient buffers, optimizer state; the communication pool held).
        With a planner: its predictions for the step's micro-batches (made when they were
        planned), this rank's measured peak and time fed to the refinement (one all-reduce
        over the world, every rank applies the same sum), ``self.last_measure``. With
        ``report`` (a :class:`~.run_report.RunReport`): the step recorded, peaks the max over
        ranks, and the report's text in the log line.
        """
        if self._planner_fn is None and self._step_plan_fn is None and self._dcp_planners is None and report is None:
            return self.train_step(), ""
        every = self.args.paradyse_memory_every
        tracked = self.iteration % every == 0  # the same on every rank
        static, held = static_bytes(self.whole_model, self.optimizer), pool_bytes()  # live before the tracker
        if tracked:
            with PeakMemory() as m:
                stats = self.train_step()
            measured, reserved = m.peak_bytes + held + static, m.peak_reserved  # this rank's
        else:
            stats, measured, reserved = self.train_step(), None, None
        predicted, text, stages = None, "", None
        if self.dims.pp_on and measured is not None:
            stages = max_per_stage(measured, self.pp_rank, self.pp_size)  # every rank, the same step
        if self._planner_fn is not None:
            # with every > 1 the time is learnt from the untracked steps only
            predicted, text = self._refine(stats, measured, reserved, time_ok=every == 1 or not tracked)
        elif self._step_plan_fn is not None:
            predicted, text = self._pipeline_prediction(stages)
            text += self._refine_stages(stats, measured, time_ok=every == 1 or not tracked)
        elif self._dcp_planners is not None:
            predicted, text = self._dcp_prediction(stats, measured)
        if report is not None:
            peak = None if measured is None else max_over_ranks(measured) - static
            sp = self.data_iterator.last_step_plan
            text = report.record(stats, peak, max_over_ranks(static), self.data_iterator.current, predicted,
                                 tracked=tracked if every > 1 else None, stage_peaks=stages,
                                 stage_predicted=None if sp is None else list(sp.stage_peaks))
        ref = None if self.planner is None else self.planner.refinement
        if ref is not None:
            text += f" | refinement v{ref.version}"
        return stats, text

    def _refine(self, stats, measured, reserved, time_ok: bool = True):
        """The planner's ``(predicted seconds, predicted peak)`` of the step just run; the
        refinement's update from them, the measured time (unless not ``time_ok``: a step under
        the CPU tracker when untracked ones exist) and this rank's ``measured`` peak (None: not
        measured this step); the text for the log line without a report."""
        planner = self.planner
        choices = [mb.choice for mb in self.data_iterator.current]
        pred_s = sum(c.seconds for c in choices if c is not None) + planner.update_seconds()
        pred_m = max((c.peak_bytes for c in choices if c is not None), default=0.0)
        ref = planner.refinement
        if ref is not None:
            micro = [(mb.plan, mb.plan_length) for mb in self.data_iterator.current if mb.plan is not None]
            b = self.args.micro_batch_size
            vec = ref.contribution(micro, pred_s, stats.seconds if time_ok else None, pred_m, measured,
                                   layer_seconds=lambda n, s: planner.layer_seconds(n, s, b))
            ref.step(vec)  # one all-reduce over the world: every rank applies the same sum
        self.last_measure = dict(pred_seconds=pred_s, pred_peak=pred_m, peak=measured,
                                 peak_reserved=reserved, seconds=stats.seconds,
                                 budget=planner.budget, margin=planner.margin)
        res = "" if reserved is None else f", reserved {reserved / MiB:.1f} MiB"
        meas = "not measured this step" if measured is None else f"{measured / MiB:.1f} MiB{res}"
        text = (f"pred: {pred_s:.3f} s, peak {pred_m / MiB:.1f} MiB | measured peak (rank "
                f"{dist.get_rank() if dist.is_initialized() else 0}): {meas} "
                f"(budget {planner.budget / MiB:.1f} MiB)")
        return (pred_s, pred_m), text

    def _dcp_prediction(self, stats, measured):
        """The Dynamic CP planner's ``(predicted seconds, predicted peak)`` of the step just run
        (its schedule's rounds: the slowest block of each plus the update; the highest block
        peak) and the log text: CP sizes, time and peak predicted against measured (the peak
        the max over ranks; a collective, every rank calls it)."""
        rounds = self.data_iterator.source.schedule(self.iteration - 1)[0]
        pred_s = sum(max(a.seconds for a in r) for r in rounds) + self.planner.update_seconds()
        pred_m = max(a.peak_bytes for r in rounds for a in r)
        peak = None if measured is None else max_over_ranks(measured)
        self.last_measure = dict(pred_seconds=pred_s, pred_peak=pred_m, peak=peak, seconds=stats.seconds,
                                 budget=self.planner.budget, margin=self.planner.margin)
        sizes = sorted({a.size for r in rounds for a in r if a.documents})
        text = (f"Dynamic CP: {len(rounds)} rounds, c {sizes} | time pred/meas: {pred_s:.3f}/{stats.seconds:.3f} s"
                f" | peak pred/meas: {pred_m / MiB:.1f}/{'-' if peak is None else f'{peak / MiB:.1f}'} MiB"
                f" (budget {self.planner.budget / MiB:.1f} MiB)")
        return (pred_s, pred_m), text

    def _pipeline_prediction(self, stages):
        """The step plan's ``(seconds, this stage's peak)`` and the log text: each stage's
        predicted peak beside its measured one (``stages``, max over the stage's ranks)."""
        sp = self.data_iterator.last_step_plan
        self.last_measure = dict(pred_seconds=sp.seconds, pred_stage_peaks=list(sp.stage_peaks),
                                 stage_peaks=stages, limits=list(sp.stage_limits),
                                 budget=self.planner.budget)
        meas = ["-"] * len(sp.stage_peaks) if stages is None else [f"{x / MiB:.1f}" for x in stages]
        per = ", ".join(f"{p / MiB:.1f}/{m}" for p, m in zip(sp.stage_peaks, meas))
        text = (f"pred: {sp.seconds:.3f} s (bubbles {100 * (1 - sum(sp.stage_seconds) / (len(sp.stage_seconds) * sp.makespan)):.0f}%) | "
                f"stage peaks pred/meas: {per} MiB (budget {self.planner.budget / MiB:.1f} MiB)")
        return (sp.seconds, sp.stage_peaks[self.pp_rank]), text

    def _refine_stages(self, stats, measured, time_ok: bool = True) -> str:
        """With pipeline stages and ``--paradyse-refine``: this rank's stage's plans, the step's
        predicted and measured time and its stage's predicted and measured peak, summed over
        the world in one all-reduce in that stage planner's slot (``PipelinePlanner.refine``);
        the log text (each stage planner's refinement version)."""
        pipeline = self.planner.pipeline
        if not pipeline.refines():
            return ""
        sp, r = self.data_iterator.last_step_plan, self.pp_rank
        micro = [(sp.stage_plans[r][j].layers, mb.plan_length) for j, mb in zip(sp.order, self.data_iterator.current)]
        vec = pipeline.contribution(r, micro, sp.seconds, stats.seconds if time_ok else None, sp.stage_peaks[r],
                                    measured, self.args.micro_batch_size)
        pipeline.refine(vec)
        return f" | refinement v{'/'.join(str(v) for v in pipeline.refinement_versions())}"

    # ------------------------------------------------------------------ one step
    def train_step(self) -> StepStats:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        args = self.args
        synchronize()
        t0 = time.perf_counter()
        micro = self.data_iterator.prefetch()
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        fwd_bwd = get_forward_backward_func()
        reports = fwd_bwd(
            forward_step_func=partial(forward_step, paradyse=args.paradyse, cp=self.dims.cp),
            **self.schedule_inputs(self.data_iterator, micro, forward_only=False),
            num_microbatches=len(micro), seq_length=max(mb.seq_length for mb in micro),
            micro_batch_size=args.micro_batch_size, forward_only=False,
        )
        if args.paradyse:
            release_pool()  # nothing of the pool outlives the step (see forward_step)
            p2p_shapes.clear()
            if self.iteration + 1 < self._read_ahead_until and not args.paradyse_no_read_ahead:
                self.data_iterator.read_ahead()  # step k+1's host work while step k's kernels run
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=args.global_batch_size)
        total = self._reduce_losses(reports, micro)
        synchronize()
        seconds = time.perf_counter() - t0
        self.iteration += 1
        stats = StepStats(
            iteration=self.iteration, loss=float(total[0] / max(total[1], 1)),
            grad_norm=None if grad_norm is None else float(grad_norm),
            lr=float(self.optimizer.param_groups[0]["lr"]), seconds=seconds,
            tokens=int(total[1]), padded_tokens=int(total[2]),
            seq_lengths=tuple(mb.seq_length for mb in micro),
            plans=tuple(mb.plan for mb in micro), skipped=not ok)
        self.history.append(stats)
        return stats

    def schedule_inputs(self, iterator, micro, forward_only: bool) -> dict:
        """megatron's schedule's ``model`` and ``data_iterator`` for a step of ``micro`` read
        from ``iterator``; with ParaDySe and stages, the step's p2p shapes queued
        (``p2p_shapes``). Under the interleaved schedule every model chunk reads the same
        micro-batches (the first from ``iterator``, the others from copies), in groups of
        ``costmodel.schedule.interleaved_group`` (set on the config: PP, or all of a packed
        step's when PP does not divide them)."""
        args, dims = self.args, self.dims
        shapes = [p2p_shapes.micro_batch_shape(mb, args.hidden_size, dims) for mb in micro] if dims.pp_on else []
        if dims.vpp is None:
            if args.paradyse and dims.pp_on:
                p2p_shapes.expect(shapes)
            return dict(model=[self.model], data_iterator=iterator)
        return interleaved_inputs(self.config, self.chunks, iterator, micro, shapes if args.paradyse else None,
                                  self.pp_rank, dims, forward_only)

    def _reduce_losses(self, reports, micro):
        """``(loss sum, real tokens, padded tokens)`` of a step over the world: the last
        pipeline stage's losses (the others have none), each CP rank's chunks, the replicas."""
        total = torch.zeros(3, dtype=torch.float64)
        for r in reports:
            total[:2] += r["lm loss"].detach().double().cpu()
        total[:2] = p2p_shapes.sum_over_stages(total[:2], collective_device())
        if self.dims.cp_on:  # each CP rank's losses are its own chunks'
            t = total[:2].to(collective_device())
            dist.all_reduce(t, group=self.cp_group)
            total[:2] = t.cpu()
        total[2] = sum(mb.tokens.numel() // (mb.cp_block[1] if mb.cp_block else 1) for mb in micro)
        if self.dp_size > 1:
            t = total.to(collective_device())
            dist.all_reduce(t, group=self.dp_group)
            total = t.cpu()
        return total

    # ------------------------------------------------------------------ loop
    def train(self, train_iters: int | None = None) -> list:
        args = self.args
        end = args.train_iters if train_iters is None else train_iters
        window: list = []
        last_saved = None
        log.info(f"> training {describe_setup(args, custom_plan=self.plan_fn is not None, planner=self.planner)} "
                 f"from iteration {self.iteration} to {end}")
        report = self._run_report()
        self._read_ahead_until = end
        exits, stop = ExitCheck.from_args(args), None  # --exit-interval, --exit-duration-in-mins
        with exits.handling_signals():
            while self.iteration < end and stop is None:
                stats, extra = self.measured_step(report)
                window.append(stats)
                if self.scalars is not None:
                    self.scalars.step(stats, getattr(self, "last_measure", None), self.data_iterator.plan_seconds)
                stop = exits.reason(stats.iteration)  # the same on every rank
                if stats.iteration % args.log_interval == 0 or stats.iteration == end or stop:
                    log.info(format_log_line(window, args, end) + (f" {extra} |" if extra else ""))
                    window = []
                if self.evaluation.due(stats.iteration):
                    self.evaluate(f"iteration {stats.iteration}")
                if args.save and args.save_interval and stats.iteration % args.save_interval == 0:
                    self.save()
                    last_saved = stats.iteration
        if args.save and last_saved != self.iteration and self.iteration > 0:
            self.save()
        self.exit_reason = stop  # None: ran to the end
        if stop is not None:
            log.info(f"> exiting {stop}: {last_checkpoint_text(args)}")
        self.finish_param_gather()
        if self.scalars is not None:
            self.scalars.flush()  # on disk now (train may be called again: closed by main)
        if report is not None:
            log.info(report.summary())
            if not dist.is_initialized() or dist.get_rank() == 0:
                log.info(f"  wrote {' '.join(shown(x) for x in report.write(args.paradyse_run_report))}")
        return self.history

    def evaluate(self, prefix: str, split: str = "validation"):
        """One evaluation (``evaluation.py``), its loss and PPL also written to TensorBoard/wandb
        (Megatron-LM's ``lm loss validation`` tags; the test split's with `` test``)."""
        res = self.evaluation.run(prefix, split=split)
        if res is not None and self.scalars is not None:
            self.scalars.validation(res.iteration, res.loss, res.ppl, suffix="" if split == "validation" else " test")
        return res

    def final_evaluation(self) -> None:
        """After training, as Megatron-LM's ``pretrain``: the validation split, then the test split."""
        self.evaluate(f"iteration {self.iteration} on validation set")
        self.evaluate(f"iteration {self.iteration} on test set", split="test")

    # ------------------------------------------------------------------ run report (run_report.py)
    def _run_report(self):
        args = self.args
        if not args.paradyse_run_report:
            return None
        budget = args.paradyse_memory_budget
        cal = None if self.cost_model is None else self.cost_model.meta.get("calibration")
        return RunReport(budget_bytes=None if budget is None else float(budget) * GiB, calibration=cal,
                         planner=self.planner if self._planner_fn is not None else None)

    @contextlib.contextmanager
    def _params_gathered(self):
        """With --overlap-param-gather, the distributed optimizer's parameter all-gather is
        finished only in the next forward's pre-hooks: inside this, the parameters are complete
        (as Megatron-LM around a checkpoint save: the hooks off with a synchronous gather, then
        back on)."""
        hooked = getattr(self.model, "use_forward_hook", False)
        if hooked:
            self.model.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            if hooked:
                self.model.enable_forward_pre_hook()

    def finish_param_gather(self):
        """With --overlap-param-gather, finish the last update's parameter all-gather now (else
        the next forward finishes it), so that the parameters are complete after train()."""
        with self._params_gathered():
            pass

    def save(self):
        t0 = time.perf_counter()
        with self._params_gathered():
            path = checkpointing.save_checkpoint(self.args, self.iteration, self.chunks, self.optimizer,
                                                 self.scheduler)
        log.info(f"  saved checkpoint at iteration {self.iteration:8d} to {shown(path)} "
                 f"({time.perf_counter() - t0:.2f} s)")


def describe_setup(args, custom_plan: bool = False, planner=None) -> str:
    plan = ("a custom plan_fn" if custom_plan else f"the {planner.kind} planner" if planner is not None
            else f"plan {args.paradyse_plan!r}")
    mode = (f"with ParaDySe ({plan})" if args.paradyse
            else "with stock Megatron TP+SP" if args.sequence_parallel else "with stock Megatron TP")
    return (f"GPT {args.num_layers}L h{args.hidden_size} a{args.num_attention_heads} on "
            f"{args.world_size} ranks ({dims_of(args).describe()}) {mode}")


def format_log_line(window: list, args, train_iters: int) -> str:
    """A Megatron-LM-style iteration line averaged over ``window``; lengths and plans of its last step."""
    last = window[-1]
    n = len(window)
    ms = 1000.0 * sum(s.seconds for s in window) / n
    tok_s = sum(s.tokens for s in window) / max(sum(s.seconds for s in window), 1e-9)
    loss = sum(s.loss for s in window) / n
    gn = [s.grad_norm for s in window if s.grad_norm is not None]
    parts = [
        f" [{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}] iteration {last.iteration:8d}/{train_iters:8d}",
        f"consumed samples: {last.iteration * args.global_batch_size:12d}",
        f"elapsed time per iteration (ms): {ms:.1f}",
        f"tokens/s: {tok_s:.0f}",
        f"learning rate: {last.lr:.6E}",
        f"global batch size: {args.global_batch_size:5d}",
        f"lm loss: {loss:.6E}",
        f"grad norm: {sum(gn) / len(gn):.3f}" if gn else "grad norm: n/a",
        f"seq len: {','.join(str(s) for s in last.seq_lengths)} "
        f"(pad {100.0 * (1 - last.tokens / max(last.padded_tokens, 1)):.0f}%)",
    ]
    if args.paradyse:
        parts.append(f"plan: {describe_plans(last.plans)}")
    parts.append(f"number of skipped iterations: {sum(s.skipped for s in window):3d}")
    return " | ".join(parts) + " |"


# ============================================================================ entry point


def last_checkpoint_text(args) -> str:
    """What the Ctrl-C line says of checkpoints: the last complete one under ``--save`` (the
    tracker names it; a save cut short never replaces it) and how to resume."""
    if not args.save:
        return "nothing saved (no --save)"
    try:
        it = checkpointing.read_tracker(args.save)
    except Exception as e:  # noqa: BLE001 - the line goes out anyway
        return f"the tracker under --save {shown(args.save)} cannot be read ({e})"
    if it is None:
        return f"no complete checkpoint under --save {shown(args.save)} yet"
    return (f"the last complete checkpoint is {shown(checkpointing.checkpoint_dir(args.save, it))} "
            f"(iteration {it}): resume with --load {shown(args.save)}")


def init_distributed(args) -> None:
    """``torch.distributed`` from torchrun's environment (a single process without it)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dev = select_device(args.distributed_backend)  # nccl: this rank's GPU, set before NCCL starts; gloo: CPU
    if dev.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # device_id (NCCL): the default communicator is created now and every later group is split
    # from it (ncclCommSplit), sharing its resources; parallel/communicators.py creates them all
    # before the budget is measured
    dist.init_process_group(args.distributed_backend,
                            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
                            device_id=dev if dev.type == "cuda" else None)


PROG = "pretrain_gpt_paradyse.py"
CHECK_FLAGS_ENV = "PARADYSE_CHECK_FLAGS"  # =1: validate the flags for $WORLD_SIZE ranks, then exit


def main(argv=None) -> int:
    """``pretrain_gpt_paradyse.py`` on megatron-core: parse, validate (before any collective), train.

    A user's mistake ends it with one line and status 2 (``errors``), Ctrl-C with one line
    naming the last complete checkpoint and status 130. With ``$PARADYSE_CHECK_FLAGS=1`` it
    only validates the flags for ``$WORLD_SIZE`` ranks (what the launch scripts run before
    torchrun)."""
    logs.setup()
    try:
        with exit_on_user_error(PROG):
            args = parse_args(argv)
        if os.environ.get(CHECK_FLAGS_ENV) == "1":
            return 0
        init_distributed(args)
    except SystemExit as e:
        return e.code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED  # before the first step: nothing to say of checkpoints
    # A failure on any rank ends every rank within seconds, with its error in the log and a
    # non-zero exit status (training/faults.py): no barrier or clean-up on the error path.
    with FailFast(prog=PROG, on_interrupt=lambda: last_checkpoint_text(args)):
        trainer = Trainer(args)
        trainer.train()
        trainer.final_evaluation()
        if trainer.scalars is not None:
            trainer.scalars.close()
        from megatron.core import parallel_state

        # megatron's state forgotten; its groups go with the world's below, as torch shuts
        # them down (megatron_state.teardown is for a state made again in one process)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.barrier()  # success path only: nobody tears down the store while a peer still needs it
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
