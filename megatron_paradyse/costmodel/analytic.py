"""The analytic cost model: per-strategy memory formulas, static memory, roofline time.

Memory (per rank, one decoder layer, micro-batch ``b`` of padded length ``s``): every term is
a tensor the strategy's code creates, written in the layer's geometry. With ``t = s*b/p``
local tokens, ``e`` bytes per element, ``qw = (heads + 2*groups) * head_dim`` (QKV width),
``kv = groups * head_dim``, ``f1`` = ffn (GELU) or 2*ffn (SwiGLU):

* a tensor ``[s, b, w/p]`` (full sequence, 1/p of the width: ``tp_sp``, ``ulysses``'s
  head-sharded attention) and a tensor ``[s/p, b, w]`` (local tokens, full width: the
  sequence-sharded strategies) both hold ``t*w*e`` bytes, so one basis serves all;
* ``colossal``'s score rows ``[b, heads, s/p, s]`` hold ``heads*t*s`` elements;
* gathered / travelling weights are ``W`` (whole matrix) or ``W/p`` (one TP shard).

``BASIS`` lists the terms; ``SAVED`` and ``TRANSIENT`` give, per strategy, how many of each
the layer holds. The coefficients were read off the strategies' code (``tp_sp``: megatron's
own linears save the local input and re-gather; the ZeRO strategies save local tokens;
``metp`` saves only its input) and checked against the CPU live-bytes tracker
(:mod:`megatron_paradyse.memory`), which also found the implementation's extra
copies (contiguous copies after permutes, a bias-free row-parallel output kept by autograd,
SwiGLU's chunked gate); ``tests/test_costmodel_analytic.py`` holds the result to 5% at
p = 2 and 4 over several shapes. Ranks differ (colossal's dS rows reach the rank's last position);
the formulas give the largest rank, which is what a memory budget needs.

Time: a roofline (``flops / peak + bytes / memory bandwidth``) plus an alpha-beta model of the
strategy's collectives (``configs/interconnects.json``). It is a coarse fallback used only
when no fitted model exists; its constants (``configs/hardware.json``) are datasheet numbers.
"""
from __future__ import annotations

import json
import math
import os
import types

from ..parallel.plans import split_entry, strategy_of
from . import packs
from .base import CostModel, LayerCost, as_tokens, check_length
from .shape import ModelShape

STRATEGIES = ("tp_sp", "ulysses", "ring", "colossal", "metp")
_CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


def load_config(name: str, path: str | None = None) -> dict:
    path = path or os.path.join(_CONFIGS, name)
    with open(path) as f:
        return json.load(f)


def basis(shape: ModelShape, s: int, b: int) -> dict:
    """The memory terms (bytes) of one layer at ``(s, b)`` for ``shape``."""
    p, e, h, n = shape.p, shape.elt, shape.hidden, shape.heads
    d, g, f = shape.head_dim, shape.query_groups, shape.ffn
    f1 = 2 * f if shape.swiglu else f
    qw, kv = shape.qkv_width, g * d
    t = s * b / p
    w_qkv, w_proj, w_fc1, w_fc2 = h * qw * e, h * n * d * e, h * f1 * e, f * h * e
    return {
        "t*h": t * h * e,                      # one [s/p, b, h] (or [s, b, h/p]) activation
        "T*h": s * b * h * e,                  # one [s, b, h]: a gathered full-sequence activation
        "t*qw": t * qw * e,                    # mixed QKV of local tokens, all heads
        "t*kv": t * kv * e,                    # one of K / V
        "t*f": t * f * e,                      # one FFN-wide activation
        "t*f1": t * f1 * e,                    # fc1's output (2*ffn wide under SwiGLU)
        "t*h*nobias": t * h * e * (not shape.bias),
        "t*f*swiglu": t * f * e * shape.swiglu,
        "t*qw/p": t * qw * e / p,              # one head group's QKV (metp)
        "t*h/p": t * h * e / p,
        "t*f1/p": t * f1 * e / p,              # one shard's intermediate (metp)
        "t*f/p": t * f * e / p,
        "t*kv/p": t * kv * e / p,
        "t*lse": t * n * 4,                    # log-sum-exp rows, fp32
        "t*4": t * 4,                          # one fp32 per local token (layernorm statistics)
        "rope": 2 * s * d * 4,                 # RoPE cos and sin over the whole sequence (fp32)
        "rope/p": 2 * s * d * 4 / p,           # ... over the local tokens' positions
        "rows": n * t * s * e,                 # colossal's probabilities [b, heads, s/p, s] (t includes b)
        "rows32": n * t * s * 4,           # its fp32 score / dS buffers
        "W_attn": w_qkv + w_proj,              # gathered attention weights
        "W_qkv": w_qkv, "W_fc1": w_fc1, "W_fc2": w_fc2,
        "W_mlp": w_fc1 + w_fc2,
        "W_qkv/p": w_qkv / p, "W_mlp/p": (w_fc1 + w_fc2) / p, "W_attn/p": (w_qkv + w_proj) / p,
        "W_f1/p": w_fc1 / p,
    }


