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
``scaled_masked_softmax_cuda``) is turned off and said so (:func:`complete_model` records
the notes). On the CPU every fusion is off (megatron's fused kernels are CUDA or
``torch.compile`` code).
"""
from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from .device import current as current_device
from .errors import UserError
from .layout import ParallelDims
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


@dataclass(frozen=True)
class ModelFlags:
    """The model's flags (:func:`add_model_args`'s, by their ``argparse`` names), typed; after
    :func:`complete_model` also the derived values (``padded_vocab_size``, ``params_dtype``)
    and the notes for the log. Built at each command line's edge from its parsed flags
    (:meth:`from_flags`); below that, the code takes this object, never the parsed flags."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    group_query_attention: bool = False
    num_query_groups: int | None = 1
    max_position_embeddings: int | None = None
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    disable_bias_linear: bool = False
    untie_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    bf16: bool = False
    fp16: bool = False
    use_cpu_initialization: bool = False
    masked_softmax_fusion: bool = True
    bias_gelu_fusion: bool = True
    bias_swiglu_fusion: bool = True
    bias_dropout_fusion: bool = True
    apply_rope_fusion: bool = True
    gradient_accumulation_fusion: bool = True
    persist_layer_norm: bool = True
    # completed (complete_model)
    padded_vocab_size: int | None = None
    params_dtype: torch.dtype | None = None
    notes: tuple = ()

    @classmethod
    def from_flags(cls, values: dict) -> "ModelFlags":
        """The model's flags out of ``values`` (a dict of parsed flag values by their
        ``argparse`` names; the others are left out)."""
        names = {f.name for f in fields(cls)} - {"notes"}
        return cls(**{k: v for k, v in values.items() if k in names})

    def as_flags(self) -> dict:
        """The flag values by their ``argparse`` names (derived values included, notes not)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "notes"}

    @property
    def activation_fusion(self) -> bool:
        """The bias-activation fusion of this model's activation (SwiGLU or GELU)."""
        return self.bias_swiglu_fusion if self.swiglu else self.bias_gelu_fusion


