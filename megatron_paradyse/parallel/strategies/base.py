"""What every strategy shares: the interface, and how to read a stock megatron layer.

A strategy receives a stock ``SelfAttention`` or ``MLP`` module and its sequence-sharded
input ``[s/p, b, h]``, and returns ``(output [s/p, b, h], bias)`` exactly as the stock
module would under TP+SP (the row-parallel bias is returned, not added, for the
bias-dropout-add). It reads the module's own TP shards and leaves their gradients in the
same shards; it keeps no weight between calls.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

STOCK_FORWARD = "paradyse_stock_forward"
STRATEGY_ATTR = "_paradyse_strategy"  # a layer's attention / MLP: the strategy it runs (set_plan)


def stock_forward(module, *args, **kwargs):
    """Run the stock megatron ``forward`` of ``module`` (the one saved by ``install``, if any)."""
    fn = getattr(type(module), STOCK_FORWARD, None) or type(module).forward
    return fn(module, *args, **kwargs)


class Strategy:
    """Base class: ``name``, ``supports``, ``attention`` and ``mlp``."""

    name: str = ""
    description: str = ""
    zero_weights: bool = False  # gathers its linears' weights (zero3.py), so it takes prefetch hints

    def supports(self, config, p: int) -> tuple[bool, str]:
        """(True, "") if this strategy can run ``config`` over a group of ``p`` ranks, else the reason."""
        return common_support(config)

    def attention(self, attn, hidden_states, rotary_pos_emb, docs=None):
        """``docs``: the pack's :class:`~..packing.Documents` (attention inside each
        document, RoPE positions from 0 in each), or None for one sequence per row."""
        raise NotImplementedError

    def mlp(self, mlp, hidden_states):
        raise NotImplementedError


# megatron's selective recompute modules that apply to the dense GPT layer of the local spec
# (the others are MoE's and multi-latent attention's, refused above)
SELECTIVE_MODULES = ("core_attn", "layernorm", "mlp")


def common_support(config) -> tuple[bool, str]:
    """Conditions every strategy shares (what the plugin implements of megatron's GPT layer)."""
    if getattr(config, "cp_comm_type", None) not in (None, "p2p"):
        return False, (f"cp_comm_type {config.cp_comm_type!r} is not supported: with context parallelism "
                       "the strategies pass K/V on a ring (megatron's 'p2p')")
    if getattr(config, "hierarchical_context_parallel_sizes", None):
        return False, "hierarchical_context_parallel_sizes is not supported (one CP ring across nodes)"
    if getattr(config, "num_moe_experts", None):
        return False, "MoE layers are not supported; the switching covers dense MLPs"
    if getattr(config, "multi_latent_attention", False):
        return False, "multi-latent attention is not supported"
    if getattr(config, "use_te_activation_func", False):
        return False, "use_te_activation_func is not supported"
    if getattr(config, "attention_output_gate", False):
        return False, "gated attention output is not supported"
    if getattr(config, "qk_layernorm", False):
        return False, "qk_layernorm is not supported"
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        return False, f"softmax_type {config.softmax_type!r} is not supported (vanilla only)"
    if getattr(config, "window_size", None) is not None:
        return False, "sliding-window attention (window_size) is not supported"
    ok, why = recompute_support(config)
    if not ok:
        return False, why
    if config.hidden_dropout or config.attention_dropout:
        return False, ("dropout must be 0: strategies would draw different random masks than "
                       "stock megatron (attention_dropout / hidden_dropout)")
    return True, ""


def recompute_support(config) -> tuple[bool, str]:
    """megatron's recompute flags the strategies honour: full (uniform or block, any number of
    layers) and selective over :data:`SELECTIVE_MODULES`. Each recompute re-runs the strategy of
    its forward (``parallel/recompute.py``). ``core_attn`` changes nothing under a strategy: no
    strategy runs megatron's ``DotProductAttention``, and their kernels (torch's SDPA, the
    log-sum-exp blocks) keep no score matrix; colossal's score rows stay saved."""
    granularity = getattr(config, "recompute_granularity", None)
    if granularity in (None, "full"):
        return True, ""
    if granularity != "selective":
        return False, f"recompute_granularity {granularity!r} is not megatron's 'full' or 'selective'"
    other = sorted(set(getattr(config, "recompute_modules", None) or ()) - set(SELECTIVE_MODULES))
    if other:
        return False, (f"selective recompute of {', '.join(other)} is not supported (the dense "
                       f"GPT layer's modules are {', '.join(SELECTIVE_MODULES)})")
    return True, ""


def zero_support(config, p: int) -> tuple[bool, str]:
    """Conditions of the strategies that rebuild weights from their shards: those of every
    strategy (gradient-accumulation fusion included: see :func:`wgrad_fusion`)."""
    return common_support(config)


def wgrad_fusion(linear):
    """The ``main_grad`` that ``linear``'s weight gradient is accumulated into, or None.

    megatron's gradient-accumulation fusion, decided at forward time as megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication`` decides it: the linear's own
    ``gradient_accumulation_fusion`` (set from the config when it was built) and a weight that
    has a ``main_grad`` (DDP's gradient buffer). A strategy computing this weight's gradient
    hands it to :func:`weight_grad` with what this returned.
    """
    w = linear.weight
    if getattr(linear, "gradient_accumulation_fusion", False) and hasattr(w, "main_grad"):
        return w.main_grad
    return None


def weight_grad(weight, grad, main_grad, act_dtype):
    """What a strategy's backward returns for a TP weight shard whose gradient is ``grad``.

    Without fusion (``main_grad`` None): ``grad`` in the weight's dtype. With it: ``grad`` is
    added into ``main_grad`` (in ``main_grad``'s dtype, fp32 with DDP's default) and megatron's
    dummy gradient is returned exactly as megatron's fused linear backward returns it: where
    the weight has ``grad_added_to_main_grad`` (DDP sets it) that flag is set, so DDP's
    backward hook does not add the gradient again, and the dummy is ``main_grad``-shaped in
    the activations' dtype, zeros if the weight has ``zero_out_wgrad`` (the hook then adds
    it anyway), else uninitialised; without the flag, None.
    """
    if main_grad is None:
        return grad.to(weight.dtype)
    main_grad.add_(grad)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    dummy = make(main_grad.shape, dtype=act_dtype, device=main_grad.device, requires_grad=False)
    weight.grad_added_to_main_grad = True
    return dummy


@dataclasses.dataclass
class Geometry:
    """Head and group layout of one attention layer over the switching group."""

    group: object
    rank: int
    p: int
    heads: int
    groups: int
    head_dim: int
    scale: float

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups


def geometry(attn) -> Geometry:
    cfg = attn.config
    group = switching_group(attn)
    heads = cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    d = cfg.kv_channels or cfg.hidden_size // heads
    scale = getattr(attn.core_attention, "softmax_scale", None) or 1.0 / math.sqrt(d)
    if cfg.apply_query_key_layer_scaling:
        scale = 1.0 / math.sqrt(d)
    return Geometry(group, dist.get_rank(group), dist.get_world_size(group), heads, groups, d, scale)


def switching_group(module):
    """The process group strategies run over: the module's own TP group."""
    for attr in ("linear_qkv", "linear_fc1"):
        lin = getattr(module, attr, None)
        if lin is not None and getattr(lin, "tp_group", None) is not None:
            return lin.tp_group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def split_qkv(mixed, groups: int, q_per_group: int, d: int):
    """Split fused QKV ``[s, b, groups*(q_per_group+2)*d]`` in megatron's per-group layout.

    Returns q ``[s, b, groups*q_per_group, d]``, k and v ``[s, b, groups, d]``.
    """
    s, b = mixed.shape[:2]
    mixed = mixed.view(s, b, groups, (q_per_group + 2) * d)
    q, k, v = torch.split(mixed, [q_per_group * d, d, d], dim=3)
    return q.reshape(s, b, groups * q_per_group, d), k, v


def rope_freqs(rotary_pos_emb):
    """(q freqs, k freqs) from what ``TransformerLayer`` passes, or (None, None)."""
    if rotary_pos_emb is None:
        return None, None
    if not isinstance(rotary_pos_emb, tuple):
        return rotary_pos_emb, rotary_pos_emb
    return rotary_pos_emb


def apply_rope(x, freqs, config, positions):
    """Megatron's RoPE on ``x [s, b, n, d]``: ``positions`` is the first position of its tokens
    (an int: they are consecutive), their ``(start, stop)`` ranges in order (a balanced ring
    layout, ``zigzag.RingLayout.ranges``), or each token's position (a tensor: a pack's
    in-document positions, ``packing.Documents.positions``)."""
    if freqs is None:
        return x
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    if torch.is_tensor(positions):
        local = freqs.index_select(0, positions.to(freqs.device))
    elif isinstance(positions, int):
        local = freqs[positions:positions + x.shape[0]]
    else:
        local = torch.cat([freqs[a:b] for a, b in positions]) if len(positions) > 1 else \
            freqs[positions[0][0]:positions[0][1]]
    return apply_rotary_pos_emb(x, local, config=config)


def to_bhsd(x):
    """``[s, b, n, d]`` to the kernels' ``[b, n, s, d]``."""
    return x.permute(1, 2, 0, 3)


def from_bhsd(x):
    """``[b, n, s, d]`` to ``[s, b, n*d]``."""
    b, n, s, d = x.shape
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d)