# Per strategy: {term: count} of the bytes the layer keeps for its backward (largest rank).
# Read off the code and equal to the tracker's measurement at p = 2 and 4 (see SAVED_NOTES).
SAVED = types.MappingProxyType({
    "tp_sp": {
        "t*h": 7,
        "t*kv": 3,
        "rope": 2,
        "t*f1": 2,
        "t*f*swiglu": 1,
        "t*lse": 1,
        "t*4": 4
    },
    "ulysses": {
        "t*h": 7,
        "t*kv": 2,
        "rope/p": 2,
        "t*f1": 2,
        "t*f*swiglu": 1,
        "t*lse": 1,
        "t*4": 4
    },
    "ring": {
        "t*h": 6,
        "t*kv": 2,
        "rope/p": 2,
        "t*f1": 2,
        "t*f*swiglu": 1,
        "t*lse": 1,
        "t*4": 4
    },
    "colossal": {
        "t*h": 6,
        "t*kv": 2,
        "rope/p": 2,
        "t*f1": 2,
        "t*f*swiglu": 1,
        "t*4": 4,
        "rows": 1
    },
    "metp": {
        "t*h": 4,
        "t*4": 4
    },
})

SAVED_NOTES = types.MappingProxyType({
    "common": "layer input's two layernorm outputs and the residual sums (t*h each), layernorm "
              "mean/rstd (4 fp32 per token), the MLP: fc1 output + activation output (2 t*f1; "
              "SwiGLU keeps its gate's silu too: + t*f), the layer output",
    "tp_sp": "megatron's linears save the local input (gathered again in backward); QKV [s, b, qw/p], "
             "RoPE'd q and k, flash out + lse, the projection input (a copy after the permute); RoPE "
             "cos/sin for q and k over the whole sequence",
    "ulysses": "q, k, v after the all-to-all, flash out + lse, the gathered-back context; RoPE over "
               "local positions",
    "ring": "local q, k, v, the merged out (fp32) and lse, the context; no all-to-all copy",
    "colossal": "local q, k, v and the probabilities [b, heads, s/p, s] instead of out/lse",
    "metp": "only the attention and MLP inputs (recomputed in backward), the residuals and output",
})

# Transient: the layer's peak above its saved bytes, the larger of (at most) two phases, each a
# non-negative sum of the basis whose coefficients are fitted to the tracker (configs/transient.json, written by ``python -m
# megatron_paradyse.costmodel.transient``, which says how and prints the error): it mixes
# gathered weights, communication slots, recomputed activations and the gradients made while
# the saved tensors are freed, so these coefficients are fitted, not derived.
TRANSIENT = load_config("transient.json")["transient"]


def layer_memory(strategy: str, shape: ModelShape, s, b: int) -> tuple[float, float]:
    """(saved bytes, transient bytes) of one layer, largest rank; ``s`` a length or a pack
    (:func:`pack_memory`)."""
    if strategy not in SAVED:
        raise KeyError(f"no analytic memory model for strategy {strategy!r} (known: {sorted(SAVED)})")
    if packs.is_pack(s):
        return pack_memory(strategy, shape, s)
    B = basis(shape, s, b)
    saved = sum(c * B[k] for k, c in SAVED[strategy].items())
    trans = max(sum(c * B[k] for k, c in phase.items()) for phase in TRANSIENT[strategy])
    return float(saved), float(trans)


# Packs (tracker, p = 2, demo shape, 2026-11-25): tp_sp saves one more [T, b, h/p] (the
# per-document outputs' concatenation, attention_kernels.document_attention); ulysses' bytes
# are the single sequence's; the ring strategies keep these saved terms in the layer's packed
# layout, count(rank) tokens instead of T/p (equal to the tracker for the ranks holding 312,
# 500, 524, 574, 712 of 1024 tokens); colossal's score rows are [b, heads, count, T].
PACK_EXTRA_SAVED = types.MappingProxyType({"tp_sp": {"t*h": 1}})
PACK_LAYOUT_SAVED = types.MappingProxyType({"ring": {"t*h": 3, "t*kv": 2, "rope/p": 2, "t*lse": 1},
                                            "colossal": {"t*h": 3, "t*kv": 2, "rope/p": 2, "rows": 1},
                                            "metp": {"t*h": 1}})
# transient terms of the attention phase, which run over the packed layout's tokens (the
# phases are fitted mixtures, configs/transient.json; the MLP's and the weights' terms stay);
# colossal's dS rows reach the widest column a local row sees (packs.PackGeometry.rows_cols)
PACK_LAYOUT_TRANSIENT = ("t*lse", "t*kv", "t*kv/p", "t*qw", "t*qw/p", "rope/p", "t*h/p")
PACK_ROWS_TRANSIENT = ("rows", "rows32")


