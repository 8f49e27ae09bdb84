"""The entry point's flags in Megatron-LM's parser (an ``extra_args_provider``) and their checks
inside Megatron-LM's ``validate_args``."""
from __future__ import annotations

import logging
import os

from ..arguments import (LAYERNORM_RECOMPUTE_WITHOUT_TE, MLP_RECOMPUTE_WITH_BIAS,
                         OVERLAP_PARAM_GATHER_WITH_PARADYSE, te_installed, add_paradyse_args, add_planner_args,
                         check_fixed_plan, positions_error, validate_planner_args)
from ..dims import attach, check_layout, check_pad_multiple, dims_from_args, dims_of, interleaving_flag


log = logging.getLogger(__name__)

CP_LOSS_NOTE = (
    "--context-parallel-size > 1 without --calculate-per-token-loss: megatron-core divides each CP rank's "
    "loss by that rank's own loss-bearing tokens (as stock Megatron-LM's CP does), which differs from the "
    "run without CP when the CP ranks hold different numbers of them (padding); give "
    "--calculate-per-token-loss for the per-token mean over the whole global batch")


def add_megatron_lm_args(parser):
    """Megatron-LM ``extra_args_provider``: the plugin's flags, plus the entry point's data flag."""
    if "--paradyse" in getattr(parser, "_option_string_actions", {}):
        return parser  # a script that already adds them (e.g. through paradyse_args_provider)
    add_paradyse_args(parser)
    add_planner_args(parser)
    g = parser.add_argument_group("ParaDySe data (Megatron-LM entry point)")
    g.add_argument("--paradyse-document-data", action="store_true",
                   help="Replace the script's datasets with one document per sample, padded to "
                        "--seq-length with a zero loss mask (--mock-data: synthetic documents of "
                        "log-uniform lengths; --data-path PREFIX: an IndexedDataset's documents). "
                        "Works with and without --paradyse; the ParaDySe forward step cuts each "
                        "micro-batch after its last real token (rounded up to the TP size).")
    g.add_argument("--paradyse-pack", choices=("none", "greedy"), default="none",
                   help="with --paradyse-document-data --paradyse: each sample packs consecutive "
                        "documents up to --seq-length tokens (never splitting one), attention inside "
                        "each document (megatron's THD); Megatron-LM's sampler deals the packs "
                        "(pretrain_gpt_paradyse.py also has 'balanced' packing)")
    _add_dynamic_cp_names(parser)
    return parser


def _add_dynamic_cp_names(parser) -> None:
    """Megatron's Dynamic CP flag names that this Megatron-LM's parser lacks (core_v0.16.1 and
    core_v0.19.0 have ``--hybrid-context-parallel`` and ``--max-seqlen-per-dp-cp-rank``, from
    megatron-core's ``ModelParallelConfig``, not the other two)."""
    have = getattr(parser, "_option_string_actions", {})
    g = parser.add_argument_group("Dynamic CP (Megatron's names this Megatron-LM lacks)")
    if "--dynamic-context-parallel" not in have:
        g.add_argument("--dynamic-context-parallel", action="store_true",
                       help="with --paradyse: Dynamic CP, as --hybrid-context-parallel (each micro-batch on a "
                            "power-of-two block of the DP pool's nodes, its own plan; docs/context_parallel.md)")
    if "--min-dynamic-context-parallel-size" not in have:
        g.add_argument("--min-dynamic-context-parallel-size", type=int, default=1,
                       help="with --dynamic-context-parallel: the smallest CP size a micro-batch runs at")
    if "--max-seqlen-per-dp-cp-rank" not in have:
        g.add_argument("--max-seqlen-per-dp-cp-rank", type=int, default=None,
                       help="with --dynamic-context-parallel: a cap on the tokens a node holds of a micro-batch")


def compose_args_providers(first, second=add_megatron_lm_args):
    """An ``extra_args_provider`` running ``first`` (may be None) then ``second``."""
    if first is None:
        return second

    def provider(parser):
        parser = first(parser) or parser
        return second(parser) or parser

    return provider


def check_paradyse_args(args) -> None:
    """Check the ParaDySe flags against Megatron-LM's parsed ``args``; ValueError naming the flags.

    Local (no collective): runs on every rank inside Megatron-LM's ``validate_args``. The
    parallel layout is built here once (``dims.py``) and attached beside ``args`` (which
    Megatron-LM pickles into its checkpoints).
    """
    attach(args, dims_from_args(args), in_namespace=False)
    if getattr(args, "paradyse_document_data", False):  # absent where the script added the flags
        _check_document_data(args)
    elif getattr(args, "paradyse_pack", "none") != "none":
        raise ValueError("--paradyse-pack needs --paradyse-document-data (the packs are built from its documents)")
    if not getattr(args, "paradyse", False):
        _refuse_stock_dynamic_cp(args)
        return
    _check_switchable(args)
    if dims_of(args).dynamic_cp:
        _check_dynamic_cp(args)
    _check_plan_or_planner(args)


