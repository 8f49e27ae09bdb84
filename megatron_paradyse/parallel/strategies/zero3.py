"""ZeRO-3-style linears over stock TP shards, shared by ``ulysses``, ``ring`` and ``colossal``.

The TP shards are gathered into the communication pool, used, and dropped: backward gathers
them again and reduce-scatters the full weight gradient back to the owners' shards. Autograd
never holds a gathered weight, so between layers each rank holds only its stock shard. Each
gather is prefetched: posted by the ZeRO linear before it, in forward and in backward
(``../prefetch.py``); the hints (which linear comes next) are made here.
"""
from __future__ import annotations

import types

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from .. import collectives, prefetch, recompute
from ..prefetch import Target
from .base import (STRATEGY_ATTR, apply_activation, apply_rope, bias_of, rope_freqs, row_output, split_qkv,
                   switching_group, weight_grad, wgrad_fusion)
from .registry import REGISTRY

# alternating pool slots
_ROLE = types.MappingProxyType({"linear_qkv": 0, "linear_proj": 1, "linear_fc1": 0, "linear_fc2": 1})


class ZeroLinear(torch.autograd.Function):
    """``y = x W^T`` on local tokens, ``W`` rebuilt from dim-``shard_dim`` shards.

    Forward: W from the pool (its prefetched gather, else gathered now), after posting the gather
    of ``then[0]`` (the next ZeRO weight, or None). Backward: W again (posting ``then[1]``'s, the
    next in backward order), ``dx = dy W``, then reduce-scatter ``dW`` to the owners. (Not
    megatron's linear: it gathers activations, not weights.) ``main_grad``:
    :func:`~.base.wgrad_fusion` of the linear (the shard's gradient is then accumulated there,
    as megatron's fused linear does). ``role``: the pool slot (:class:`~..prefetch.Target`).
    """

    @staticmethod
    def forward(ctx, x, w_shard, group, shard_dim, main_grad=None, role=0, then=(None, None)):
        wt = shard_dim == 1  # gathered tensor is W^T for row-parallel shards
        w = prefetch.weight(Target(w_shard, shard_dim, group, role), then[0])
        y = x.matmul(w) if wt else x.matmul(w.t())
        ctx.save_for_backward(x, w_shard)
        ctx.group, ctx.shard_dim, ctx.main_grad, ctx.role, ctx.then = group, shard_dim, main_grad, role, then[1]
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w_shard = ctx.saved_tensors
        wt = ctx.shard_dim == 1
        w = prefetch.weight(Target(w_shard, ctx.shard_dim, ctx.group, ctx.role), ctx.then)
        dx = dy.matmul(w.t()) if wt else dy.matmul(w)
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dw_full = x2.t().matmul(dy2) if wt else dy2.t().matmul(x2)
        dw = collectives.scatter_grad(dw_full, ctx.shard_dim, ctx.group)
        return dx, weight_grad(w_shard, dw, ctx.main_grad, x.dtype), None, None, None, None, None


def zero_linear(lin, x, group, shard_dim, name, then=(None, None)):
    """``ZeroLinear`` over the stock linear ``lin`` (the module's ``name``: its pool slot; one
    slot at p = 1, which prefetches nothing) with its gradient-accumulation fusion, if on;
    ``then``: the next ZeRO weights (forward, backward)."""
    role = _ROLE[name] if torch.distributed.get_world_size(group) > 1 else 0
    return ZeroLinear.apply(x, lin.weight, group, shard_dim, wgrad_fusion(lin), role, then)


# ---------------------------------------------------------------------------------------------
# which ZeRO weight comes next (prefetch hints), decided when the linear runs its forward


def _target(module, name, group):
    lin = getattr(module, name)
    return Target(lin.weight, 1 if name in ("linear_proj", "linear_fc2") else 0, group, _ROLE[name])


def runs_zero(module) -> bool:
    """Whether ``module`` (a layer's attention or MLP) runs a ZeRO strategy in this pass."""
    name = recompute.lookup(module, STRATEGY_ATTR)
    return name is not None and getattr(REGISTRY.get(name), "zero_weights", False)