def pack_memory(strategy: str, shape: ModelShape, s) -> tuple[float, float]:
    """(saved, transient) bytes of one layer on a pack: the single sequence of its padded
    length, plus what the pack changes (the tables above; ``packs.ratios``)."""
    T = packs.geometry(s, shape.p).tokens
    B = basis(shape, T, 1)
    r = packs.ratios(s, shape.p)
    saved = sum(c * B[k] for k, c in SAVED[strategy].items())
    saved += sum(c * B[k] for k, c in PACK_EXTRA_SAVED.get(strategy, {}).items())
    saved += sum(c * B[k] * (r["count"] - 1) for k, c in PACK_LAYOUT_SAVED.get(strategy, {}).items())
    scale = {}
    if strategy in packs.RING_LIKE:
        scale = {k: r["count"] for k in PACK_LAYOUT_TRANSIENT}
        scale.update({k: r["rows"] for k in PACK_ROWS_TRANSIENT})
    trans = max(sum(c * B[k] * scale.get(k, 1.0) for k, c in phase.items()) for phase in TRANSIENT[strategy])
    return float(saved), float(trans)


# ------------------------------------------------------------------------------------------
# static and non-layer memory


def param_counts(shape: ModelShape) -> dict:
    """Parameters on one rank: sharded by TP (``/p``) and replicated (norms, row biases)."""
    p, h, f, qw = shape.p, shape.hidden, shape.ffn, shape.qkv_width
    f1 = 2 * f if shape.swiglu else f
    sharded = h * qw + h * h + h * f1 + f * h + (qw + f1 if shape.bias else 0)
    replicated = 4 * h + (2 * h if shape.bias else 0)
    per_layer = sharded / p + replicated
    embed = shape.vocab * h / p
    output = shape.vocab * h / p
    return {"layers": shape.num_layers * per_layer, "embedding": embed, "output": output,
            "final_norm": 2 * h, "per_layer": per_layer, "replicated_per_layer": replicated}


def static_bytes(shape: ModelShape, optimizer: str = "adam") -> float:
    """Weights, gradients and optimizer state on one rank.

    fp32: param 4 + grad 4 + Adam moments 8 = 16 bytes per parameter. bf16 (megatron's mixed
    precision): param 2 + fp32 main grad 4 + fp32 master 4 + Adam 8 = 18 bytes.
    """
    pc = param_counts(shape)
    n = pc["layers"] + pc["embedding"] + pc["output"] + pc["final_norm"]
    per = 16 if shape.dtype == "fp32" else 18
    if optimizer == "none":
        per = 2 * shape.elt if shape.dtype == "fp32" else shape.elt + 4
    return float(n * per)


def nonlayer_memory(shape: ModelShape, s: int, b: int) -> tuple[float, float]:
    """(saved, transient) bytes of the embedding, final norm, output layer and loss."""
    p, e, h, V = shape.p, shape.elt, shape.hidden, shape.vocab
    t = s * b / p
    T = s * b
    logits = T * V / p
    saved = NONLAYER_SAVED["t*h"] * t * h * e + NONLAYER_SAVED["T*V/p"] * logits * 4 \
        + NONLAYER_SAVED["T"] * T * 4 + NONLAYER_SAVED["t*4"] * t * 4
    trans = NONLAYER_TRANSIENT["T*V/p"] * logits * 4 + NONLAYER_TRANSIENT["t*h"] * t * h * e \
        + NONLAYER_TRANSIENT["T"] * T * 4 + NONLAYER_TRANSIENT["T*h"] * T * h * e
    return float(saved), float(trans)


# Saved: the embedding's output and the final norm's output (t*h each), the fp32 logits shard
# kept by the vocab-parallel cross-entropy, 16 bytes per token (labels, loss, mask): within
# 0.4% of the tracker at p = 2 and 4. Transient: the logits' softmax temporaries and the
# gathered [s, b, h] input of the output layer; rough (within ~50% at p = 2; the planner
# adds it once per step, a few percent of a step's peak at the demo shape).
NONLAYER_SAVED = types.MappingProxyType({"t*h": 2.0, "T*V/p": 1.0, "T": 4.0, "t*4": 0.0})
NONLAYER_TRANSIENT = types.MappingProxyType({"T*V/p": 1.0, "t*h": 0.0, "T": 0.0, "T*h": 0.5})


# ------------------------------------------------------------------------------------------
# time: roofline + alpha-beta collectives