def complete_model(flags: ModelFlags, tp: int, device: torch.device | None = None) -> ModelFlags:
    """``flags`` completed for TP = ``tp`` on ``device`` (default: this process's): derived
    values and local checks, the fusions for the device; ``notes`` (fusions turned off, and
    why) for the log. Raises :class:`ModelArgsError` naming the flags."""
    device = device or current_device()
    f = flags
    if f.hidden_size % f.num_attention_heads and f.kv_channels is None:
        raise ModelArgsError("--hidden-size must be divisible by --num-attention-heads (or give --kv-channels)")
    if f.num_attention_heads % tp:
        raise ModelArgsError(f"--num-attention-heads {f.num_attention_heads} must be divisible by "
                             f"--tensor-model-parallel-size {tp}")
    groups = f.num_query_groups if f.group_query_attention else f.num_attention_heads
    if f.num_attention_heads % groups or groups % tp:
        raise ModelArgsError(f"--num-query-groups {groups} must divide --num-attention-heads "
                             f"and be divisible by --tensor-model-parallel-size {tp}")
    ffn = f.ffn_hidden_size
    if ffn is None:
        ffn = int((4 * f.hidden_size * 2 / 3) / 64) * 64 if f.swiglu else 4 * f.hidden_size
    if ffn % tp:
        raise ModelArgsError(f"--ffn-hidden-size {ffn} must be divisible by TP {tp}")
    if f.vocab_size is None or f.vocab_size < 2:
        raise ModelArgsError("--vocab-size is required (token ids are 0 .. vocab-size-1)")
    mult = f.make_vocab_size_divisible_by * tp
    if f.fp16:
        raise ModelArgsError("--fp16 is not supported (its loss scaler needs apex); use --bf16 or fp32")
    f = replace(f, num_query_groups=groups, ffn_hidden_size=ffn, padded_vocab_size=-(-f.vocab_size // mult) * mult,
                params_dtype=torch.bfloat16 if f.bf16 else torch.float32,
                use_cpu_initialization=f.use_cpu_initialization or device.type == "cpu")
    return _complete_fusions(f, device)


def _complete_fusions(f: ModelFlags, device) -> ModelFlags:
    """Megatron-LM's fusion defaults on CUDA, minus those whose kernel is missing; none on CPU."""
    if device.type == "cpu":
        return replace(f, notes=("fusions: off on the CPU",), **{dest: False for dest, _ in FUSION_SWITCHES.values()})
    notes, off = [], {}
    act = "bias_swiglu_fusion" if f.swiglu else "bias_gelu_fusion"
    if getattr(f, act) and not f.swiglu and f.disable_bias_linear:
        off[act] = False  # as Megatron-LM: no bias, no bias-GELU fusion
    if f.apply_rope_fusion and (f.position_embedding_type != "rope" or not _have_te_rope()):
        if f.position_embedding_type == "rope":
            notes.append("RoPE fusion off: it needs Transformer Engine (--no-rope-fusion silences this)")
        off["apply_rope_fusion"] = False
    if f.masked_softmax_fusion and not _importable("scaled_masked_softmax_cuda"):
        notes.append("masked-softmax fusion off: it needs megatron's scaled_masked_softmax_cuda "
                     "extension (--no-masked-softmax-fusion silences this)")
        off["masked_softmax_fusion"] = False
    if f.gradient_accumulation_fusion and not have_grad_accum_fusion():
        notes.append("gradient-accumulation fusion off: it needs apex's fused_weight_gradient_mlp_cuda "
                     "(--no-gradient-accumulation-fusion silences this)")
        off["gradient_accumulation_fusion"] = False
    off["persist_layer_norm"] = False  # apex's persistent LayerNorm kernel; the torch norms have none
    f = replace(f, **off)
    on = [n for n, v in (("masked-softmax", f.masked_softmax_fusion), ("bias-activation", getattr(f, act)),
                         ("bias-dropout", f.bias_dropout_fusion), ("rope", f.apply_rope_fusion),
                         ("gradient-accumulation", f.gradient_accumulation_fusion)) if v]
    return replace(f, notes=tuple([f"fusions on: {', '.join(on) or 'none'}"] + notes))


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


def transformer_config(flags: ModelFlags, dims: ParallelDims, **overrides):
    """megatron-core's ``TransformerConfig`` for completed model flags over the layout ``dims``
    (no collective)."""
    from megatron.core.transformer import TransformerConfig

    f = flags
    kw = dict(
        num_layers=f.num_layers, hidden_size=f.hidden_size,
        num_attention_heads=f.num_attention_heads, num_query_groups=f.num_query_groups,
        kv_channels=f.kv_channels, ffn_hidden_size=f.ffn_hidden_size,
        gated_linear_unit=f.swiglu, activation_func=F.silu if f.swiglu else F.gelu,
        add_bias_linear=not f.disable_bias_linear, normalization=f.normalization,
        layernorm_epsilon=f.norm_epsilon, init_method_std=f.init_method_std,
        hidden_dropout=f.hidden_dropout, attention_dropout=f.attention_dropout,
        tensor_model_parallel_size=dims.tp, sequence_parallel=dims.sequence_parallel,
        use_cpu_initialization=f.use_cpu_initialization,
        params_dtype=f.params_dtype, bf16=f.bf16, pipeline_dtype=f.params_dtype,
        calculate_per_token_loss=True,
        bias_activation_fusion=f.activation_fusion,
        bias_dropout_fusion=f.bias_dropout_fusion, masked_softmax_fusion=f.masked_softmax_fusion,
        persist_layer_norm=False, gradient_accumulation_fusion=f.gradient_accumulation_fusion,
        apply_rope_fusion=f.apply_rope_fusion,
        pipeline_model_parallel_size=dims.pp, context_parallel_size=dims.cp,
        virtual_pipeline_model_parallel_size=dims.vpp,
    )
    if dims.vpp is not None:
        # Megatron-LM's default with the interleaved schedule (--no-overlap-p2p-communication
        # not given): overlapped, unbatched p2p; batched, two ranks would post a send and a
        # receive each way in one batch and match them crosswise (Megatron-LM refuses PP = 2 so)
        kw.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    kw.update(overrides)
    config = TransformerConfig(**kw)
    if dims.pp_on:
        # each micro-batch's p2p shape follows its length (training/p2p_shapes.py supplies them);
        # set after the checks, which refuse it with the default MoE dispatcher of a dense model
        config.variable_seq_lengths = True
    return config


def layer_spec(config, vp_stage: int | None = None):
    """megatron-core's local GPT layer spec; with sequence parallelism, the SP torch norm (for
    model chunk ``vp_stage`` under the interleaved schedule)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    if not config.sequence_parallel:
        return spec
    spec.submodules.input_layernorm = SPTorchNorm
    spec.submodules.pre_mlp_layernorm = SPTorchNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * stage_layers(config, vp_stage), layer_norm=SPTorchNorm)


def stage_layers(config, vp_stage: int | None = None) -> int:
    """Decoder layers this pipeline stage (its model chunk ``vp_stage`` under the interleaved
    schedule) builds: megatron's own count; all of them without PP."""
    if config.pipeline_model_parallel_size == 1:
        return config.num_layers
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    return get_num_layers_to_build(config, vp_stage=vp_stage)


def pipeline_ends(vp_stage: int | None = None) -> tuple:
    """``(pre_process, post_process)`` of this rank's pipeline stage (of its model chunk
    ``vp_stage`` under the interleaved schedule: the first rank's chunk 0 embeds, the last
    rank's last chunk has the output layer and loss): both without PP."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return True, True
    if vp_stage is None:
        return parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    return (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))


def build_gpt(config, vocab_size: int, max_sequence_length: int, *, position_embedding_type="rope",
              rotary_percent=1.0, rotary_base=10000, share_embeddings_and_output_weights=False,
              seed: int | None = None, device=None, vp_stage: int | None = None):
    """The stock ``GPTModel`` for ``config`` on ``device`` (default: this process's device),
    unwrapped; with pipeline stages (``config.pipeline_model_parallel_size``) this rank's
    stage, under the interleaved schedule its model chunk ``vp_stage`` (megatron's global layer
    numbers). ``seed`` seeds torch first: with ``use_cpu_initialization`` every rank draws
    the same full master weights, so any TP size holds shards of the same model."""
    from megatron.core.models.gpt import GPTModel

    if seed is not None:
        torch.manual_seed(seed)
    pre, post = pipeline_ends(vp_stage) if config.pipeline_model_parallel_size > 1 else (True, True)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(config, vp_stage), vocab_size=vocab_size,
        max_sequence_length=max_sequence_length, pre_process=pre, post_process=post,
        parallel_output=True, share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type, rotary_percent=rotary_percent,
        rotary_base=rotary_base, **({} if vp_stage is None else {"vp_stage": vp_stage}),
    )
    device = torch.device(device) if device is not None else current_device()
    if device.type != "cpu":
        model.to(device)
    return model


def build_gpt_for(flags: ModelFlags, config, seed: int | None = None, vp_stage: int | None = None):
    """:func:`build_gpt` for completed model flags, wrapped in ``Float16Module`` for bf16 (as
    Megatron-LM); ``vp_stage``: the model chunk (the interleaved schedule)."""
    model = build_gpt(config, flags.padded_vocab_size, flags.max_position_embeddings,
                      position_embedding_type=flags.position_embedding_type,
                      rotary_percent=flags.rotary_percent, rotary_base=flags.rotary_base,
                      share_embeddings_and_output_weights=not flags.untie_embeddings_and_output_weights,
                      seed=seed, vp_stage=vp_stage)
    if flags.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model
