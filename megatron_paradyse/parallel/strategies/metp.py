"""``metp``: memory-efficient tensor parallelism (Liang et al., FITEE 2025).

Activations stay sequence-sharded ``[s/p, b, h]`` the whole time, so no rank holds a
full-sequence activation; the weights travel instead, shard by shard, so besides its own
stock shard a rank holds at most two other TP shards of a weight matrix (the one in use and
the one arriving), never the gathered matrix.

Attention, forward: for each head group ``i = 0..p-1`` (the heads whose ``linear_qkv`` and
``linear_proj`` shards group rank ``i`` owns), rank ``i`` broadcasts those two shards (and its
QKV bias shard) packed in one flat buffer; the next group's broadcast is posted before this
group's compute (double-buffered), on a communicator of its own (``groups.weight_group``: the
switching group's twin, so NCCL does not queue it behind the ring attention's hops). Every
rank computes the QKV of its own tokens for group ``i``'s heads, applies RoPE at the tokens'
global positions, runs causal ring attention over the group's heads
(:class:`~.ring.RingAttention`; the layer's tokens are re-laid out to the balanced split of
``zigzag.py`` before the attention and back after it) and adds ``ctx_i W_proj_i^T`` to its
output. Backward: the same broadcasts in the same order; per group the QKV, RoPE and ring
attention are recomputed (activation-checkpoint style) and differentiated, each weight gradient
(a partial sum over this rank's tokens) goes into row ``i`` of a ``[p, shard]`` fp32 buffer, and
one reduce-scatter hands each owner the sum of its row; the input gradient ``dmixed_i W_qkv_i``
is accumulated locally.

MLP, forward: the ``linear_fc1`` shards (``[gate_r; up_r]`` when gated, plus bias) and
``linear_fc2`` shards rotate around the ring (double-buffered, the next shard in flight
while the current one is used); at each of the p steps a rank adds
``act(x W1_j^T + b1_j) W2_j^T`` for the shard ``j`` it holds. The ``[s/p, b, ffn/p]``
intermediate is never stored. Backward: the shards rotate again, the intermediate is
recomputed, and the weight gradients travel one hop behind their shard as accumulators
(each rank adds its tokens' contribution); a last hop hands each owner its complete
gradient (``ring_comm.FlatRing``'s stream and gradient ring, as ``ring`` does for dK/dV).

Collectives per layer: forward ``p`` flat broadcasts and ``p`` ring attentions (``p-1`` K/V
hops each); backward the same broadcasts, ``p`` ring attentions recomputed and differentiated,
and one reduce-scatter (``tests/test_metp_collectives.py`` counts them). MLP: ``p-1`` hops of
(W1, W2, b1 if any) forward; backward ``p-1`` weight hops and ``p`` gradient hops. The
attention's re-layout: one partner swap of half the local tokens before and one after, forward
and backward. The next group's broadcast and the next shard's hop are in flight while the
current one computes.
Memory: autograd saves only the layer input ``[s/p, b, h]`` and the rank's own shards
(parameters, no copy): no other rank's weight, no QKV, no intermediate. Transient: two
other ranks' shards of a matrix at a time (one in use, one arriving), in two pool slots
that attention and MLP share; one head group's QKV ``[s/p, b, 3h/p]`` (with GQA less) and
its ring state, or one shard's intermediate ``[s/p, b, ffn/p]``; in backward two fp32
gradient accumulators per travelling MLP shard, and the attention's ``[p, shard]`` fp32
gradient rows (the layer's whole attention weights in fp32). Sums over shards and ranks (outputs, input
and weight gradients) are accumulated in fp32.
"""
from __future__ import annotations

import torch

from .. import context
from ..buffers import weight_slot
from ..collectives import broadcast_flat_start, reduce_scatter_flat, wait
from ..groups import weight_group
from ..ring_comm import FlatRing
from .base import (Strategy, apply_activation, apply_rope, bias_of, from_bhsd, geometry, rope_freqs,
                   row_output, split_qkv, switching_group, to_bhsd, weight_grad, wgrad_fusion,
                   zero_support)
from .ring import ring_attention
from .ring_base import arrange, restore, ring_layout

_ACC = torch.float32  # dtype of every sum over shards or ranks


def _flat(t):
    return t.reshape(-1, t.shape[-1])


# ---------------------------------------------------------------------------------------------
# attention: weights broadcast one head group at a time


def _group_weights(shards, src, group):
    """Post the broadcast of group rank ``src``'s ``shards``, packed in one flat buffer in pool
    slot ``src % 2``, on the weight communicator (``groups.weight_group``: not behind the ring
    attention's hops): one collective per head group."""
    return broadcast_flat_start(shards, src, weight_group(group), weight_slot(0, src % 2))