def flops_parts(strategy: str, shape: ModelShape, s: int, b: int) -> tuple[float, float]:
    """``(GEMM, attention)`` fwd+bwd FLOPs of one layer on the busiest rank.

    GEMM: the four linears, linear in ``b*s``. Attention: QK^T and PV, causal (half of s*s per
    head), split evenly over the ranks (the ring strategies by their balanced zig-zag layout):
    the only term in ``s**2``. Backward is twice the forward; ``metp`` recomputes the forward
    of attention and fc1 in backward (counted as one more forward)."""
    p, h, f, qw = shape.p, shape.hidden, shape.ffn, shape.qkv_width
    f1 = 2 * f if shape.swiglu else f
    pack = packs.is_pack(s)
    if pack:
        s, b, r = packs.geometry(s, p).tokens, 1, packs.ratios(s, p)
    T = s * b
    lin = 2 * T * (h * qw + h * shape.heads * shape.head_dim + h * f1 + f * h) / p
    att = 2 * 2 * T * s * shape.heads * shape.head_dim / p / 2
    if pack:  # the documents' causal pairs (tp_sp, ulysses), the busiest rank's blocks (rings)
        att *= r[PACK_ATTENTION[strategy]]
    passes = forward_passes(strategy)
    return float(passes * lin), float(passes * att)


def forward_passes(strategy: str) -> int:
    """A layer's forward + backward in forward passes: 3 (the backward is twice the forward),
    4 for ``metp`` (its backward runs attention and fc1 forward once more)."""
    return 4 if strategy == "metp" else 3


def assumed_recompute(strategy: str, plain: LayerCost, kept_bytes: float) -> LayerCost:
    """A recomputed layer (``st:rc``) as the analytic models *assume* it: the plain layer's time
    plus its forward once more (:func:`forward_passes`), ``kept_bytes`` saved (its
    ``[s/p, b, h]`` output), the plain layer's saved + transient as transient (the recompute
    rebuilds what the plain layer saves, then its backward runs as the plain one's)."""
    return LayerCost(plain.seconds * (1.0 + 1.0 / forward_passes(strategy)), kept_bytes,
                     plain.saved_bytes + plain.transient_bytes)


# The bytes a layer's MLP block (pre-MLP norm, MLP, residual add) keeps for its backward, in the
# basis: the norm's output and statistics, fc1's output and the activation's (SwiGLU: its gate's
# silu too); metp's MLP keeps only its input (the norm's output). A checkpoint of the block drops
# them (its input and output stay: the attention block's output, the next layer's input).
MLP_SAVED = types.MappingProxyType({"t*h": 1, "t*4": 2, "t*f1": 2, "t*f*swiglu": 1})
MLP_SAVED_METP = types.MappingProxyType({"t*h": 1, "t*4": 2})


def block_saved(strategy: str, shape: ModelShape, s, b: int, plain_saved: float, kind: str) -> float:
    """Bytes a checkpoint of the layer's ``kind`` block ("mlp" or "attn") drops from the plain
    layer's ``plain_saved``: the MLP block's own (:data:`MLP_SAVED`), or for attention what the
    layer keeps beyond the MLP block's and the two hidden states that survive either checkpoint
    (the attention block's output and the layer's output)."""
    tokens, bb = (packs.geometry(s, shape.p).tokens, 1) if packs.is_pack(s) else (s, b)
    B = basis(shape, tokens, bb)
    mlp = sum(c * B[k] for k, c in (MLP_SAVED_METP if strategy == "metp" else MLP_SAVED).items())
    kept = 2 * B["t*h"]  # the block's input and the layer's output stay, whichever block is recomputed
    if kind == "mlp":
        return min(mlp, max(0.0, plain_saved - kept))
    return max(0.0, plain_saved - mlp - kept)


def block_forward_share(strategy: str, shape: ModelShape, s, b: int, kind: str) -> float:
    """The ``kind`` block's forward as a share of the layer's forward + backward work
    (:func:`flops_parts`): the MLP's two linears, or the attention's two linears and its
    attention."""
    p, h, f = shape.p, shape.hidden, shape.ffn
    f1 = 2 * f if shape.swiglu else f
    gemm, att = flops_parts(strategy, shape, s, b)
    total = gemm + att
    passes = forward_passes(strategy)
    mlp_w, attn_w = h * f1 + f * h, h * shape.qkv_width + h * shape.heads * shape.head_dim
    mlp_fwd = gemm / passes * mlp_w / (mlp_w + attn_w)
    if kind == "mlp":
        return mlp_fwd / total if total > 0 else 0.0
    return (gemm / passes - mlp_fwd + att / passes) / total if total > 0 else 0.0


def assumed_block_recompute(strategy: str, shape: ModelShape, s, b: int, plain: LayerCost, kind: str) -> LayerCost:
    """A layer whose ``kind`` block is recomputed (``st:rc-attn``, ``st:rc-mlp``) as the analytic
    models *assume* it: the plain layer's time plus that block's forward once more
    (:func:`block_forward_share`), the block's own saved bytes (:func:`block_saved`) moved from
    saved to transient (the recompute rebuilds them inside the backward)."""
    drop = block_saved(strategy, shape, s, b, plain.saved_bytes, kind)
    share = block_forward_share(strategy, shape, s, b, kind)
    return LayerCost(plain.seconds * (1.0 + share), plain.saved_bytes - drop, plain.transient_bytes + drop)


