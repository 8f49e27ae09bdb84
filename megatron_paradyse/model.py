"""The stock GPT that training, the profiler and the check build: one set of model flags, one
``TransformerConfig``, one layer spec, one builder.

The profiler must measure the layer training runs, so both build through here from the same
Megatron-LM flag names (fusions included). The layer spec is megatron-core's local spec; with
sequence parallelism its norms are the plugin's sequence-parallel torch norm
(:class:`megatron_paradyse.norms.SPTorchNorm`) for LayerNorm and RMSNorm alike,
decided by the configuration and never by what is installed: megatron's local spec picks
apex's ``FusedLayerNorm`` for LayerNorm where apex exists and ``WrappedTorchNorm`` (which
refuses sequence parallelism) for RMSNorm on every image.

Fusions follow Megatron-LM's switches and defaults on CUDA; one whose kernel is not installed
(RoPE fusion needs Transformer Engine, gradient-accumulation fusion apex's
``fused_weight_gradient_mlp_cuda``, masked-softmax fusion megatron's
``scaled_masked_softmax_cuda``) is turned off and said so (:func:`complete_model_args`
returns the notes). On the CPU every fusion is off (megatron's fused kernels are CUDA or
``torch.compile`` code).
"""
from __future__ import annotations

import argparse
import importlib.util

import torch
import torch.nn.functional as F

from .device import current as current_device
from .errors import UserError
from .norms import SPTorchNorm

# Megatron-LM's fusion switches: flag -> (args attribute, TransformerConfig field)
FUSION_SWITCHES = {
    "--no-masked-softmax-fusion": ("masked_softmax_fusion", "masked_softmax_fusion"),
    "--no-bias-gelu-fusion": ("bias_gelu_fusion", None),
    "--no-bias-swiglu-fusion": ("bias_swiglu_fusion", None),
    "--no-bias-dropout-fusion": ("bias_dropout_fusion", "bias_dropout_fusion"),
    "--no-rope-fusion": ("apply_rope_fusion", "apply_rope_fusion"),
    "--no-gradient-accumulation-fusion": ("gradient_accumulation_fusion", "gradient_accumulation_fusion"),
    "--no-persist-layer-norm": ("persist_layer_norm", None),
}


class ModelArgsError(UserError, ValueError):
    """A bad model flag or combination, found before anything is built."""


def add_model_args(parser: argparse.ArgumentParser, defaults: dict | None = None) -> argparse.ArgumentParser:
    """The model's flags as Megatron-LM names them. ``defaults`` makes the required ones optional
    (the profiler's demo shape); without it ``--num-layers``, ``--hidden-size`` and
    ``--num-attention-heads`` are required (the trainer)."""
    d = defaults or {}
    req = defaults is None
    g = parser.add_argument_group("model (Megatron-LM flag names)")
    g.add_argument("--num-layers", type=int, required=req, default=d.get("num_layers"))
    g.add_argument("--hidden-size", type=int, required=req, default=d.get("hidden_size"))
    g.add_argument("--ffn-hidden-size", type=int, default=d.get("ffn_hidden_size"),
                   help="default 4*hidden (SwiGLU: int(4*hidden*2/3 / 64) * 64, as Megatron-LM)")
    g.add_argument("--num-attention-heads", type=int, required=req, default=d.get("num_attention_heads"))
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=d.get("num_query_groups", 1))
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "none"),
                   default=d.get("position_embedding_type", "learned_absolute"))
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=d.get("hidden_dropout", 0.1))
    g.add_argument("--attention-dropout", type=float, default=d.get("attention_dropout", 0.1))
    g.add_argument("--vocab-size", type=int, default=d.get("vocab_size"),
                   help="token ids are 0 .. vocab-size-1 (Megatron-LM's NullTokenizer)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--use-cpu-initialization", action="store_true")
    for flag, (dest, _) in FUSION_SWITCHES.items():
        g.add_argument(flag, dest=dest, action="store_false",
                       help="Megatron-LM's fusion switch (on by default on CUDA where its kernel is "
                            "installed; every fusion is off on the CPU)")
    return parser


