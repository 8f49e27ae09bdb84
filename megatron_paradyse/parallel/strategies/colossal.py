"""``colossal``: Colossal-AI sequence parallelism (Ring Self-Attention) with ZeRO-3 weights (ColossalZ).

Ring Self-Attention (Li et al. 2021, "Sequence Parallelism: Long Sequence Training from
System Perspective") materialises the score rows of the local queries against the whole
sequence, where ``ring`` merges flash-attention blocks by their log-sum-exp.

Forward: the layer input is re-laid out to the balanced split (``zigzag.py``), QKV for those
tokens and all heads (weight gathered just in time), RoPE at their global positions, then
:class:`RingSelfAttention`. Stage 1, a K ring: p steps, each passing the visiting K block to
the next rank while writing ``S_j = Q K_j^T * scale`` into the local rows ``S [b, n, s/p, s]``
(fp32, columns are global positions) for the queries that see block j under the causal mask
(``RingLayout.visible``: unseen parts are never computed and get probability exactly zero;
the rank's own tokens are masked on the diagonal). The softmax runs over the seen part of
each row, in place, giving ``P``. Stage 2, a V ring: ``O = sum_j P_j V_j``. Output projection,
then the inverse re-layout; MLP as in ``zero3.py``.
Backward: a V ring gives ``dP_j = dO V_j^T`` and ``dV_j = P_j^T dO``; then
``dS = P * (dP - rowsum(dP * P))``; a K ring gives ``dQ = sum_j dS_j K_j * scale`` and
``dK_j = dS_j^T Q * scale``. dK/dV travel in an accumulator one hop behind their block, and
a last hop hands each block's complete gradient to its owner (as in ``ring``).
Collectives: point-to-point only (two rings forward, two rings and two accumulator rings
backward, the re-layout's partner swaps), plus the ZeRO-3 weight all-gathers / gradient
reduce-scatters.
Memory: the saved probabilities ``P [b, n, s/p, s]`` (quadratic in s, the nature of RSA),
a ``dS`` of the same size during backward, one K or V block in flight, one gathered
weight at a time. With GQA, blocks travel with ``num_query_groups`` heads and are expanded
to the query heads only for the matmuls; their gradients are summed back.
"""
from __future__ import annotations

import torch

from ..attention_kernels import expand_kv, reduce_kv
from ..buffers import block_slot
from ..collectives import group_info
from ..ring_comm import GradRing, ring_stream
from .ring_base import RingStrategy


def _ring(block, group, layout, visit, grad: bool = False):
    """Pass ``block`` once around the ring, calling ``visit(src, blk, seen)`` for every block
    some local query sees (``seen``: ``layout.visible(rank, src)``).

    With ``grad``, ``visit`` returns this rank's fp32 gradient contribution to the block it
    sees, and the complete gradient of this rank's own block is returned (:class:`GradRing`).
    """
    rank = torch.distributed.get_rank(group)
    grads = GradRing([block], group) if grad else None
    for src, (blk,) in ring_stream([block], group, lambda k, slot: block_slot("k", slot)):
        seen = layout.visible(rank, src)
        g = visit(src, blk, seen) if seen else None
        if grad:
            grads.add(None if g is None else [g])
    return grads.result()[0] if grad else None