def _within(module, name, group):
    """The weight ``name`` of the other module of ``module``'s layer, if it runs ZeRO."""
    other = prefetch.links(module).sibling
    if other is None or not runs_zero(other) or switching_group(other) is not group:
        return None
    return _target(other, name, group)


def _across(module, name, group):
    """The weight ``name`` of the neighbouring layer's module (attention: the previous layer's
    MLP, whose backward is next; MLP: the next layer's attention, whose forward is next), if it
    runs ZeRO and no recompute reorders the gathers."""
    layer = prefetch.links(module).neighbour
    if layer is None or recompute.inside_checkpoint() or module.config.recompute_granularity is not None:
        return None
    other = layer.mlp if name == "linear_fc2" else layer.self_attention
    if not runs_zero(other) or switching_group(other) is not group:
        return None
    if name == "linear_fc2" and recompute.lookup(layer, recompute.RC_ATTR):
        return None  # its backward begins with the recompute of its forward
    return _target(other, name, group)


def hints(module, name, group) -> tuple:
    """(next in forward, next in backward) ZeRO weights after ``module``'s linear ``name``
    (none at p = 1, where a gather is a copy with nothing to overlap)."""
    if not prefetch.enabled() or torch.distributed.get_world_size(group) == 1:
        return None, None
    if name == "linear_qkv":
        return _target(module, "linear_proj", group), _across(module, "linear_fc2", group)
    if name == "linear_proj":
        return _within(module, "linear_fc1", group), _target(module, "linear_qkv", group)
    if name == "linear_fc1":
        return _target(module, "linear_fc2", group), _within(module, "linear_proj", group)
    return _across(module, "linear_qkv", group), _target(module, "linear_fc1", group)


def linear(module, name, x, group, shard_dim):
    """``module``'s stock linear ``name`` as a ZeRO linear with its prefetch hints."""
    return zero_linear(getattr(module, name), x, group, shard_dim, name, hints(module, name, group))


def gather_bias(bias, group):
    """A column-parallel bias gathered whole; backward reduce-scatters its gradient (megatron's
    sequence-parallel gather with ``tensor_parallel_output_grad=True``)."""
    return gather_from_sequence_parallel_region(bias, tensor_parallel_output_grad=True, group=group)


def column(module, name, x, group):
    """``module``'s stock ``ColumnParallelLinear`` ``name`` applied to local tokens with its
    weight gathered (its bias added, gathered whole)."""
    lin = getattr(module, name)
    y = linear(module, name, x, group, 0)
    b = bias_of(lin)
    if b is not None and not lin.skip_bias_add:
        y = y + gather_bias(b, group)
    return y


def row(module, name, x, group):
    """``module``'s stock ``RowParallelLinear`` ``name`` applied to local tokens; returns (y, bias)
    like the stock one."""
    return row_output(getattr(module, name), linear(module, name, x, group, 1))


def qkv_local_tokens(attn, hidden_states, rotary_pos_emb, geo, positions=None):
    """Q, K, V for this rank's tokens and *all* heads, ``[s/p, b, heads|groups, d]``, with RoPE
    at the tokens' global positions (``positions``: see ``base.apply_rope``; default: the
    rank's contiguous chunk)."""
    mixed = column(attn, "linear_qkv", hidden_states, geo.group)
    q, k, v = split_qkv(mixed, geo.groups, geo.q_per_group, geo.head_dim)
    if positions is None:
        positions = geo.rank * hidden_states.shape[0]
    qf, kf = rope_freqs(rotary_pos_emb)
    return apply_rope(q, qf, attn.config, positions), apply_rope(k, kf, attn.config, positions), v


def mlp(mlp_module, hidden_states):
    """The whole MLP on local tokens, both weights gathered just in time."""
    lin1 = mlp_module.linear_fc1
    group = switching_group(mlp_module)
    inter = linear(mlp_module, "linear_fc1", hidden_states, group, 0)
    bias1 = bias_of(lin1)
    bias1 = gather_bias(bias1, group) if bias1 is not None else None
    act = apply_activation(mlp_module, inter, bias1, shards=torch.distributed.get_world_size(group))
    return row(mlp_module, "linear_fc2", act, group)