def complete_model_args(args, tp: int, device: torch.device | None = None) -> list:
    """Derived values and local checks of the model flags, in place; returns notes (fusions
    turned off, and why) for the log. Raises :class:`ModelArgsError` naming the flags."""
    device = device or current_device()
    if args.hidden_size % args.num_attention_heads and args.kv_channels is None:
        raise ModelArgsError("--hidden-size must be divisible by --num-attention-heads (or give --kv-channels)")
    if args.num_attention_heads % tp:
        raise ModelArgsError(f"--num-attention-heads {args.num_attention_heads} must be divisible by "
                             f"--tensor-model-parallel-size {tp}")
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups or args.num_query_groups % tp:
        raise ModelArgsError(f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads "
                             f"and be divisible by --tensor-model-parallel-size {tp}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
    if args.ffn_hidden_size % tp:
        raise ModelArgsError(f"--ffn-hidden-size {args.ffn_hidden_size} must be divisible by TP {tp}")
    if args.vocab_size is None or args.vocab_size < 2:
        raise ModelArgsError("--vocab-size is required (token ids are 0 .. vocab-size-1)")
    mult = args.make_vocab_size_divisible_by * tp
    args.padded_vocab_size = -(-args.vocab_size // mult) * mult
    if args.fp16:
        raise ModelArgsError("--fp16 is not supported (its loss scaler needs apex); use --bf16 or fp32")
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float32
    if device.type == "cpu":
        args.use_cpu_initialization = True
    return _complete_fusions(args, device)


def _complete_fusions(args, device) -> list:
    """Megatron-LM's fusion defaults on CUDA, minus those whose kernel is missing; none on CPU."""
    if device.type == "cpu":
        for dest, _ in FUSION_SWITCHES.values():
            setattr(args, dest, False)
        return ["fusions: off on the CPU"]
    notes = []
    act = "bias_swiglu_fusion" if args.swiglu else "bias_gelu_fusion"
    if getattr(args, act) and not args.swiglu and args.disable_bias_linear:
        setattr(args, act, False)  # as Megatron-LM: no bias, no bias-GELU fusion
    if args.apply_rope_fusion and (args.position_embedding_type != "rope" or not _have_te_rope()):
        if args.position_embedding_type == "rope":
            notes.append("RoPE fusion off: it needs Transformer Engine (--no-rope-fusion silences this)")
        args.apply_rope_fusion = False
    if args.masked_softmax_fusion and not _importable("scaled_masked_softmax_cuda"):
        notes.append("masked-softmax fusion off: it needs megatron's scaled_masked_softmax_cuda "
                     "extension (--no-masked-softmax-fusion silences this)")
        args.masked_softmax_fusion = False
    if args.gradient_accumulation_fusion and not have_grad_accum_fusion():
        notes.append("gradient-accumulation fusion off: it needs apex's fused_weight_gradient_mlp_cuda "
                     "(--no-gradient-accumulation-fusion silences this)")
        args.gradient_accumulation_fusion = False
    args.persist_layer_norm = False  # apex's persistent LayerNorm kernel; the torch norms have none
    on = [n for n, v in (("masked-softmax", args.masked_softmax_fusion), ("bias-activation", getattr(args, act)),
                         ("bias-dropout", args.bias_dropout_fusion), ("rope", args.apply_rope_fusion),
                         ("gradient-accumulation", args.gradient_accumulation_fusion)) if v]
    return [f"fusions on: {', '.join(on) or 'none'}"] + notes


def _have_te_rope() -> bool:
    try:
        from megatron.core.models.common.embeddings.rope_utils import fused_apply_rotary_pos_emb
    except ImportError:
        return False
    return fused_apply_rotary_pos_emb is not None


def have_grad_accum_fusion() -> bool:
    """Whether megatron's fused weight-gradient accumulation kernel (apex) is installed."""
    return _importable("fused_weight_gradient_mlp_cuda")


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def transformer_config(args, **overrides):
    """megatron-core's ``TransformerConfig`` for completed model flags (no collective)."""
    from megatron.core.transformer import TransformerConfig

    tp = args.tensor_model_parallel_size
    kw = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear, normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon, init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=tp, sequence_parallel=bool(args.sequence_parallel and tp > 1),
        use_cpu_initialization=args.use_cpu_initialization,
        params_dtype=args.params_dtype, bf16=args.bf16, pipeline_dtype=args.params_dtype,
        calculate_per_token_loss=True,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion, masked_softmax_fusion=args.masked_softmax_fusion,
        persist_layer_norm=False, gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        apply_rope_fusion=args.apply_rope_fusion,
    )
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    kw.update(pipeline_model_parallel_size=pp,
              context_parallel_size=int(getattr(args, "context_parallel_size", 1) or 1))
    kw.update(overrides)
    config = TransformerConfig(**kw)
    if pp > 1:
        # each micro-batch's p2p shape follows its length (training/p2p_shapes.py supplies them);
        # set after the checks, which refuse it with the default MoE dispatcher of a dense model
        config.variable_seq_lengths = True
    return config


def layer_spec(config):
    """megatron-core's local GPT layer spec; with sequence parallelism, the SP torch norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    if not config.sequence_parallel:
        return spec
    spec.submodules.input_layernorm = SPTorchNorm
    spec.submodules.pre_mlp_layernorm = SPTorchNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * stage_layers(config), layer_norm=SPTorchNorm)


def stage_layers(config) -> int:
    """Decoder layers this pipeline stage builds (megatron's own count; all of them without PP)."""
    if config.pipeline_model_parallel_size == 1:
        return config.num_layers
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    return get_num_layers_to_build(config)


def pipeline_ends() -> tuple:
    """``(pre_process, post_process)`` of this rank's pipeline stage: the embedding lives on the
    first stage, the output layer and loss on the last (both without PP)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return True, True
    return parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()


def build_gpt(config, vocab_size: int, max_sequence_length: int, *, position_embedding_type="rope",
              rotary_percent=1.0, rotary_base=10000, share_embeddings_and_output_weights=False,
              seed: int | None = None, device=None):
    """The stock ``GPTModel`` for ``config`` on ``device`` (default: this process's device),
    unwrapped; with pipeline stages (``config.pipeline_model_parallel_size``) this rank's
    stage. ``seed`` seeds torch first: with ``use_cpu_initialization`` every rank draws
    the same full master weights, so any TP size holds shards of the same model."""
    from megatron.core.models.gpt import GPTModel

    if seed is not None:
        torch.manual_seed(seed)
    pre, post = pipeline_ends() if config.pipeline_model_parallel_size > 1 else (True, True)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(config), vocab_size=vocab_size,
        max_sequence_length=max_sequence_length, pre_process=pre, post_process=post,
        parallel_output=True, share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type, rotary_percent=rotary_percent,
        rotary_base=rotary_base,
    )
    device = torch.device(device) if device is not None else current_device()
    if device.type != "cpu":
        model.to(device)
    return model


def build_gpt_from_args(args, config):
    """:func:`build_gpt` for completed model flags, wrapped in ``Float16Module`` for bf16 (as
    Megatron-LM)."""
    model = build_gpt(config, args.padded_vocab_size, args.max_position_embeddings,
                      position_embedding_type=args.position_embedding_type,
                      rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                      share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                      seed=args.seed)
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model