# which of packs.ratios scales a pack's attention work: per document over the whole sequence,
# the busiest rank's kernel blocks, or colossal's score rows (filled, soft-maxed and
# back-propagated over every column a local row sees, whatever the documents)
PACK_ATTENTION = types.MappingProxyType({"tp_sp": "attn_full", "ulysses": "attn_full", "ring": "attn_ring", "metp": "attn_ring",
                                         "colossal": "attn_ring"})


def layer_flops(strategy: str, shape: ModelShape, s: int, b: int) -> float:
    """fwd+bwd FLOPs of one layer on the busiest rank (GEMM + attention, :func:`flops_parts`)."""
    return sum(flops_parts(strategy, shape, s, b))


def comm_ops(strategy: str, shape: ModelShape, s: int, b: int) -> list:
    """The layer's collectives (fwd + bwd) as ``(kind, bytes per rank, count)``.

    kinds: ``allgather`` / ``reducescatter`` (bytes = the full tensor), ``alltoall`` (bytes =
    one rank's buffer), ``p2p`` (one ring hop), ``broadcast`` / ``reduce`` (bytes = the tensor).
    """
    if packs.is_pack(s):
        return pack_comm_ops(strategy, shape, s)
    p, e, h, f = shape.p, shape.elt, shape.hidden, shape.ffn
    qw, kv = shape.qkv_width, shape.query_groups * shape.head_dim
    f1 = 2 * f if shape.swiglu else f
    T = s * b
    t = T / p
    w = [h * qw * e, h * h * e, h * f1 * e, f * h * e]
    if p == 1:
        return []
    if strategy == "tp_sp":
        return [("allgather", T * h * e, 6), ("reducescatter", T * h * e, 4)]
    ops = []
    if strategy in ("ulysses", "ring", "colossal"):
        for wb in w:
            ops += [("allgather", wb, 2), ("reducescatter", wb * 4 / e, 1)]
    if strategy in ("ring", "colossal", "metp"):  # the balanced re-layout: half the local tokens, 4 swaps
        ops += [("p2p", t * h * e / 2, 4)]
    if strategy == "ulysses":
        ops += [("alltoall", t * (qw + h) * e, 2)]
    elif strategy == "ring":
        ops += [("p2p", 2 * t * kv * e, 2 * (p - 1)), ("p2p", 2 * t * kv * 4, p)]
    elif strategy == "colossal":
        ops += [("p2p", t * kv * e, 4 * (p - 1)), ("p2p", t * kv * 4, 2 * p)]
    elif strategy == "metp":
        attn_shard = (w[0] + w[1]) / p
        mlp_shard = (w[2] + w[3]) / p
        # per head group one flat broadcast (fwd, bwd); the weight gradients' rows in one reduce-scatter
        ops += [("broadcast", attn_shard, 2 * p), ("reducescatter", p * attn_shard * 4 / e, 1),
                ("p2p", 2 * t * kv / p * e, 3 * p * (p - 1)), ("p2p", 2 * t * kv / p * 4, p * p),
                ("p2p", mlp_shard, 2 * (p - 1)), ("p2p", mlp_shard * 4 / e, p)]
    return ops


def pack_comm_ops(strategy: str, shape: ModelShape, s) -> list:
    """:func:`comm_ops` of a pack: the single sequence's of its padded length, the ring hops'
    bytes scaled by the K/V blocks that travel (``packs.ratios``: ``hops``, none where no
    document crosses a rank), the re-layout's by the rows it moves (``moved``)."""
    T = packs.geometry(s, shape.p).tokens
    ops = comm_ops(strategy, shape, T, 1)
    if strategy not in packs.RING_LIKE:
        return ops
    r = packs.ratios(s, shape.p)
    t, e = T / shape.p, shape.elt
    kv = shape.query_groups * shape.head_dim * {"ring": 2, "colossal": 1, "metp": 2 / shape.p}[strategy]
    blocks = {t * kv * e, t * kv * 4}  # a K/V block (K and V for ring, K or V for colossal) and its gradient
    relayout = t * shape.hidden * e / 2
    out = []
    for kind, nb, count in ops:
        if kind == "p2p" and math.isclose(nb, relayout):
            nb = nb * r["moved"]
        elif kind == "p2p" and any(math.isclose(nb, x) for x in blocks):
            nb = nb * r["hops"]
        if nb > 0:
            out.append((kind, nb, count))
    return out


def collective_seconds(kind: str, nbytes: float, p: int, net: dict) -> float:
    a, bw = net["alpha"], net["bandwidth"]
    if p == 1:
        return 0.0
    if kind in ("allgather", "reducescatter", "alltoall"):
        return (p - 1) * a + (p - 1) / p * nbytes / bw
    if kind == "allreduce":  # reduce-scatter + all-gather
        return 2 * ((p - 1) * a + (p - 1) / p * nbytes / bw)
    if kind == "p2p":
        return a + nbytes / bw
    if kind in ("broadcast", "reduce"):
        return math.ceil(math.log2(p)) * a + nbytes / bw
    raise ValueError(f"unknown collective kind {kind!r}")