DYNAMIC_CP_FLAGS = ("dynamic_context_parallel", "hybrid_context_parallel")


def dynamic_cp_flag(args) -> str | None:
    """The Dynamic CP flag given (``--dynamic-context-parallel`` or ``--hybrid-context-parallel``), else None."""
    given = [k for k in DYNAMIC_CP_FLAGS if getattr(args, k, False)]
    return "--" + given[0].replace("_", "-") if given else None


def check_dynamic_cp_early(args) -> None:
    """Before Megatron-LM's own ``validate_args`` (whose assertions on ``--hybrid-context-parallel``
    would print a traceback): the Dynamic CP layout as ``dims.py`` checks it, one line."""
    if dynamic_cp_flag(args) is None or not getattr(args, "paradyse", False):
        return
    try:
        dims = dims_from_args(args)
    except ValueError:
        return  # Megatron-LM's own check of the sizes says it
    check_layout(dims, paradyse=bool(getattr(args, "paradyse", False)), dynamic_cp_runs=True,
                 per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)),
                 max_seqlen=getattr(args, "max_seqlen_per_dp_cp_rank", None),
                 pack=getattr(args, "paradyse_pack", "none"))


def _refuse_stock_dynamic_cp(args) -> None:
    """Without --paradyse: the plugin's --dynamic-context-parallel, or Megatron-LM's
    --hybrid-context-parallel on local layers (stock megatron runs it only with Transformer
    Engine's attention; with Transformer Engine the script runs as Megatron-LM ships it)."""
    flag = dynamic_cp_flag(args)
    if flag == "--dynamic-context-parallel" or (flag and getattr(args, "transformer_impl", "local") == "local"):
        raise ValueError(f"{flag} needs --paradyse with --transformer-impl local (stock megatron runs Dynamic CP "
                         "only with Transformer Engine's attention)")


def _check_dynamic_cp(args) -> None:
    """Dynamic CP through Megatron-LM's pretrain() (``megatron_lm/dynamic_cp.py``): the pool is
    Megatron-LM's data parallelism, the documents the plugin's; then Megatron-LM's own Dynamic CP
    (its sampler, data-loader wrapper, schedule and groups) is switched off: the plugin runs it."""
    flag = dynamic_cp_flag(args)
    if args.context_parallel_size > 1:
        raise ValueError(f"{flag} with --context-parallel-size {args.context_parallel_size}: through Megatron-LM's "
                         "pretrain() the Dynamic CP pool is its data parallelism (world / TP nodes); give "
                         "--context-parallel-size 1")
    if not getattr(args, "paradyse_document_data", False):
        raise ValueError(f"{flag} with --paradyse needs --paradyse-document-data (the plugin packs each step's "
                         "documents; Megatron-LM's GPT samples are no documents)")
    args.hybrid_context_parallel = False
    args.dynamic_context_parallel = True


def _check_document_data(args) -> None:
    """``--paradyse-document-data`` reads one source: mock documents or one prefix; packs need
    --paradyse and one row per micro-batch."""
    if getattr(args, "paradyse_pack", "none") != "none":
        if not args.paradyse:
            raise ValueError("--paradyse-pack needs --paradyse: stock megatron-core's local attention "
                             "refuses packed (THD) input")
        if args.micro_batch_size != 1:
            raise ValueError(f"--paradyse-pack packs documents into one row per micro-batch: "
                             f"--micro-batch-size must be 1 (got {args.micro_batch_size})")
    if bool(args.mock_data) == bool(args.data_path):
        raise ValueError("--paradyse-document-data needs exactly one of --mock-data and "
                         "--data-path PREFIX")
    if args.data_path and len(args.data_path) != 1:
        raise ValueError("--paradyse-document-data takes one --data-path prefix (no blends)")


def pad_multiple(args) -> int:
    """The multiple the forward step pads each micro-batch's length to (``--paradyse-pad-multiple``,
    else the layout's divisor: TP, or 2 x CP x TP with context parallelism)."""
    return getattr(args, "paradyse_pad_multiple", None) or dims_of(args).seq_divisor


LAYOUT_WITH_PARADYSE = (
    "--pipeline-model-parallel-layout is not supported with --paradyse (its stages of any layers, the "
    "embedding or the loss alone, are untested with switching): give --num-layers-per-virtual-pipeline-stage "
    "or --num-virtual-stages-per-pipeline-rank for the interleaved schedule, or drop --paradyse")


