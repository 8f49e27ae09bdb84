"""Command-line arguments: Megatron-LM's flag names for what the trainer supports, plus ``--paradyse*``.

* :func:`add_paradyse_args` adds only the plugin's flags. It has the signature of
  Megatron-LM's ``extra_args_provider`` (``pretrain(..., extra_args_provider=add_paradyse_args)``).
* :func:`build_parser` / :func:`parse_args` give the full parser of ``pretrain_gpt_paradyse.py``
  on megatron-core alone (model, training, parallelism, data, checkpoint and logging flags as
  Megatron-LM spells them, with Megatron-LM's defaults).
* :func:`validate_args` checks flag combinations locally, before any process group or
  collective exists, and raises :class:`ArgumentError` with a message naming the flags.
"""
from __future__ import annotations

import argparse
import logging
import os
import re

import torch

from ..device import default_backend, usable_memory_bytes
from ..errors import ArgumentParser, UserError
from ..model import ModelArgsError, add_model_args, transformer_config
from ..parallel.plans import parse_plan, strategy_of
from ..parallel.strategies import STRATEGIES, supports
from ..units import GiB
from .model_args import complete_model_args, model_flags, shape_from_args
from .scalars import check_args as check_scalar_args
from .dims import (attach, check_layout, check_pad_multiple, default_pad_multiple, dims_from_args, dims_of,
                   interleaving_flag)

log = logging.getLogger(__name__)


class ArgumentError(UserError, ValueError):
    """A bad flag or flag combination, detected before any collective."""


# Megatron-LM's --overlap-param-gather with --paradyse (both trainers refuse it)
OVERLAP_PARAM_GATHER_WITH_PARADYSE = (
    "--overlap-param-gather cannot be used with --paradyse: megatron's DDP waits for each "
    "parameter bucket's all-gather in forward pre-hooks of the modules that own the parameters, "
    "and the ulysses, ring, colossal and metp strategies read the linear_qkv, linear_proj, "
    "linear_fc1 and linear_fc2 weights without calling those modules, so they could read shards "
    "whose all-gather is still in flight; drop --overlap-param-gather")


# ---------------------------------------------------------------------------- plugin flags
def add_paradyse_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--paradyse*`` flags; usable as Megatron-LM's ``extra_args_provider``."""
    g = parser.add_argument_group("ParaDySe", "per-batch, per-layer parallel-strategy switching")
    g.add_argument("--paradyse", action="store_true",
                   help="Run each layer with the strategy of the plan (over the TP group, stock TP "
                        "shards). Without it the model trains with stock Megatron TP+SP.")
    g.add_argument("--paradyse-plan", type=str, default="tp_sp",
                   help="The plan: a strategy name for every layer ('ulysses'); one name per layer "
                        "('tp_sp,ring,...'); run-length ('tp_sp*2+ring*2'); or a rule on the "
                        "micro-batch's padded sequence length "
                        "('rule:512=tp_sp,2048=ulysses*2+ring*2,ring': s <= 512 -> tp_sp, "
                        "s <= 2048 -> ..., longer -> ring).")
    g.add_argument("--paradyse-pad-multiple", type=int, default=None,
                   help="Pad each micro-batch's length to a multiple of this (default: the "
                        "tensor-model-parallel size, the layout's divisor).")
    g.add_argument("--paradyse-mock-min-length", type=int, default=16,
                   help="Shortest document of --mock-data (lengths are log-uniform up to --seq-length).")
    g.add_argument("--paradyse-cost-model", type=str, default=None,
                   help="The planner's fitted cost model (metadata .json; default: the model shipped "
                        "for this model's shape, else the analytic model).")
    g.add_argument("--paradyse-memory-budget", type=float, default=None,
                   help="The planner's memory budget, GiB per rank (default: what the device can "
                        "hand out once the model and optimizer exist: on GPU free + torch-reserved "
                        "memory less 1 GiB for NCCL/cuBLAS buffers made later; on CPU the host's "
                        "memory divided by the ranks on the node).")
    g.add_argument("--paradyse-recompute", choices=("auto", "off"), default="auto",
                   help="Whether the planner may recompute layers: 'auto' (default) plans strategy x "
                        "recompute per layer and micro-batch (a plan entry 'tp_sp:rc' recomputes its "
                        "layer in backward); 'off' never. megatron's own --recompute-* flags fix "
                        "recompute where they apply and the planner plans the rest. Fixed plans "
                        "(--paradyse-plan) say it per entry.")
    g.add_argument("--paradyse-no-prefetch", action="store_true",
                   help="Gather the ulysses/ring/colossal layers' weights where they are used, blocking "
                        "(default: each gather is posted before the linear that precedes its use, "
                        "holding one more gathered weight: megatron_paradyse.parallel.prefetch).")
    g.add_argument("--paradyse-no-read-ahead", action="store_true",
                   help="Read, plan and check each step's micro-batches at the step's start (default: "
                        "the plugin trainer does it for step k+1 once step k's forward and backward "
                        "are queued, before its optimizer step, so that on a GPU this host work "
                        "overlaps the kernels; the plans then use the refinement of step k-1)")
    g.add_argument("--paradyse-trainer", choices=("auto", "core", "megatron"), default="core",
                   help="pretrain_gpt_paradyse.py: 'core' (default) = the megatron-core training "
                        "loop of megatron_paradyse.training; 'megatron' = Megatron-LM's pretrain() "
                        "with the ParaDySe hooks (needs megatron.training; untested in this "
                        "repository); 'auto' = 'megatron' where megatron.training imports and "
                        "CUDA is present, else 'core'.")
    return parser