def comm_seconds(strategy: str, shape: ModelShape, s: int, b: int, net: dict) -> float:
    return sum(c * collective_seconds(k, nb, shape.p, net) for k, nb, c in comm_ops(strategy, shape, s, b))


# The kernel class of each strategy's attention: the four that call the flash kernel
# (attention_kernels.attn_forward: torch's flash on CPU, flash-attn on GPU) share its rate;
# colossal materializes its score rows and runs its own kernels.
ATTENTION_KERNEL = types.MappingProxyType({"tp_sp": "flash", "ulysses": "flash", "ring": "flash", "metp": "flash", "colossal": "rows"})
COMM_KINDS = ("allgather", "reducescatter", "alltoall", "p2p", "broadcast", "reduce")
# the collective kinds whose bytes share one fitted rate: the ring-algorithm collectives and the
# tree ones of metp's weights (one per strategy's profile would not be told apart from its fixed
# cost), the all-to-all, the point-to-point hops
COMM_CLASS = types.MappingProxyType({"allgather": "collective", "reducescatter": "collective", "broadcast": "collective",
                                     "reduce": "collective", "alltoall": "alltoall", "p2p": "p2p"})


def wire_bytes(kind: str, nbytes: float, p: int) -> float:
    """The bytes one rank sends for one collective of ``comm_ops``'s size ``nbytes``: the
    bandwidth term of :func:`collective_seconds` (``(p-1)/p`` of the tensor for the ring
    collectives, all of it for a hop, a broadcast or a reduce)."""
    if p == 1:
        return 0.0
    return (p - 1) / p * nbytes if kind in ("allgather", "reducescatter", "alltoall") else float(nbytes)


PACK_FEATURES = ("pack", "pack_calls", "pack_rows")


def time_features(strategy: str, shape: ModelShape, s, b: int) -> dict:
    """The work of one layer's fwd+bwd on the busiest rank, as the fitted time model's features.

    ``gemm_flops`` (linear in ``b*s``), ``attn_flops`` (``b*s**2``; its kernel class in
    :data:`ATTENTION_KERNEL`), ``bytes:<kind>`` (wire bytes per collective kind, from
    :func:`comm_ops`) and ``comm:<class>`` (their sums by :data:`COMM_CLASS`), ``messages``
    (collective calls) and ``layer`` (1: the fixed cost of the layer's kernel launches and
    messages). Time = sum of rate x feature, rates fitted (``fit.fit_time_rates``).

    ``s`` a pack (``packs``): the same features computed for it (attention from its documents,
    hops and re-layout from its ``PackedLayout``), and two that are 0 for one sequence:
    ``pack`` (1: a pack's fixed cost, e.g. the per-document concatenation, the re-layout's
    bookkeeping), ``pack_calls`` (the attention kernel calls beyond one sequence's: one per
    document for tp_sp and ulysses, per block of the busiest rank for the rings) and, for
    colossal, ``pack_rows`` (its score rows are filled and soft-maxed over every column a
    local row sees, beyond the blocks the documents fill: in attention FLOPs of one sequence),
    rated by ``fit.fit_pack_rates`` on profiled packs (measured: 256 documents of 4 tokens
    took 3x the time of 64 of 16 under tp_sp, p = 2, 1024 tokens)."""
    gemm, att = flops_parts(strategy, shape, s, b)
    out = {"layer": 1.0, "gemm_flops": gemm, "attn_flops": att, "messages": 0.0}
    out.update({k: 0.0 for k in PACK_FEATURES})
    if packs.is_pack(s):  # a pack's own costs, rated on profiled packs (fit.fit_pack_rates)
        r = packs.ratios(s, shape.p)
        out["pack"] = 1.0
        out["pack_calls"] = r["calls_ring" if strategy in packs.RING_LIKE else "calls_full"]
        if strategy == "colossal":  # its score rows beyond the blocks the documents fill
            one = flops_parts(strategy, shape, packs.geometry(s, shape.p).tokens, 1)[1]
            out["pack_rows"] = max(0.0, one * (r["rows"] - r["attn_ring"]))
    out.update({f"bytes:{k}": 0.0 for k in COMM_KINDS})
    for kind, nb, count in comm_ops(strategy, shape, s, b):
        out[f"bytes:{kind}"] += count * wire_bytes(kind, nb, shape.p)
        out["messages"] += count
    for kind, cls in COMM_CLASS.items():
        out[f"comm:{cls}"] = out.get(f"comm:{cls}", 0.0) + out[f"bytes:{kind}"]
    return out


