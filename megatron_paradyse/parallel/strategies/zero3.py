"""ZeRO-3-style linears over stock TP shards, shared by ``ulysses``, ``ring`` and ``colossal``.

The TP shards are gathered just in time into the communication pool, used, and dropped:
backward gathers them again and reduce-scatters the full weight gradient back to the
owners' shards. Autograd never holds a gathered weight, so between layers each rank holds
only its stock shard.
"""
from __future__ import annotations

import torch

from .. import comm
from .base import (Strategy, apply_activation, apply_rope, bias_of, from_bhsd, geometry, rope_freqs,
                   split_qkv, switching_group, to_bhsd, zero_support)


class ZeroLinear(torch.autograd.Function):
    """``y = x W^T (+ b)`` on local tokens, ``W`` rebuilt from dim-``shard_dim`` shards.

    Forward: all-gather W (and a column-parallel bias). Backward: all-gather W again,
    ``dx = dy W``, then reduce-scatter ``dW`` (and ``db``) to the owners.
    """

    @staticmethod
    def forward(ctx, x, w_shard, b_shard, group, shard_dim):
        wt = shard_dim == 1  # gathered tensor is W^T for row-parallel shards
        w = comm.gather_shards(w_shard, shard_dim, group, comm.weight_slot(0, 0))
        y = x.matmul(w) if wt else x.matmul(w.t())
        if b_shard is not None:
            y = y + comm.all_gather_dim0(b_shard, group, comm.weight_slot(2, 0))
        ctx.save_for_backward(x, w_shard)
        ctx.group, ctx.shard_dim, ctx.has_bias = group, shard_dim, b_shard is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w_shard = ctx.saved_tensors
        wt = ctx.shard_dim == 1
        w = comm.gather_shards(w_shard, ctx.shard_dim, ctx.group, comm.weight_slot(0, 0))
        dx = dy.matmul(w.t()) if wt else dy.matmul(w)
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dw_full = x2.t().matmul(dy2) if wt else dy2.t().matmul(x2)
        dw = comm.scatter_grad(dw_full, ctx.shard_dim, ctx.group)
        db = comm.reduce_scatter_dim0(dy2.sum(0), ctx.group) if ctx.has_bias else None
        return dx, dw.to(w_shard.dtype), db, None, None


def column(linear, x, group):
    """A stock ``ColumnParallelLinear`` applied to local tokens with its weight gathered."""
    b = bias_of(linear)
    b = b if (b is not None and not linear.skip_bias_add) else None
    return ZeroLinear.apply(x, linear.weight, b, group, 0)


def row(linear, x, group):
    """A stock ``RowParallelLinear`` applied to local tokens; returns (y, bias) like the stock one."""
    y = ZeroLinear.apply(x, linear.weight, None, group, 1)
    bias = bias_of(linear)
    if bias is not None and not linear.skip_bias_add:
        return y + bias, None
    return y, bias


def qkv_local_tokens(attn, hidden_states, rotary_pos_emb, geo):
    """Q, K, V for this rank's tokens and *all* heads, ``[s/p, b, heads|groups, d]``, with RoPE
    at the tokens' global positions."""
    mixed = column(attn.linear_qkv, hidden_states, geo.group)
    q, k, v = split_qkv(mixed, geo.groups, geo.q_per_group, geo.head_dim)
    start = geo.rank * hidden_states.shape[0]
    qf, kf = rope_freqs(rotary_pos_emb)
    return apply_rope(q, qf, attn.config, start), apply_rope(k, kf, attn.config, start), v


class _GatherBias(torch.autograd.Function):
    """All-gather a column-parallel bias; backward reduce-scatters its gradient."""

    @staticmethod
    def forward(ctx, b, group):
        ctx.group = group
        return comm.all_gather_dim0(b, group, comm.weight_slot(2, 0)).clone()

    @staticmethod
    def backward(ctx, db):
        return comm.reduce_scatter_dim0(db.contiguous(), ctx.group), None


def mlp(mlp_module, hidden_states):
    """The whole MLP on local tokens, both weights gathered just in time."""
    lin1 = mlp_module.linear_fc1
    group = switching_group(mlp_module)
    inter = ZeroLinear.apply(hidden_states, lin1.weight, None, group, 0)
    bias1 = bias_of(lin1)
    bias1 = _GatherBias.apply(bias1, group) if bias1 is not None else None
    act = apply_activation(mlp_module, inter, bias1, shards=torch.distributed.get_world_size(group))
    return row(mlp_module.linear_fc2, act, group)


class SequenceShardedStrategy(Strategy):
    """A strategy that attends from local tokens: QKV and output projection with gathered
    weights, the ZeRO MLP, and a sequence-parallel attention core that subclasses provide."""

    def supports(self, config, p):
        return zero_support(config, p)

    def core(self, q, k, v, geo):
        """``q [b, n, s/p, d]``, ``k``/``v`` ``[b, kv, s/p, d]`` to the causal output like ``q``."""
        raise NotImplementedError

    def attention(self, attn, hidden_states, rotary_pos_emb):
        geo = geometry(attn)
        q, k, v = qkv_local_tokens(attn, hidden_states, rotary_pos_emb, geo)
        ctx = self.core(to_bhsd(q), to_bhsd(k).contiguous(), to_bhsd(v).contiguous(), geo)
        return row(attn.linear_proj, from_bhsd(ctx), geo.group)

    def mlp(self, mlp_module, hidden_states):
        return mlp(mlp_module, hidden_states)