def paradyse_args_provider(other=None):
    """An ``extra_args_provider`` adding the ``--paradyse*`` flags after ``other``'s (or alone)."""

    def provider(parser):
        if other is not None:
            parser = other(parser) or parser
        return add_paradyse_args(parser)

    return provider


# ---------------------------------------------------------------------------- full parser
_IGNORED = {  # accepted for drop-in compatibility with Megatron-LM scripts; no effect here
    "--num-workers": int,
    "--data-cache-path": str,
}
_IGNORED_SWITCHES = ("--use-mcore-models", "--transformer-impl-local", "--log-throughput",
                     "--no-async-tensor-model-parallel-allreduce")


def build_parser() -> argparse.ArgumentParser:
    """The full parser of ``pretrain_gpt_paradyse.py``: Megatron-LM's flag names and defaults."""
    p = ArgumentParser(
        prog="pretrain_gpt_paradyse.py", allow_abbrev=False,
        description="Pretrain a GPT with megatron-core, optionally with ParaDySe strategy switching.")

    add_model_args(p)
    p.add_argument("--tokenizer-type", type=str, default="NullTokenizer",
                   help="only NullTokenizer: data is token ids")
    _add_training_args(p)
    _add_recompute_args(p)
    _add_distributed_args(p)
    p.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                   help="Megatron-LM's flag: this trainer builds megatron-core's local layers ('local', "
                        "the default); Transformer Engine layers are not switchable")
    _add_data_args(p)
    _add_checkpointing_args(p)
    _add_logging_args(p)
    _add_ignored_args(p)
    add_paradyse_args(p)
    add_planner_args(p)
    return p


def _add_training_args(p: argparse.ArgumentParser) -> None:
    """Batch, schedule, optimizer and loss flags."""
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=True,
                   help="the longest sequence; shorter documents make shorter micro-batches")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root"),
                   default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of --lr-decay-iters (Megatron-LM's flag; not with "
                        "--lr-warmup-iters)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-08)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="always on: the loss is summed over real tokens and divided by the step's "
                        "real-token count, so padding never changes loss or gradient")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="launch each gradient bucket's data-parallel reduction as soon as its "
                        "gradients are ready (megatron's DDP); with --paradyse every replica "
                        "launches them in bucket order whatever its plans")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="parameters per gradient bucket with --overlap-grad-reduce (Megatron-LM's "
                        "flag; default megatron's: max(40M, 1M x data-parallel size))")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="overlap the distributed optimizer's parameter all-gather with the next "
                        "forward (Megatron-LM's flag; needs --use-distributed-optimizer and "
                        "--overlap-grad-reduce; not with --paradyse)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")


# megatron-core's selective recompute modules (TransformerConfig.recompute_modules)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


def _add_recompute_args(p: argparse.ArgumentParser) -> None:
    """megatron's activation recomputation, as Megatron-LM names and checks its flags."""
    g = p.add_argument_group("activation recomputation (Megatron-LM flag names)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="selective recompute (--recompute-granularity selective)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="*", choices=RECOMPUTE_MODULES, default=None,
                   help="selective recompute's modules (default core_attn)")


# megatron-core 0.16 and 0.19 alike (stock or not): the MLP's checkpoint returns fc2's bias
# parameter itself as an output, which autograd then takes as made by the checkpoint
MLP_RECOMPUTE_WITH_BIAS = (
    "--recompute-modules mlp needs --disable-bias-linear: megatron-core's MLP checkpoint returns the "
    "linear_fc2 bias parameter as one of its outputs, so every later use of the bias runs through "
    "that checkpoint's backward again (a recursion that never ends, stock megatron-core alike)")


LAYERNORM_RECOMPUTE_WITHOUT_TE = (
    "--recompute-modules layernorm needs Transformer Engine, which is not installed: megatron-core's "
    "CheckpointWithoutOutput calls its FP8GlobalStateManager whatever the fp8 setting (a NameError "
    "in the first forward, stock megatron-core alike)")