class RingSelfAttention(torch.autograd.Function):
    """Causal RSA of local queries ``[b, n, s/p, d]`` over the whole sequence.

    Rank r holds the tokens ``layout.segments(r)`` (``zigzag.RingLayout``); score columns are
    global positions. ``k``/``v`` are ``[b, kv, s/p, d]`` with ``n % kv == 0``. Saves q, k, v
    and the probabilities ``P [b, n, s/p, s]`` (in q's dtype, as stock megatron saves its
    attention probs).
    """

    @staticmethod
    def forward(ctx, q, k, v, group, scale, layout):
        rank, p, _ = group_info(group)
        b, n, sl, d = q.shape
        rep = n // k.shape[1]
        mine = layout.segments(rank)
        scores = torch.empty((b, n, sl, p * sl), dtype=torch.float32, device=q.device)

        def score_block(src, kb, seen):
            for row, seg in seen:
                blk = scores[:, :, row:, seg.cols]
                blk.copy_(torch.matmul(q[:, :, row:], expand_kv(kb[:, :, seg.local], rep).transpose(-1, -2)))
                blk.mul_(scale)
                if src == rank:  # the first rows are the keys' own tokens: the causal diagonal
                    n_diag = seg.stop - seg.start
                    diag = torch.ones(n_diag, n_diag, dtype=torch.bool, device=q.device).triu_(1)
                    blk[:, :, :n_diag].masked_fill_(diag, float("-inf"))

        _ring(k, group, layout, score_block)
        # softmax over the seen part of each row, in place; masked columns get probability 0
        for seg in mine:
            rows = scores[:, :, seg.local, :seg.stop]
            rows.sub_(rows.amax(dim=-1, keepdim=True)).exp_()
            rows.div_(rows.sum(dim=-1, keepdim=True))
            scores[:, :, seg.local, seg.stop:].zero_()
        probs = scores if q.dtype == torch.float32 else scores.to(q.dtype)
        del scores, rows

        out = torch.zeros((b, n, sl, d), dtype=torch.float32, device=q.device)

        def value_block(src, vb, seen):
            for row, seg in seen:
                out[:, :, row:].add_(torch.matmul(probs[:, :, row:, seg.cols], expand_kv(vb[:, :, seg.local], rep)))

        _ring(v, group, layout, value_block)
        ctx.save_for_backward(q, k, v, probs)
        ctx.group, ctx.scale, ctx.rep, ctx.layout = group, scale, rep, layout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, probs = ctx.saved_tensors
        group, scale, rep, layout = ctx.group, ctx.scale, ctx.rep, ctx.layout
        rank = torch.distributed.get_rank(group)
        b, n, sl, d = q.shape
        mine = layout.segments(rank)
        dout = dout.to(q.dtype)
        # each row's seen columns end at its segment's stop: the last segment's is the widest
        dscores = torch.empty((b, n, sl, mine[-1].stop), dtype=torch.float32, device=q.device)
        rowdot = torch.zeros((b, n, sl, 1), dtype=torch.float32, device=q.device)

        def value_grad(src, vb, seen):  # dP_j = dO V_j^T, dV_j = P_j^T dO
            dv = torch.zeros(vb.shape, dtype=torch.float32, device=vb.device)
            for row, seg in seen:
                dp = dscores[:, :, row:, seg.cols]
                dp.copy_(torch.matmul(dout[:, :, row:], expand_kv(vb[:, :, seg.local], rep).transpose(-1, -2)))
                pj = probs[:, :, row:, seg.cols]
                rowdot[:, :, row:].add_((dp * pj).sum(dim=-1, keepdim=True))
                dv[:, :, seg.local] += reduce_kv(torch.matmul(pj.transpose(-1, -2), dout[:, :, row:]), rep)
            return dv

        dv = _ring(v, group, layout, value_grad, grad=True)
        # softmax backward: dS = P * (dP - rowsum(dP * P)), in place, on the seen columns
        for seg in mine:
            dscores[:, :, seg.local, :seg.stop].sub_(rowdot[:, :, seg.local]).mul_(
                probs[:, :, seg.local, :seg.stop])
        del rowdot
        dq = torch.zeros((b, n, sl, d), dtype=torch.float32, device=q.device)

        def key_grad(src, kb, seen):  # dQ += dS_j K_j, dK_j = dS_j^T Q (both times scale)
            dk = torch.zeros(kb.shape, dtype=torch.float32, device=kb.device)
            for row, seg in seen:
                ds = dscores[:, :, row:, seg.cols].to(q.dtype)
                dq[:, :, row:].add_(torch.matmul(ds, expand_kv(kb[:, :, seg.local], rep)))
                dk[:, :, seg.local] += reduce_kv(torch.matmul(ds.transpose(-1, -2), q[:, :, row:]), rep)
            return dk.mul_(scale)

        dk = _ring(k, group, layout, key_grad, grad=True)
        return dq.mul_(scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def rsa_attention(q, k, v, group, scale, layout):
    """``q [b, n, s/p, d]``, ``k``/``v`` ``[b, kv, s/p, d]`` holding ``layout``'s tokens of this
    rank, to the causal output like ``q``."""
    return RingSelfAttention.apply(q, k, v, group, scale, layout)


class Colossal(RingStrategy):
    name = "colossal"
    description = ("Colossal-AI ring self-attention (full score rows, K then V ring, balanced "
                   "zig-zag split), ZeRO-3 weights")

    def core(self, q, k, v, geo, layout):
        return rsa_attention(q, k, v, geo.group, geo.scale, layout)