def _check_switchable(args) -> None:
    """Megatron-LM's flags under which the strategies can switch: the layout as ``dims.py``'s
    validator says (the one of both trainers: the TP+SP layout, pipeline stages only with the
    1F1B or the interleaved schedule, context parallelism on one K/V ring), local layers, no
    dropout, no overlapped parameter gather, no ``--pipeline-model-parallel-layout``."""
    if args.overlap_param_gather:
        raise ValueError(OVERLAP_PARAM_GATHER_WITH_PARADYSE)
    if getattr(args, "pipeline_model_parallel_layout", None) is not None:
        raise ValueError(LAYOUT_WITH_PARADYSE)
    dims = dims_of(args)
    # Megatron-LM's validate_args checked the interleaving flags (PP > 1, the split over the chunks)
    check_layout(dims, paradyse=True, seq_length=getattr(args, "seq_length", None),
                 interleaving=interleaving_flag(args), pack=getattr(args, "paradyse_pack", "none"),
                 plan_given=getattr(args, "paradyse_plan", None) is not None,
                 cp_links=getattr(args, "paradyse_cp_links", None), dynamic_cp_runs=True,
                 per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)),
                 max_seqlen=getattr(args, "max_seqlen_per_dp_cp_rank", None), interleaved=True)
    if dims.cp_on and not getattr(args, "calculate_per_token_loss", False) and int(os.environ.get("RANK", "0")) == 0:
        log.warning(f"> warning: {CP_LOSS_NOTE}")
    if args.transformer_impl != "local":
        raise ValueError("--paradyse needs --transformer-impl local (the strategies run "
                         "megatron-core's local layer modules; Transformer Engine layers are not "
                         "switchable)")
    if args.hidden_dropout or args.attention_dropout:
        raise ValueError("--paradyse needs --hidden-dropout 0 --attention-dropout 0")
    if args.paradyse_pad_multiple is not None:
        check_pad_multiple(dims, args.paradyse_pad_multiple)
    if dims.cp_on and args.paradyse_pad_multiple is None:
        args.paradyse_pad_multiple = dims.seq_divisor  # 2 x CP x TP, for every reader (data, planner) as in the trainer
    why = positions_error(args, pad_multiple(args))
    if why:
        raise ValueError(why)
    _check_recompute(args)


# Megatron-LM's flags for stages of unequal layer counts (each layer keeps its global number)
UNEVEN_SPLIT = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                "pipeline_model_parallel_layout")


def _check_recompute(args) -> None:
    """Megatron-LM's recompute flags that megatron-core itself cannot run (stock alike), named
    before the first step instead of a recursion or a NameError inside it."""
    modules = getattr(args, "recompute_modules", None) or ()
    if getattr(args, "recompute_granularity", None) == "selective":
        if "mlp" in modules and getattr(args, "add_bias_linear", False):
            raise ValueError(MLP_RECOMPUTE_WITH_BIAS)
        if "layernorm" in modules and not te_installed():
            raise ValueError(LAYERNORM_RECOMPUTE_WITHOUT_TE)
    layers = args.num_layers // dims_of(args).pp
    n = getattr(args, "recompute_num_layers", None)
    uneven = any(getattr(args, k, None) for k in UNEVEN_SPLIT)  # megatron-core checks each stage
    if getattr(args, "recompute_method", None) == "uniform" and n and layers % n and not uneven:
        raise ValueError(f"--recompute-num-layers {n} must divide the layers per pipeline stage ({layers}) "
                         "with --recompute-method uniform (megatron-core's chunks would run past the last layer)")


def _check_plan_or_planner(args) -> None:
    """The planner's flags, or ``--paradyse-plan`` checked for this model (its strategies'
    support on Megatron-LM's own ``TransformerConfig``)."""
    from megatron.training.arguments import core_transformer_config_from_args

    tp = args.tensor_model_parallel_size
    config = core_transformer_config_from_args(args)
    validate_planner_args(args, tp, config)  # the planner's flags; an error if given with a plan
    if args.paradyse_plan is None:
        if args.paradyse_calibrate:
            raise ValueError("--paradyse-calibrate runs in pretrain_gpt_paradyse.py's trainer; through "
                             "Megatron-LM's pretrain() calibrate first (python -m megatron_paradyse.costmodel "
                             "calibrate MODEL -o HERE.json) and give --paradyse-cost-model HERE.json")
        if args.paradyse_refine == "on":
            raise ValueError("--paradyse-refine on is not available through Megatron-LM's pretrain(): "
                             "its step loop feeds no measured step back to the planner (use "
                             "pretrain_gpt_paradyse.py, or leave --paradyse-refine at auto/off)")
        return  # the planner chooses each micro-batch's plan (paradyse_planner_strategies: usable)
    check_fixed_plan(args, tp, ValueError, config)