def update_comm_seconds(shape: ModelShape, net: dict) -> float:
    """The collectives of a step's update (``measure.TrainingUpdate``): the all-reduce of the
    replicated (sequence-parallel) parameters' gradients, coalesced, and the gradient norm's."""
    pc = param_counts(shape)
    nbytes = (shape.num_layers * pc["replicated_per_layer"] + pc["final_norm"]) * 4  # fp32 (bf16: main grads)
    return collective_seconds("allreduce", nbytes, shape.p, net) + collective_seconds("allreduce", 4, shape.p, net)


_DTYPE_NAME = types.MappingProxyType({"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"})


ZERO = ("ulysses", "ring", "colossal")  # the strategies that gather their weights (zero3.py)


def zero_weight_pool(shape: ModelShape, prefetch: bool = True) -> dict:
    """The ZeRO strategies' gathered weights in the pool (bytes, undecorated names).

    Prefetch on (the default, as the trainers run without ``--paradyse-no-prefetch``) and p > 1: two
    slots by role, ``weight0_0`` the larger of QKV and fc1, ``weight0_1`` the larger of the
    projection and fc2, so the one extra gathered weight prefetch holds is ``weight0_1``;
    ``weight0_1_in`` the staged row-parallel shard. Off (or p = 1): one slot, ``weight0_0``, the
    largest weight, and ``_in``.
    """
    on = prefetch and shape.p > 1
    p, e, h, f = shape.p, shape.elt, shape.hidden, shape.ffn
    f1 = 2 * f if shape.swiglu else f
    col, row = max(h * shape.qkv_width, h * f1) * e, max(h * shape.heads * shape.head_dim, f * h) * e
    if on:
        return {"paradyse:weight0_0": col, "paradyse:weight0_1": row, "paradyse:weight0_1_in": row / p}
    return {"paradyse:weight0_0": max(col, row), "paradyse:weight0_0_in": row / p}


def pool_buffers(strategy: str, shape: ModelShape, s: int, b: int, prefetch: bool = True) -> dict:
    """The communication pool a micro-batch allocates for ``strategy`` (or ``"nonlayer"``):
    ``{"name/dtype": bytes}``, the largest rank's, read off the strategies' code and equal to
    the profiler's pool rows (tests/test_costmodel_analytic.py, fp32, p = 2 and 4).

    ``mpu``: megatron's sequence-parallel all-gather of a layer input (TP+SP's linears, and the
    output layer for every plan); ``weight0_*``: the ZeRO gathers (:func:`zero_weight_pool`,
    prefetch on or off); ``kv_*``: ring blocks (slot 1 from p = 3 on);
    ``zigzag_*``: the balanced layout's partner swap; METP's ``weight{j}_{slot}``: a head
    group's attention shards in one flat buffer (``weight0``, both slots) and the MLP's
    travelling shards (fc1, fc2, bias: ``weight0..2``, slot 0 at p = 2, both from p = 3 on).
    """
    if packs.is_pack(s):
        tokens = packs.geometry(s, shape.p).tokens
        return pack_pool(strategy, shape.p, s, pool_buffers(strategy, shape, tokens, 1, prefetch))
    p, e, h = shape.p, shape.elt, shape.hidden
    T = s * b
    t = T / p
    qw, kv = shape.qkv_width, shape.query_groups * shape.head_dim
    f, f1 = shape.ffn, (2 * shape.ffn if shape.swiglu else shape.ffn)
    w = {"qkv": h * qw, "proj": h * shape.heads * shape.head_dim, "fc1": h * f1, "fc2": f * h}
    out: dict = {}
    if strategy in ("nonlayer", "tp_sp"):
        out["mpu"] = T * h * e
    slots = (0, 1) if p >= 3 else (0,)
    if strategy in ZERO:
        out.update(zero_weight_pool(shape, prefetch))
    if strategy in ("ring", "colossal", "metp"):
        out["paradyse:zigzag_send"] = out["paradyse:zigzag_recv"] = T / (2 * p) * h * e
        for k in slots:
            names = ("k",) if strategy == "colossal" else ("k", "v")
            for n in names:
                out[f"paradyse:kv_{n}{k}"] = t * kv * e / (p if strategy == "metp" else 1)
    if strategy == "metp":
        # attention: head group i's shards in one flat buffer, slot i % 2 (every rank: the owner
        # packs its own there); MLP: the travelling shards, slot (step % 2) for steps 0..p-2
        attn = (w["qkv"] + w["proj"] + (qw if shape.bias else 0), 0, 0)
        mlp = (w["fc1"], w["fc2"], f1 if shape.bias else 0)
        for j in range(3):
            for slot in (0, 1):
                v = max(attn[j], mlp[j] if (slot == 0 or p >= 3) else 0)
                if v:
                    out[f"paradyse:weight{j}_{slot}"] = v / p * e
    dt = _DTYPE_NAME[shape.dtype]
    return {f"{k}/{dt}": float(v) for k, v in out.items()}


