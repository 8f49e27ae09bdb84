"""The entry point's flags in Megatron-LM's parser (an ``extra_args_provider``) and their checks
inside Megatron-LM's ``validate_args``."""
from __future__ import annotations

import logging
import os

from ..arguments import _check_cp_links as check_cp_links  # the trainer's check of the same flag
from ..arguments import (LAYERNORM_RECOMPUTE_WITHOUT_TE, MLP_RECOMPUTE_WITH_BIAS,
                         OVERLAP_PARAM_GATHER_WITH_PARADYSE, te_installed, add_paradyse_args, add_planner_args,
                         check_fixed_plan, positions_error, validate_planner_args)


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
    return parser


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

    Local (no collective): runs on every rank inside Megatron-LM's ``validate_args``.
    """
    if getattr(args, "paradyse_document_data", False):  # absent where the script added the flags
        _check_document_data(args)
    elif getattr(args, "paradyse_pack", "none") != "none":
        raise ValueError("--paradyse-pack needs --paradyse-document-data (the packs are built from its documents)")
    if not getattr(args, "paradyse", False):
        return
    _check_switchable(args)
    _check_plan_or_planner(args)


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


# Megatron-LM's flags for the interleaved schedule (validate_args turns each into
# args.virtual_pipeline_model_parallel_size, None for one stage per rank)
VIRTUAL_PIPELINE_FLAGS = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                          "pipeline_model_parallel_layout")


def virtual_pipeline_error(args) -> str:
    """The refusal of the interleaved schedule, naming the flag given."""
    given = [k for k in VIRTUAL_PIPELINE_FLAGS if getattr(args, k, None) is not None]
    flag = "--" + (given[0] if given else VIRTUAL_PIPELINE_FLAGS[0]).replace("_", "-")
    return (f"{flag} selects the interleaved (virtual-pipeline) schedule, which --paradyse does not "
            f"support: only megatron's 1F1B schedule (one stage per pipeline rank) is supported "
            f"with --pipeline-model-parallel-size (drop {flag})")


def layout_unit(args) -> int:
    """What every micro-batch's length must be a multiple of: TP, or with context parallelism
    2 x CP x TP (each CP rank holds two equal chunks, each sequence-sharded over TP)."""
    tp, cp = args.tensor_model_parallel_size, getattr(args, "context_parallel_size", 1) or 1
    return 2 * cp * tp if cp > 1 else tp


def pad_multiple(args) -> int:
    """The multiple the forward step pads each micro-batch's length to (``--paradyse-pad-multiple``,
    else :func:`layout_unit`)."""
    return getattr(args, "paradyse_pad_multiple", None) or layout_unit(args)


def _check_context_parallel(args, tp: int) -> None:
    """``--context-parallel-size C > 1`` with ``--paradyse``: every strategy attends across the CP
    ranks itself (megatron's local attention cannot), with K/V on a ring (megatron's 'p2p'), one CP
    level, no pipeline stages, sequences in 2 x C x TP equal pieces. The forward step reads the
    whole micro-batch and runs this CP rank's chunks (``get_batch_on_this_cp_rank``'s); a pack's
    boundaries stay the whole pack's."""
    cp = args.context_parallel_size
    if int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        raise ValueError(f"--context-parallel-size {cp} with --pipeline-model-parallel-size "
                         f"{args.pipeline_model_parallel_size} is not supported with --paradyse (give one of them)")
    comm = getattr(args, "cp_comm_type", None) or ["p2p"]
    comm = [comm] if isinstance(comm, str) else list(comm)
    if any(c != "p2p" for c in comm):
        raise ValueError(f"--cp-comm-type {' '.join(comm)}: with --paradyse every strategy passes K/V on a ring "
                         "over the CP group (megatron's p2p); give --cp-comm-type p2p or leave the flag out")
    if getattr(args, "hierarchical_context_parallel_sizes", None):
        raise ValueError("--hierarchical-context-parallel-sizes is not supported with --paradyse: one CP ring "
                         "(drop the flag)")
    if getattr(args, "hybrid_context_parallel", False):
        raise ValueError("--hybrid-context-parallel is not supported with --paradyse: every micro-batch is "
                         "split over all --context-parallel-size ranks (drop the flag)")
    if getattr(args, "paradyse_pack", "none") != "none" and getattr(args, "paradyse_plan", None) is None:
        raise ValueError("--paradyse-pack with --context-parallel-size > 1 needs --paradyse-plan: the planner's "
                         "CP cost model prices one sequence per row, not packs (give a plan or rule, or drop "
                         "--paradyse-pack)")
    if getattr(args, "paradyse_cp_links", None) is not None:
        check_cp_links(args.paradyse_cp_links)
    unit = 2 * cp * tp
    if args.seq_length % unit:
        raise ValueError(f"--seq-length {args.seq_length} must be a multiple of 2 x --context-parallel-size x "
                         f"--tensor-model-parallel-size = {unit} with --paradyse: each CP rank holds two "
                         "equal chunks, each split over TP")
    if not getattr(args, "calculate_per_token_loss", False) and int(os.environ.get("RANK", "0")) == 0:
        log.warning(f"> warning: {CP_LOSS_NOTE}")


def _check_switchable(args) -> None:
    """Megatron-LM's flags under which the strategies can switch: the TP+SP layout, pipeline
    stages only with the 1F1B schedule, context parallelism as :func:`_check_context_parallel`
    says, local layers, no dropout, no overlapped parameter gather."""
    if args.overlap_param_gather:
        raise ValueError(OVERLAP_PARAM_GATHER_WITH_PARADYSE)
    tp = args.tensor_model_parallel_size
    if tp > 1 and not args.sequence_parallel:
        raise ValueError("--paradyse needs --sequence-parallel: every strategy keeps the "
                         "[s/p, b, h] sequence-parallel layout between layers")
    if args.context_parallel_size > 1:
        _check_context_parallel(args, tp)
    # Megatron-LM's validate_args has turned every interleaving flag into this one
    if getattr(args, "virtual_pipeline_model_parallel_size", None) is not None:
        raise ValueError(virtual_pipeline_error(args))
    if args.transformer_impl != "local":
        raise ValueError("--paradyse needs --transformer-impl local (the strategies run "
                         "megatron-core's local layer modules; Transformer Engine layers are not "
                         "switchable)")
    if args.hidden_dropout or args.attention_dropout:
        raise ValueError("--paradyse needs --hidden-dropout 0 --attention-dropout 0")
    unit = layout_unit(args)
    if args.paradyse_pad_multiple is not None and (
            args.paradyse_pad_multiple < 1 or args.paradyse_pad_multiple % unit):
        what = (f"2 x --context-parallel-size x --tensor-model-parallel-size = {unit}"
                if args.context_parallel_size > 1 else f"--tensor-model-parallel-size {tp}")
        raise ValueError(f"--paradyse-pad-multiple {args.paradyse_pad_multiple} must be a positive "
                         f"multiple of {what}")
    if args.context_parallel_size > 1 and args.paradyse_pad_multiple is None:
        args.paradyse_pad_multiple = unit  # 2 x CP x TP, for every reader (data, planner) as in the trainer
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
    layers = args.num_layers // max(1, args.pipeline_model_parallel_size)
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