def _group_weight_stream(shards, group, p):
    """Yield ``(i, shards of group rank i)`` for i = 0..p-1, the broadcast of group i+1 in flight.

    A yielded list (pool slots, or the owner's parameters) is valid until the generator has
    been advanced twice.
    """
    pending = _group_weights(shards, 0, group)
    for i in range(p):
        weights, works = pending
        wait(works)
        if i + 1 < p:
            pending = _group_weights(shards, i + 1, group)
        yield i, weights


def _group_qkv(x, wq, bq):
    """Mixed QKV ``[s/p, b, (groups/p)*(q_per_group+2)*d]`` of the local tokens for one head group."""
    mixed = x.matmul(wq.t())
    return mixed + bq if bq is not None else mixed


def _group_attention(mixed, geo, qf, kf, config, span):
    """Split, RoPE and causal ring attention (over ``span``: ``context.Span``) for one head
    group: ``[s/p, b, (heads/p)*d]``."""
    q, k, v = split_qkv(mixed, geo.groups // geo.p, geo.q_per_group, geo.head_dim)
    q, k = apply_rope(q, qf, config, span.positions), apply_rope(k, kf, config, span.positions)
    ctx = ring_attention(to_bhsd(q), to_bhsd(k).contiguous(), to_bhsd(v).contiguous(), span.ring,
                         geo.scale, span.layout)
    return from_bhsd(ctx)


def _attn_shards(w_qkv, b_qkv, w_proj):
    return [w_qkv, w_proj] + ([b_qkv] if b_qkv is not None else [])


class METPAttention(torch.autograd.Function):
    """Self-attention (QKV, RoPE, causal attention, output projection, no proj bias) on local tokens.

    Takes this rank's tokens ``x`` as laid out by ``layout`` (``zigzag.RingLayout``), its stock
    shards ``w_qkv`` ``[(groups/p)*(q_per_group+2)*d, h]``, ``b_qkv`` (or None) and ``w_proj``
    ``[h, (heads/p)*d]``; returns ``[s/p, b, h]`` in the same layout. Saves ``x`` and this
    rank's own shards (parameters, no copy): never a broadcast shard. ``main_grads``: the
    :func:`~.base.wgrad_fusion` of ``linear_qkv`` and ``linear_proj`` (None: no fusion).
    """

    @staticmethod
    def forward(ctx, x, w_qkv, b_qkv, w_proj, geo, qf, kf, config, span, main_grads=(None, None)):
        out = torch.zeros(x.shape[:-1] + (w_proj.shape[0],), dtype=_ACC, device=x.device)
        shards = _attn_shards(w_qkv, b_qkv, w_proj)
        for _, (wq, wp, *bq) in _group_weight_stream(shards, geo.group, geo.p):
            bq = bq[0] if bq else None
            attn = _group_attention(_group_qkv(x, wq, bq), geo, qf, kf, config, span)
            out += attn.matmul(wp.t())
        ctx.save_for_backward(x, w_qkv, b_qkv, w_proj)
        ctx.geo, ctx.qf, ctx.kf, ctx.config, ctx.span = geo, qf, kf, config, span
        ctx.main_grads = main_grads
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, dout):
        x, w_qkv, b_qkv, w_proj = ctx.saved_tensors
        geo = ctx.geo
        dx = torch.zeros(x.shape, dtype=_ACC, device=x.device)
        x2, dout2 = _flat(x), _flat(dout)
        shards = _attn_shards(w_qkv, b_qkv, w_proj)
        sizes = [w.numel() for w in shards]  # every group's shards have these shapes
        # row i: head group i's weight gradients (partial sums over this rank's tokens), flat in
        # the broadcast's order; one reduce-scatter hands each owner the sum of its row
        rows = torch.empty((geo.p, sum(sizes)), dtype=_ACC, device=x.device)
        for i, (wq, wp, *bq) in _group_weight_stream(shards, geo.group, geo.p):
            bq = bq[0] if bq else None
            mixed = _group_qkv(x, wq, bq).detach().requires_grad_(True)  # recomputed
            with torch.enable_grad():
                attn = _group_attention(mixed, geo, ctx.qf, ctx.kf, ctx.config, ctx.span)
            row = rows[i].split(sizes)  # this group's dW_qkv, dW_proj (and db_qkv) slots
            row[1].view(wp.shape).copy_(dout2.t().matmul(_flat(attn.detach())))
            (dmixed,) = torch.autograd.grad(attn, mixed, dout.matmul(wp))
            del attn
            dx += dmixed.matmul(wq)
            dm2 = _flat(dmixed)
            row[0].view(wq.shape).copy_(dm2.t().matmul(x2))
            if bq is not None:
                torch.sum(dm2, 0, dtype=_ACC, out=row[2])
        mine = reduce_scatter_flat(rows, geo.group).split(sizes)
        del rows
        mg_qkv, mg_proj = ctx.main_grads
        dwq = weight_grad(w_qkv, mine[0].view(w_qkv.shape), mg_qkv, x.dtype)
        dwp = weight_grad(w_proj, mine[1].view(w_proj.shape), mg_proj, x.dtype)
        dbq = mine[2].view(b_qkv.shape).to(b_qkv.dtype) if b_qkv is not None else None
        return dx.to(x.dtype), dwq, dbq, dwp, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# MLP: weight shards rotate around the ring