def te_installed() -> bool:
    """Whether megatron-core found Transformer Engine (its checkpoint module imported it)."""
    from megatron.core.tensor_parallel import random as tp_random

    return hasattr(tp_random, "FP8GlobalStateManager")


def check_recompute(args, layers: int) -> None:
    """Megatron-LM's checks of the recompute flags, plus the one megatron-core leaves to an
    IndexError in the forward (uniform chunks that do not divide the layers)."""
    if getattr(args, "recompute_activations", False):
        args.recompute_granularity = "selective"
    g, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if g is None:
        if method is not None or n is not None:
            _err("--recompute-method and --recompute-num-layers need --recompute-granularity full")
        return
    if g == "selective":
        if method is not None or n is not None:
            _err("--recompute-method and --recompute-num-layers are for --recompute-granularity full "
                 "(selective recompute takes --recompute-modules)")
        if "mlp" in (args.recompute_modules or ()) and not getattr(args, "disable_bias_linear", True):
            _err(MLP_RECOMPUTE_WITH_BIAS)
        if "layernorm" in (args.recompute_modules or ()) and not te_installed():
            _err(LAYERNORM_RECOMPUTE_WITHOUT_TE)
        return
    if method is None or n is None:
        _err("--recompute-granularity full needs --recompute-method (uniform or block) and "
             "--recompute-num-layers")
    if not 1 <= n <= layers and not (method == "block" and n == 0):
        _err(f"--recompute-num-layers {n} must be between 1 and the layers per pipeline stage ({layers})")
    if method == "uniform" and layers % n:
        _err(f"--recompute-num-layers {n} must divide the layers per pipeline stage ({layers}) with "
             "--recompute-method uniform (megatron-core's chunks would run past the last layer)")


def recompute_config(args) -> dict:
    """The ``TransformerConfig`` fields of the recompute flags (none given: none)."""
    if not getattr(args, "recompute_granularity", None):
        return {}
    out = dict(recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
               recompute_num_layers=args.recompute_num_layers)
    if args.recompute_modules is not None:
        out["recompute_modules"] = list(args.recompute_modules)
    return out


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    """Parallel sizes, backend and timeout."""
    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages (megatron's 1F1B schedule; layers split evenly)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="the interleaved schedule: layers per model chunk (docs/pipeline.md)")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="the interleaved schedule: model chunks per pipeline rank (docs/pipeline.md)")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--cp-comm-type", default="p2p", help="Megatron-LM's flag; ParaDySe runs 'p2p' (a K/V ring)")
    g.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs="+", default=None)
    g.add_argument("--dynamic-context-parallel", "--hybrid-context-parallel", dest="dynamic_context_parallel",
                   action="store_true",
                   help="Dynamic CP: each micro-batch on a power-of-two group of nodes (TP groups) of the DP x CP "
                        "pool, with its own plan (docs/context_parallel.md); needs --paradyse")
    g.add_argument("--min-dynamic-context-parallel-size", type=int, default=1,
                   help="with --dynamic-context-parallel: the smallest CP size a micro-batch runs at")
    g.add_argument("--max-seqlen-per-dp-cp-rank", type=int, default=None,
                   help="with --dynamic-context-parallel: a cap on the tokens a node holds of a micro-batch")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="process-group timeout (Megatron-LM's default, 10). Only a backstop: a rank "
                        "that fails or dies ends the job within seconds (docs/faults.md); this bounds "
                        "a collective that never completes (a hung rank; on NCCL a rank killed when "
                        "no launcher tears the job down). Legitimate waits inside one collective "
                        "here last seconds (checkpoint shards hashed per rank)")
    g.add_argument("--local-rank", "--local_rank", type=int, default=None)


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """The data source, long documents and the sampler."""
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="one IndexedDataset prefix (PREFIX.bin / PREFIX.idx); one document per sample")
    g.add_argument("--mock-data", action="store_true",
                   help="synthetic documents of long-tailed lengths up to --seq-length")
    g.add_argument("--paradyse-long-docs", choices=("split", "truncate", "skip", "error"), default="split",
                   help="a document longer than --seq-length (or than the longest sequence the "
                        "planner fits in the memory budget): split into chunks (default), "
                        "truncate, skip, or stop with an error naming it")
    g.add_argument("--paradyse-sampler", choices=("megatron", "length"), default="megatron",
                   help="'megatron': Megatron's sequential order; 'length': micro-batches of similar "
                        "lengths, predicted work balanced across data-parallel replicas "
                        "(megatron_paradyse.data.LengthAwareSampler)")
    g.add_argument("--paradyse-sampler-window", type=int, default=8,
                   help="the length-aware sampler sorts and balances within windows of this many steps")
    g.add_argument("--paradyse-pack", choices=("none", "greedy", "balanced"), default="none",
                   help="pack documents into micro-batches of [1, T] tokens with attention inside each "
                        "document (megatron's THD PackedSeqParams): 'greedy' first-fit in stream order, "
                        "'balanced' the data-parallel replicas' predicted step times balanced "
                        "(megatron_paradyse.data.PackScheduler); --global-batch-size counts documents")
    g.add_argument("--paradyse-pack-tokens", type=int, default=None,
                   help="token cap of one pack (default --seq-length); documents longer than half of it "
                        "keep a micro-batch of their own")