def pack_pool(strategy: str, p: int, s, pool: dict) -> dict:
    """A pack's pool from the single sequence's of its padded length (``pool``): the ring
    strategies' re-layout moves rows outside the pool (no ``zigzag_*`` buffers), and their
    K/V slots hold the largest block that travels (``count`` tokens), none where no document
    crosses a rank (tracker, p = 2: equal for every pack measured)."""
    if strategy not in packs.RING_LIKE:
        return dict(pool)
    g = packs.geometry(s, p)
    travels = g.hop_blocks > 0
    out = {}
    for name, v in pool.items():
        if "zigzag_" in name:
            continue
        if "paradyse:kv_" in name:
            if not travels:
                continue
            v = v * g.count / (g.tokens // p)
        out[name] = v
    return out


class AnalyticCostModel(CostModel):
    """Memory from the formulas above; time from a roofline + alpha-beta collectives.

    Recomputed blocks (``st:rc-attn``, ``st:rc-mlp``): :func:`assumed_block_recompute`.
    Recomputed layers (plan entry ``st:rc``, :meth:`recomputes`): *assumed*, not measured:
    time, the plain layer plus its forward once more (``1 / passes`` of it: a third, a fourth
    for ``metp``, whose backward already recomputes part of its forward, :func:`flops_parts`);
    saved, one ``[s/p, b, h]`` tensor (the layer's output, the next layer's input; the
    checkpoint's few RNG states are left out); transient, the plain layer's saved + transient
    (the recompute rebuilds what the plain layer saves, then its backward runs as the plain
    one's). The profile measures these (``recompute`` rows; ``fit.fit_recompute``); this model
    is the fallback for shapes without one.
    """

    kind = "analytic"

    def __init__(self, shape: ModelShape, hardware: str = "cpu", hardware_path: str | None = None,
                 interconnect: str | None = None, interconnect_path: str | None = None,
                 optimizer: str = "adam", prefetch: bool = True):
        self.shape = shape
        self.prefetch = prefetch
        self.strategies = STRATEGIES
        self.num_layers = shape.num_layers
        hw_all = load_config("hardware.json", hardware_path)
        if hardware not in hw_all:
            raise ValueError(f"unknown hardware {hardware!r} in {hardware_path or 'hardware.json'}: "
                             f"{sorted(k for k in hw_all if not k.startswith('_'))}")
        self.hw = hw_all[hardware]
        self.hardware = hardware
        nets = load_config("interconnects.json", interconnect_path)
        name = interconnect or self.hw["interconnect"]
        if name not in nets:
            raise ValueError(f"unknown interconnect {name!r}: {sorted(k for k in nets if not k.startswith('_'))}")
        self.net = nets[name]
        self.optimizer = optimizer

    def device_kind(self) -> str:
        return "cpu" if self.hardware == "cpu" else "cuda"

    def _check(self, strategy, s, b):
        if strategy not in self.strategies:
            raise KeyError(f"unknown strategy {strategy!r}; the model knows {self.strategies}")
        check_length(s, b, self.shape.p)

    def recomputes(self) -> bool:
        return True

    def recompute_kinds(self) -> tuple:
        return ("layer", "attn", "mlp")

    def layer(self, strategy: str, s: int, b: int) -> LayerCost:
        base, rc = split_entry(strategy)
        if rc == "layer":
            tokens, bb = as_tokens(s, b, self.shape.p)
            return assumed_recompute(base, self.layer(base, s, b), basis(self.shape, tokens, bb)["t*h"])
        if rc:
            return assumed_block_recompute(base, self.shape, s, b, self.layer(base, s, b), rc)
        self._check(strategy, s, b)
        saved, trans = layer_memory(strategy, self.shape, s, b)
        flops = layer_flops(strategy, self.shape, s, b)
        secs = flops / self.hw["flops"][self.shape.dtype] + 3 * (saved + trans) / self.hw["mem_bw"] \
            + comm_seconds(strategy, self.shape, s, b, self.net)
        return LayerCost(secs, saved, trans)

    def static_bytes(self) -> float:
        return static_bytes(self.shape, self.optimizer)

    def pool(self, strategy: str, s: int, b: int) -> dict:
        return pool_buffers(strategy_of(strategy), self.shape, s, b, self.prefetch)  # st:rc's pool is st's

    def nonlayer(self, s, b: int) -> LayerCost:
        sh = self.shape
        s, b = as_tokens(s, b, sh.p)
        saved, trans = nonlayer_memory(sh, s, b)
        T = s * b
        flops = 3 * 2 * 2 * T * sh.hidden * sh.vocab / sh.p  # output layer; embedding is a gather
        secs = flops / self.hw["flops"][sh.dtype] + 3 * (saved + trans) / self.hw["mem_bw"]
        return LayerCost(secs, saved, trans)

    def update_seconds(self) -> float:
        """Adam reads and writes 16 bytes per parameter (memory bound), plus the collectives."""
        sh = self.shape
        opt = 16 * (param_counts(sh)["layers"] + 2 * sh.vocab * sh.hidden / sh.p) / self.hw["mem_bw"]
        return opt + update_comm_seconds(sh, self.net)