def _fc1(x, w1):
    return x.matmul(w1.t())


class METPMLP(torch.autograd.Function):
    """The MLP (fc1, activation, fc2, no fc2 bias) on local tokens with rotating weight shards.

    ``w1`` ``[ffn/p, h]`` (``[2*ffn/p, h]`` as ``[gate_r; up_r]`` when gated), ``b1`` (or None)
    and ``w2`` ``[h, ffn/p]`` are this rank's stock shards; returns ``[s/p, b, h]``. Saves
    ``x`` and the own shards (parameters, no copy); the intermediate is recomputed.
    ``main_grads``: the :func:`~.base.wgrad_fusion` of ``linear_fc1`` and ``linear_fc2``.
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, mlp, group, main_grads=(None, None)):
        shards = [w1, w2] + ([b1] if b1 is not None else [])
        out = torch.zeros(x.shape[:-1] + (w2.shape[0],), dtype=_ACC, device=x.device)
        for _, cur in FlatRing(group).stream(shards, weight_slot):
            bias = cur[2] if b1 is not None else None
            out += apply_activation(mlp, _fc1(x, cur[0]), bias, shards=1).matmul(cur[1].t())
        ctx.save_for_backward(x, w1, b1, w2)
        ctx.mlp, ctx.group, ctx.main_grads = mlp, group, main_grads
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, dout):
        x, w1, b1, w2 = ctx.saved_tensors
        group = ctx.group
        shards = [w1, w2] + ([b1] if b1 is not None else [])
        x2, dout2 = _flat(x), _flat(dout)
        dx = torch.zeros(x.shape, dtype=_ACC, device=x.device)
        ring = FlatRing(group)
        grads = ring.grad_ring(shards)
        for _, cur in ring.stream(shards, weight_slot):
            wa, wb = cur[0], cur[1]
            bias = cur[2].detach().requires_grad_(True) if b1 is not None else None
            pre = _fc1(x, wa).detach().requires_grad_(True)  # recomputed
            with torch.enable_grad():
                act = apply_activation(ctx.mlp, pre, bias, shards=1)
            dw2 = dout2.t().matmul(_flat(act.detach())).to(_ACC)
            leaves = [pre] + ([bias] if bias is not None else [])
            dpre, *dbias = torch.autograd.grad(act, leaves, dout.matmul(wb))
            del act
            dx += dpre.matmul(wa)
            contrib = [_flat(dpre).t().matmul(x2).to(_ACC), dw2] + [db.to(_ACC) for db in dbias]
            grads.add(contrib)
        final = grads.result()
        dw1 = weight_grad(w1, final[0], ctx.main_grads[0], x.dtype)
        dw2 = weight_grad(w2, final[1], ctx.main_grads[1], x.dtype)
        db1 = final[2].to(b1.dtype) if b1 is not None else None
        return dx.to(x.dtype), dw1, db1, dw2, None, None, None


# ---------------------------------------------------------------------------------------------


class METP(Strategy):
    name = "metp"
    description = ("memory-efficient TP: activations stay sequence-sharded; attention weights "
                   "broadcast per head group with ring attention, MLP weights rotate on a ring")

    def supports(self, config, p):
        ok, why = zero_support(config, p)
        if not ok:
            return ok, why
        groups = config.num_query_groups or config.num_attention_heads
        if groups % p:
            return False, (f"num_query_groups ({groups}) must be divisible by p ({p}): each rank's "
                           "linear_qkv shard must hold whole query groups")
        return True, ""

    def attention(self, attn, hidden_states, rotary_pos_emb, docs=None):
        geo = geometry(attn)
        qkv = attn.linear_qkv
        b = bias_of(qkv)
        b = b if (b is not None and not qkv.skip_bias_add) else None
        qf, kf = rope_freqs(rotary_pos_emb)
        cp = context.cp_of(attn.config)
        layout = ring_layout(hidden_states, geo.group, docs, cp)
        x = arrange(hidden_states, layout, geo.group)
        span = context.ring_span(layout, geo.group, geo.rank, cp, docs, hidden_states.device)
        out = METPAttention.apply(x, qkv.weight, b, attn.linear_proj.weight, geo, qf, kf,
                                  attn.config, span, (wgrad_fusion(qkv), wgrad_fusion(attn.linear_proj)))
        return row_output(attn.linear_proj, restore(out, layout, geo.group))

    def mlp(self, mlp, hidden_states):
        group = switching_group(mlp)
        out = METPMLP.apply(hidden_states, mlp.linear_fc1.weight, bias_of(mlp.linear_fc1),
                            mlp.linear_fc2.weight, mlp, group,
                            (wgrad_fusion(mlp.linear_fc1), wgrad_fusion(mlp.linear_fc2)))
        return row_output(mlp.linear_fc2, out)