def _add_checkpointing_args(p: argparse.ArgumentParser) -> None:
    """Saving and loading."""
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration instead of the tracker's latest")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--ckpt-format", choices=("torch_dist",), default="torch_dist")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and exit cleanly after the iteration that is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit cleanly after the first iteration that ends this many "
                        "minutes after the start (all ranks stop at the same iteration): for wall-time limits")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (any rank), save (with --save) and exit cleanly after the current iteration")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    """The log interval, TensorBoard and wandb (Megatron-LM's names, training/scalars.py), the run report."""
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None,
                   help="write TensorBoard scalars here (last rank): Megatron-LM's tags and paradyse/*")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="also write each step's seconds (iteration-time)")
    g.add_argument("--wandb-project", type=str, default="",
                   help="log the same scalars to wandb (needs pip install wandb and --wandb-exp-name)")
    g.add_argument("--wandb-exp-name", type=str, default="")
    g.add_argument("--wandb-save-dir", type=str, default="",
                   help="wandb's local folder (default: SAVE/wandb with --save, else ./wandb)")
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="every N iterations, --eval-iters global batches of the validation split "
                        "run forward-only (Megatron-LM's validation loss and PPL line); 0: none")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="global batches of each validation (and of the final test); 0: no validation")
    g.add_argument("--split", type=str, default="969, 30, 1",
                   help="train, validation and test proportions of the data (megatron-core's "
                        "document split of --data-path or of the mock corpus)")
    g.add_argument("--paradyse-run-report", type=str, default=None, metavar="DIR",
                   help="measure each step's peak memory, print predicted vs measured time and "
                        "peak per iteration and a summary at the end, and write DIR/run_report.json "
                        "and DIR/run_report.png (length and plan per step)")
    g.add_argument("--paradyse-memory-every", type=int, default=1, metavar="N",
                   help="measure the peak memory on every N-th step only (default 1: every step). On CPU "
                        "the peak comes from a tracker that runs Python on every op (forward+backward "
                        "1.3-1.5x, Adam 5x slower): the other steps' times are then the training's own, "
                        "and the time prediction is compared with them (on GPU the peak is free)")


def _add_ignored_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM flags accepted and ignored (a warning names each one given)."""
    g = p.add_argument_group("accepted for compatibility, no effect")
    for flag, typ in _IGNORED.items():
        g.add_argument(flag, type=typ, default=None, help=argparse.SUPPRESS)
    for flag in _IGNORED_SWITCHES:
        g.add_argument(flag, action="store_true", help=argparse.SUPPRESS)


def add_planner_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The planner's flags (megatron_paradyse.planner); this trainer only, so ``--paradyse-plan``
    defaults to None here: ``--paradyse`` without a plan means the planner chooses."""
    g = parser.add_argument_group("ParaDySe planner", "each micro-batch's per-layer plan from the cost model")
    g.add_argument("--paradyse-planner", choices=("heuristic", "optimal"), default=None,
                   help="the planner (default 'optimal' when --paradyse is given without "
                        "--paradyse-plan): 'optimal' = the exact fastest plan under the budget; "
                        "'heuristic' = the paper's algorithm with its reference code's bugs fixed")
    g.add_argument("--paradyse-cp-links", default=None, metavar="INTRA,INTER",
                   help="with --context-parallel-size > 1: the in-node and across-node link classes the "
                        "planner prices the CP ring with, names from costmodel/configs/interconnects.json "
                        "(default: cpu_gloo,cpu_gloo on gloo ranks, nvlink4,ib_ndr on GPUs)")
    g.add_argument("--paradyse-memory-margin", type=float, default=None,
                   help="GiB of the budget kept free (default 10%% of the budget on GPU: allocator "
                        "fragmentation, NCCL/cuBLAS workspaces; 5%% on CPU: the cost model's error)")
    g.add_argument("--paradyse-gamma", type=float, default=None,
                   help="hysteresis: keep the previous plan while it fits and is at most this much "
                        "slower (default 0.05 heuristic, 0 optimal)")
    g.add_argument("--paradyse-on-no-fit", choices=("error", "skip", "truncate"), default="error",
                   help="a micro-batch no plan fits: stop with the numbers (default), skip it (no "
                        "loss, no gradient) or truncate it to the longest length that fits, with a "
                        "warning; decided identically on every rank before the step")
    g.add_argument("--paradyse-calibrate", action="store_true", default=None,
                   help="rescale the cost model's times to this host at start-up: every strategy's layer "
                        "timed at --seq-length and a quarter of it (the profiler's code; about half a "
                        "minute on a CPU at p = 4, seconds on GPUs), before the run's model is built; for a "
                        "model profiled on another host or node (python -m megatron_paradyse.costmodel "
                        "calibrate does the same offline)")
    g.add_argument("--paradyse-refine", choices=("auto", "on", "off"), default="auto",
                   help="correct predictions with measured step times and peaks (one small "
                        "all-reduce per step): 'auto' = on with CUDA, off on CPU (CPU timings of "
                        "ranks sharing cores measure the CPU, not the strategies)")
    parser.set_defaults(paradyse_plan=None)
    return parser


