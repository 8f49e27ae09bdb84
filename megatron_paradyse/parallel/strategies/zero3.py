"""ZeRO-3-style linears over stock TP shards, shared by ``ulysses``, ``ring`` and ``colossal``.

The TP shards are gathered just in time into the communication pool, used, and dropped:
backward gathers them again and reduce-scatters the full weight gradient back to the
owners' shards. Autograd never holds a gathered weight, so between layers each rank holds
only its stock shard.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from .. import collectives
from ..buffers import weight_slot
from .base import (apply_activation, apply_rope, bias_of, rope_freqs, row_output, split_qkv, switching_group,
                   weight_grad, wgrad_fusion)


class ZeroLinear(torch.autograd.Function):
    """``y = x W^T`` on local tokens, ``W`` rebuilt from dim-``shard_dim`` shards.

    Forward: all-gather W into the pool. Backward: all-gather W again, ``dx = dy W``, then
    reduce-scatter ``dW`` to the owners. (Not megatron's linear: it gathers activations, not
    weights.) ``main_grad``: :func:`~.base.wgrad_fusion` of the linear (the shard's gradient
    is then accumulated there, as megatron's fused linear does).
    """

    @staticmethod
    def forward(ctx, x, w_shard, group, shard_dim, main_grad=None):
        wt = shard_dim == 1  # gathered tensor is W^T for row-parallel shards
        w = collectives.gather_shards(w_shard, shard_dim, group, weight_slot(0, 0))
        y = x.matmul(w) if wt else x.matmul(w.t())
        ctx.save_for_backward(x, w_shard)
        ctx.group, ctx.shard_dim, ctx.main_grad = group, shard_dim, main_grad
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w_shard = ctx.saved_tensors
        wt = ctx.shard_dim == 1
        w = collectives.gather_shards(w_shard, ctx.shard_dim, ctx.group, weight_slot(0, 0))
        dx = dy.matmul(w.t()) if wt else dy.matmul(w)
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dw_full = x2.t().matmul(dy2) if wt else dy2.t().matmul(x2)
        dw = collectives.scatter_grad(dw_full, ctx.shard_dim, ctx.group)
        return dx, weight_grad(w_shard, dw, ctx.main_grad, x.dtype), None, None, None


def zero_linear(lin, x, group, shard_dim):
    """``ZeroLinear`` over the stock linear ``lin``'s weight (with its gradient-accumulation
    fusion, if on)."""
    return ZeroLinear.apply(x, lin.weight, group, shard_dim, wgrad_fusion(lin))


def gather_bias(bias, group):
    """A column-parallel bias gathered whole; backward reduce-scatters its gradient (megatron's
    sequence-parallel gather with ``tensor_parallel_output_grad=True``)."""
    return gather_from_sequence_parallel_region(bias, tensor_parallel_output_grad=True, group=group)


def column(linear, x, group):
    """A stock ``ColumnParallelLinear`` applied to local tokens with its weight gathered."""
    y = zero_linear(linear, x, group, 0)
    b = bias_of(linear)
    if b is not None and not linear.skip_bias_add:
        y = y + gather_bias(b, group)
    return y


def row(linear, x, group):
    """A stock ``RowParallelLinear`` applied to local tokens; returns (y, bias) like the stock one."""
    return row_output(linear, zero_linear(linear, x, group, 1))


def qkv_local_tokens(attn, hidden_states, rotary_pos_emb, geo, positions=None):
    """Q, K, V for this rank's tokens and *all* heads, ``[s/p, b, heads|groups, d]``, with RoPE
    at the tokens' global positions (``positions``: see ``base.apply_rope``; default: the
    rank's contiguous chunk)."""
    mixed = column(attn.linear_qkv, hidden_states, geo.group)
    q, k, v = split_qkv(mixed, geo.groups, geo.q_per_group, geo.head_dim)
    if positions is None:
        positions = geo.rank * hidden_states.shape[0]
    qf, kf = rope_freqs(rotary_pos_emb)
    return apply_rope(q, qf, attn.config, positions), apply_rope(k, kf, attn.config, positions), v


def mlp(mlp_module, hidden_states):
    """The whole MLP on local tokens, both weights gathered just in time."""
    lin1 = mlp_module.linear_fc1
    group = switching_group(mlp_module)
    inter = zero_linear(lin1, hidden_states, group, 0)
    bias1 = bias_of(lin1)
    bias1 = gather_bias(bias1, group) if bias1 is not None else None
    act = apply_activation(mlp_module, inter, bias1, shards=torch.distributed.get_world_size(group))
    return row(mlp_module.linear_fc2, act, group)