def apply_activation(mlp, x, bias, shards: int):
    """Megatron's MLP activation on fc1's output laid out as ``shards`` TP shards side by side.

    Each shard of a gated MLP is ``[gate_r; up_r]``, so the gate/up split happens per shard,
    as on the rank that owns it. Returns ``[..., ffn]`` in TP=1 order. The branches are those of
    ``MLP.forward`` (megatron's fused kernels where it uses them): megatron-core has no
    activation function separate from ``MLP.forward``, whose fc1/fc2 are its TP linears.
    """
    cfg = mlp.config
    lead = x.shape[:-1]
    x = x.reshape(-1, shards, x.shape[-1] // shards)  # [tokens, shards, shard width]
    bias = bias.view(shards, -1) if bias is not None else None
    if cfg.bias_activation_fusion:
        from megatron.core.fusions.fused_bias_geglu import bias_geglu_impl
        from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

        if mlp.activation_func == F.gelu and not cfg.gated_linear_unit:
            y = bias_gelu_impl(x, bias)
        elif cfg.gated_linear_unit and mlp.activation_func in (F.gelu, F.silu):
            # the fused GLU kernels take 2-D rows of one shard: add the bias per shard first
            rows = (x + bias if bias is not None else x).reshape(-1, x.shape[-1])
            y = bias_geglu_impl(rows, None) if mlp.activation_func == F.gelu else bias_swiglu_impl(
                rows, None, cfg.activation_func_fp8_input_store, False)
        else:
            raise ValueError("bias_activation_fusion supports gelu and swiglu only (as megatron's MLP)")
    else:
        if bias is not None:
            x = x + bias
        if cfg.gated_linear_unit:
            g, u = torch.chunk(x, 2, dim=-1)
            clamp = getattr(cfg, "activation_func_clamp_value", None)
            if clamp is not None:
                g, u = g.clamp(max=clamp), u.clamp(min=-clamp, max=clamp)
            y = cfg.activation_func(g) * (u + getattr(cfg, "glu_linear_offset", 0.0))
        else:
            y = mlp.activation_func(x)
    return y.reshape(*lead, -1)


def bias_of(linear):
    """A linear layer's bias parameter, or None."""
    return getattr(linear, "bias", None)


def row_output(linear, y):
    """``(y, bias)`` exactly as the stock row-parallel ``linear`` returns its output ``y``: the
    bias added, or, with ``skip_bias_add``, returned for the bias-dropout-add."""
    bias = bias_of(linear)
    if bias is not None and not linear.skip_bias_add:
        return y + bias, None
    return y, bias