def parse_args(argv=None, world_size: int | None = None, validate: bool = True) -> argparse.Namespace:
    """Parse and (by default) validate; ``world_size`` defaults to ``$WORLD_SIZE`` (1)."""
    args = build_parser().parse_args(argv)
    if validate:
        validate_args(args, world_size)
    return args


def _err(msg: str):
    raise ArgumentError(msg)


def validate_args(args, world_size: int | None = None) -> argparse.Namespace:
    """Check and complete ``args`` in place; every check is local (no collective)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    tp = args.tensor_model_parallel_size
    _check_parallel(args, world_size)
    _check_backend(args)
    _check_batches(args, world_size, tp)
    _check_interleaved(args)
    _check_data(args)
    _complete_model(args, tp)
    check_recompute(args, args.num_layers // args.paradyse_dims.pp)
    _check_schedule(args)
    if args.paradyse_memory_every < 1:
        _err(f"--paradyse-memory-every must be at least 1, got {args.paradyse_memory_every}")
    _complete_padding(args)
    _check_positions(args)
    _check_outputs(args)
    args.calculate_per_token_loss = True
    _warn_ignored(args)
    # the plan: parsed and checked for this model here, before any collective
    validate_planner_args(args, tp)
    if args.paradyse and args.paradyse_plan is not None:
        check_fixed_plan(args, tp)
    return args


def _check_parallel(args, world_size: int) -> None:
    """The parallel layout: built and checked by ``dims.py`` (the one builder and validator of
    both trainers; its ``LayoutError`` here an ``ArgumentError``) and attached as
    ``args.paradyse_dims``; then what only this trainer needs: PP splits the layers evenly (the
    1F1B schedule), no overlapped parameter gather with
    ``--paradyse``, local layers."""
    _virtual_stages(args)
    try:
        dims = dims_from_args(args, world_size)
        check_layout(dims, paradyse=args.paradyse, seq_length=args.seq_length,
                     interleaving=interleaving_flag(args), pack=args.paradyse_pack,
                     plan_given=args.paradyse_plan is not None, cp_links=args.paradyse_cp_links,
                     dynamic_cp_runs=True, max_seqlen=args.max_seqlen_per_dp_cp_rank,
                     interleaved=True)
    except ValueError as e:
        _err(str(e))
    attach(args, dims)
    args.data_parallel_size = dims.dp
    args.sequence_parallel = dims.sequence_parallel  # as Megatron-LM: nothing to shard with TP = 1
    if args.num_layers % dims.pp:
        _err(f"--num-layers {args.num_layers} must be divisible by --pipeline-model-parallel-size {dims.pp} "
             "(megatron's even split of the layers over the stages)")
    if args.paradyse and args.overlap_param_gather:
        _err(OVERLAP_PARAM_GATHER_WITH_PARADYSE)
    if args.transformer_impl != "local":
        _err("--transformer-impl transformer_engine: this trainer builds megatron-core's local layer spec "
             "(Transformer Engine is not installable here and its layers are not switchable); give "
             "--transformer-impl local or leave the flag out")


def _virtual_stages(args) -> None:
    """``--num-layers-per-virtual-pipeline-stage L`` as Megatron-LM: ``--virtual-pipeline-
    model-parallel-size`` = layers / PP / L (one of the two flags); a size of 1 is no
    interleaving."""
    per, vpp = args.num_layers_per_virtual_pipeline_stage, args.virtual_pipeline_model_parallel_size
    pp = args.pipeline_model_parallel_size
    if per is not None and vpp is not None:
        _err("give one of --num-layers-per-virtual-pipeline-stage and --virtual-pipeline-model-parallel-size")
    if per is not None:
        if per < 1 or args.num_layers % (pp * per):
            _err(f"--num-layers-per-virtual-pipeline-stage {per}: --num-layers {args.num_layers} must be a "
                 f"multiple of it x --pipeline-model-parallel-size {pp}")
        vpp = args.virtual_pipeline_model_parallel_size = args.num_layers // (pp * per)
    if vpp is not None and vpp < 1:
        _err(f"--virtual-pipeline-model-parallel-size must be at least 1, got {vpp}")
    if vpp == 1:
        args.virtual_pipeline_model_parallel_size = None


def _check_interleaved(args) -> None:
    """The interleaved schedule (megatron-core's ``forward_backward_pipelining_with_
    interleaving``): pipeline stages, the layers split evenly over PP x V model chunks, a
    multiple of PP micro-batches per step (megatron's groups of PP micro-batches per chunk;
    packed steps are checked per step by the iterator)."""
    vpp, pp = args.virtual_pipeline_model_parallel_size, args.pipeline_model_parallel_size
    if vpp is None:
        return
    flag = interleaving_flag(args)
    if pp < 2:
        _err(f"{flag} needs --pipeline-model-parallel-size > 1 (the interleaved schedule's model chunks "
             "are pipeline stages)")
    if args.num_layers % (pp * vpp):
        _err(f"--num-layers {args.num_layers} must be divisible by --pipeline-model-parallel-size {pp} x "
             f"--virtual-pipeline-model-parallel-size {vpp} (megatron's even split over the model chunks)")
    if args.paradyse_pack == "none" and args.num_microbatches % pp:
        _err(f"the interleaved schedule runs micro-batches in groups of --pipeline-model-parallel-size {pp}: "
             f"--global-batch-size {args.global_batch_size} gives {args.num_microbatches} micro-batches per "
             f"replica and step, not a multiple of {pp}")


def _check_backend(args) -> None:
    """The backend (the device decision: gloo is the CPU) and what needs CUDA or apex/TE."""
    if args.distributed_backend is None:
        args.distributed_backend = default_backend()
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        _err("--distributed-backend nccl needs CUDA; use gloo on CPU")
    on_cpu = args.distributed_backend == "gloo"  # the device decision (megatron_paradyse.device)
    if args.bf16 and on_cpu:
        _err("--bf16 needs GPUs (the nccl backend): on CPU ranks train in fp32 (drop --bf16)")
    if args.use_distributed_optimizer and on_cpu:
        _err("--use-distributed-optimizer needs CUDA tensors (megatron's type check); on CPU the "
             "plain optimizer is used: drop the flag")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        _err(f"--ddp-bucket-size must be at least 1, got {args.ddp_bucket_size}")
    if args.use_distributed_optimizer and args.load and not args.no_load_optim and not _apex_or_te_adam():
        _err("--load with --use-distributed-optimizer needs apex or Transformer Engine: without them "
             "megatron-core's DistributedOptimizer cannot build the state to load into before its "
             "first step (distrib_optimizer.py, state_dict: assert len(steps) == 1; seen on an H100 "
             "with megatron-core 0.16.1). Install either, or resume with --no-load-optim (the "
             "optimizer's moments restart), or train without --use-distributed-optimizer")
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        _err("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce "
             "(as in Megatron-LM)")


def _check_batches(args, world_size: int, tp: int) -> None:
    """Tokenizer, learning rate and sizes; the global batch completed and split into
    micro-batches per data-parallel replica."""
    if args.tokenizer_type != "NullTokenizer":
        _err(f"--tokenizer-type {args.tokenizer_type}: only NullTokenizer (token-id data) is "
             "supported by this trainer; use Megatron-LM's pretrain() path for text tokenizers")
    if args.lr is None:
        _err("--lr is required")
    if args.micro_batch_size < 1 or args.train_iters < 1 or args.seq_length < 1:
        _err("--micro-batch-size, --train-iters and --seq-length must be positive")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        _err(f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size "
             f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} "
             f"(world {world_size} / TP {tp})")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def _check_data(args) -> None:
    """One data source; the sampler's window; positions for the longest sequence."""
    if bool(args.mock_data) == bool(args.data_path):
        _err("give exactly one of --mock-data and --data-path PREFIX")
    if args.data_path and len(args.data_path) != 1:
        _err("--data-path takes one IndexedDataset prefix here (no weighted blends)")
    if args.paradyse_sampler_window < 1:
        _err("--paradyse-sampler-window must be >= 1")
    _check_packing(args)
    if args.data_path:
        from ..data.datasets import check_index

        check_index(args.data_path[0])  # a missing or corrupt .bin/.idx: DataError, one line
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        _err(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")


def _check_packing(args) -> None:
    """Packed micro-batches: one row each, documents per step, the token cap."""
    if args.paradyse_pack == "none":
        if args.paradyse_pack_tokens is not None:
            _err("--paradyse-pack-tokens needs --paradyse-pack greedy or balanced")
        return
    if not args.paradyse:
        _err("--paradyse-pack needs --paradyse: stock megatron-core's local attention refuses packed "
             "(THD) input; run the stock baseline on the same documents unpacked")
    if args.micro_batch_size != 1:
        _err(f"--paradyse-pack packs documents into one row per micro-batch: --micro-batch-size "
             f"must be 1 (got {args.micro_batch_size})")
    if args.paradyse_sampler != "megatron":
        _err("--paradyse-pack schedules the micro-batches itself: leave --paradyse-sampler at 'megatron'")
    if args.paradyse_pack_tokens is None:
        args.paradyse_pack_tokens = args.seq_length
    if args.paradyse_pack_tokens < 1 or args.paradyse_pack_tokens > args.seq_length:
        _err(f"--paradyse-pack-tokens {args.paradyse_pack_tokens} must be in 1..--seq-length "
             f"{args.seq_length} (documents are at most --seq-length tokens)")


def _complete_model(args, tp: int) -> None:
    """The model flags completed for the chosen device (``model_args.complete_model_args``)."""
    on_cpu = args.distributed_backend == "gloo"
    try:
        args.model_notes = complete_model_args(args, tp, torch.device("cpu" if on_cpu else "cuda"))
    except ModelArgsError as e:
        _err(str(e))


def _check_schedule(args) -> None:
    """The learning-rate schedule, saving and logging intervals."""
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            _err("give one of --lr-warmup-fraction and --lr-warmup-iters (as Megatron-LM)")
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            _err(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be in [0, 1)")
    elif args.lr_warmup_iters >= args.lr_decay_iters:
        _err(f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters {args.lr_decay_iters} "
             f"(--train-iters {args.train_iters} unless given; --lr-warmup-fraction scales with it)")
    if args.min_lr > args.lr:
        _err(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    if args.save_interval is not None and not args.save:
        _err("--save-interval needs --save DIR")
    if args.log_interval < 1:
        _err("--log-interval must be >= 1")
    if args.exit_interval is not None and args.exit_interval <= 0:
        _err(f"--exit-interval must be positive, got {args.exit_interval}")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        _err(f"--exit-duration-in-mins must be positive, got {args.exit_duration_in_mins:g}")
    if args.eval_interval < 0 or args.eval_iters < 0:
        _err(f"--eval-interval {args.eval_interval} and --eval-iters {args.eval_iters} must be >= 0")
    _check_split(args.split)


def _check_split(split: str) -> None:
    """``--split`` as megatron-core parses it: up to three non-negative proportions, not all zero,
    the training one above zero."""
    parts = [x.strip() for x in re.split(r"[,/]", split)]
    try:
        values = [float(x) for x in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or not values[0] > 0:
        _err(f"--split {split!r}: give up to three non-negative proportions for train, validation and "
             "test (e.g. 969,30,1), the training one above zero")


def _complete_padding(args) -> None:
    """Micro-batches padded to the layout's divisor where the sequence is split (TP; 2 x CP x TP
    with context parallelism: two chunks per CP rank), unless ``--paradyse-pad-multiple``."""
    dims = args.paradyse_dims
    if args.paradyse_pad_multiple is None:
        args.paradyse_pad_multiple = default_pad_multiple(dims, args.paradyse)
    try:
        check_pad_multiple(dims, args.paradyse_pad_multiple)
    except ValueError as e:
        _err(str(e))


def _check_positions(args) -> None:
    why = positions_error(args, args.paradyse_pad_multiple)
    if why:
        _err(why)


def positions_error(args, multiple: int) -> str | None:
    """Why learned absolute position embeddings cannot hold every position a micro-batch can
    reach (the longest document padded to ``multiple``, the layout's; else megatron's embedding
    lookup fails mid-step with an IndexError, stock path included); None if they can. Both
    trainers' argument checks."""
    if args.position_embedding_type != "learned_absolute":
        return None
    longest = -(-args.seq_length // multiple) * multiple
    if longest <= args.max_position_embeddings:
        return None
    return (f"--seq-length {args.seq_length} is padded to {longest} (a multiple of {multiple}, the "
            f"sequence-parallel split) but the learned position embeddings hold "
            f"{args.max_position_embeddings} positions: give --max-position-embeddings {longest} "
            f"(or more), or a --seq-length that is a multiple of {multiple}")


def _check_outputs(args) -> None:
    """The folders this run writes into exist (made now) and can be written, before any work."""
    from ..paths import writable_dir

    if args.save:
        writable_dir(args.save, "--save")
    if args.paradyse_run_report:
        writable_dir(args.paradyse_run_report, "--paradyse-run-report")
    check_scalar_args(args, _err)  # the packages --tensorboard-dir and --wandb-project need
    if args.tensorboard_dir:
        writable_dir(args.tensorboard_dir, "--tensorboard-dir")


def _warn_ignored(args) -> None:
    """Rank 0 warns of each Megatron-LM flag given that this trainer accepts and ignores."""
    for flag in list(_IGNORED) + list(_IGNORED_SWITCHES):
        dest = flag.lstrip("-").replace("-", "_")
        if getattr(args, dest) not in (None, False) and int(os.environ.get("RANK", "0")) == 0:
            log.warning(f"{flag} is accepted for compatibility with Megatron-LM scripts and has "
                        "no effect in this trainer")


def check_fixed_plan(args, tp: int, error=ArgumentError, config=None) -> None:
    """``--paradyse-plan`` parsed for ``args.num_layers``, and every strategy it names able to run
    this model over TP = ``tp``; else ``error`` (the caller's exception type) naming the flag.
    ``config``: the model's ``TransformerConfig`` (default: built from this parser's flags)."""
    try:
        rule = parse_plan(args.paradyse_plan, args.num_layers)
    except ValueError as e:
        raise error(f"--paradyse-plan {args.paradyse_plan!r}: {e}") from None
    if config is None:
        config = transformer_config_from_args(args)
    for name in sorted({strategy_of(e) for e in rule.strategies()}):
        ok, why = supports(name, config, tp)
        if not ok:
            raise error(f"--paradyse-plan uses {name!r}, which cannot run this model over "
                        f"TP={tp}: {why}")


def _apex_or_te_adam() -> bool:
    """Whether megatron-core's distributed optimizer runs on apex's or TE's Adam (its
    ``HAVE_APEX_OR_TE``), whose state it can save and load before a first step."""
    try:
        from megatron.core.optimizer import distrib_optimizer
    except ImportError:
        return False
    return bool(getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False))


def validate_planner_args(args, tp: int, config=None) -> None:
    """The planner's flags (local checks); sets ``args.paradyse_planner`` when the planner runs.

    ``config``: the model's ``TransformerConfig`` (default: built from this parser's flags;
    Megatron-LM's entry point passes its own).
    """
    planner_flags = ("paradyse_planner", "paradyse_memory_margin", "paradyse_gamma", "paradyse_calibrate")
    given = [f for f in planner_flags if getattr(args, f, None) is not None]
    if not hasattr(args, "paradyse_planner"):  # a parser without add_planner_args
        if getattr(args, "paradyse_plan", None) is None:
            args.paradyse_plan = "tp_sp"
        return
    if not args.paradyse:
        if given:
            _err(f"--{given[0].replace('_', '-')} needs --paradyse")
        return
    if args.paradyse_plan is not None:
        if given:
            _err(f"--{given[0].replace('_', '-')} is for the planner; with --paradyse-plan the plan "
                 "is fixed: give one or the other")
        return
    if args.paradyse_planner is None:
        args.paradyse_planner = "optimal"
    if args.paradyse_cost_model is not None:
        check_cost_model(args)
    if args.paradyse_memory_budget is not None and not args.paradyse_memory_budget > 0:
        _err(f"--paradyse-memory-budget {args.paradyse_memory_budget} must be positive (GiB per rank)")
    if args.paradyse_memory_margin is not None:
        if args.paradyse_memory_margin < 0:
            _err("--paradyse-memory-margin must be >= 0 (GiB)")
        if args.paradyse_memory_budget is not None and args.paradyse_memory_margin >= args.paradyse_memory_budget:
            _err(f"--paradyse-memory-margin {args.paradyse_memory_margin} GiB must be below the budget "
                 f"{args.paradyse_memory_budget} GiB")
    if args.paradyse_gamma is not None and args.paradyse_gamma < 0:
        _err("--paradyse-gamma must be >= 0")
    if config is None:
        config = transformer_config_from_args(args)
    why = {n: supports(n, config, tp) for n in STRATEGIES}
    args.paradyse_planner_strategies = tuple(n for n in STRATEGIES if why[n][0])
    if not args.paradyse_planner_strategies:
        _err(f"no ParaDySe strategy can run this model over TP={tp}: "
             + "; ".join(f"{n}: {r}" for n, (_, r) in why.items()))


def check_cost_model(args) -> None:
    """``--paradyse-cost-model`` loads and was made for this model's shape (else its
    ``CostModelFileError``, a user's mistake naming the file and what differs)."""
    from ..costmodel import ModelShape
    from ..costmodel.fitted import CostModelFileError, FittedCostModel

    try:
        shape = shape_from_args(args)
    except ValueError:  # Megatron-LM's args before its tokenizer pads the vocabulary
        shape = None
    try:
        FittedCostModel.load(args.paradyse_cost_model, shape)
    except CostModelFileError as e:
        _err(f"--paradyse-cost-model: {e}")


def default_memory_budget_gib() -> float:
    """The planner's default budget, GiB: what this rank's device can really hand out
    (``megatron_paradyse.device.usable_memory_bytes``: on GPU free + torch-reserved memory
    less a reserve for NCCL/cuBLAS buffers made later, measured when the planner is built,
    after the model and optimizer; on CPU the host's memory divided by the node's ranks)."""
    return usable_memory_bytes() / GiB


def transformer_config_from_args(args, **overrides):
    """megatron-core's ``TransformerConfig`` for the parsed flags, recompute included (no collective)."""
    return transformer_config(model_flags(args), dims_of(args), **{**recompute_config(args), **overrides})
