"""``colossal``: Colossal-AI sequence parallelism (Ring Self-Attention) with ZeRO-3 weights (ColossalZ).

Ring Self-Attention (Li et al. 2021, "Sequence Parallelism: Long Sequence Training from
System Perspective") materialises the score rows of the local queries against the whole
sequence, where ``ring`` merges flash-attention blocks by their log-sum-exp.

Forward: QKV for local tokens and all heads (weight gathered just in time), RoPE at global
positions, then :class:`RingSelfAttention`. Stage 1, a K ring: p steps, each passing the
visiting K block to the next rank while writing ``S_j = Q K_j^T * scale`` into the local
rows ``S [b, n, s/p, s]`` (fp32); the causal mask is applied on global positions (blocks
from later ranks are fully masked: their matmul is skipped and their probabilities are
exactly zero). The softmax runs over whole rows, in place, giving ``P``. Stage 2, a V ring:
``O = sum_j P_j V_j``. Output projection and MLP as in ``zero3.py``.
Backward: a V ring gives ``dP_j = dO V_j^T`` and ``dV_j = P_j^T dO``; then
``dS = P * (dP - rowsum(dP * P))``; a K ring gives ``dQ = sum_j dS_j K_j * scale`` and
``dK_j = dS_j^T Q * scale``. dK/dV travel in an accumulator one hop behind their block, and
a last hop hands each block's complete gradient to its owner (as in ``ring``).
Collectives: point-to-point only (two rings forward, two rings and two accumulator rings
backward), plus the ZeRO-3 weight all-gathers / gradient reduce-scatters.
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
from . import zero3


def _ring(block, group, visit, grad: bool = False):
    """Pass ``block`` once around the ring, calling ``visit(src, blk)`` for every causal block.

    ``visit`` sees blocks from ranks ``src <= rank`` only (later ones are fully masked). With
    ``grad``, ``visit`` returns this rank's fp32 gradient contribution to the block it sees,
    and the complete gradient of this rank's own block is returned (:class:`GradRing`).
    """
    rank = torch.distributed.get_rank(group)
    grads = GradRing([block], group) if grad else None
    for src, (blk,) in ring_stream([block], group, lambda k, slot: block_slot("k", slot)):
        g = visit(src, blk) if src <= rank else None
        if grad:
            grads.add(None if g is None else [g])
    return grads.result()[0] if grad else None


class RingSelfAttention(torch.autograd.Function):
    """Causal RSA of local queries ``[b, n, s/p, d]`` over the whole sequence.

    Rank r holds the r-th contiguous chunk of the sequence; ``k``/``v`` are
    ``[b, kv, s/p, d]`` with ``n % kv == 0``. Saves q, k, v and the probabilities
    ``P [b, n, s/p, s]`` (in q's dtype, as stock megatron saves its attention probs).
    """

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        rank, p, _ = group_info(group)
        b, n, sl, d = q.shape
        rep = n // k.shape[1]
        valid = (rank + 1) * sl  # columns of keys at or before this rank's chunk
        scores = torch.empty((b, n, sl, p * sl), dtype=torch.float32, device=q.device)
        diag_mask = torch.ones(sl, sl, dtype=torch.bool, device=q.device).triu_(1)

        def score_block(src, kb):
            blk = scores[..., src * sl:(src + 1) * sl]
            blk.copy_(torch.matmul(q, expand_kv(kb, rep).transpose(-1, -2)).mul_(scale))
            if src == rank:
                blk.masked_fill_(diag_mask, float("-inf"))

        _ring(k, group, score_block)
        # softmax over whole rows, in place; masked blocks have probability exactly zero
        rows = scores[..., :valid]
        rows.sub_(rows.amax(dim=-1, keepdim=True)).exp_()
        rows.div_(rows.sum(dim=-1, keepdim=True))
        scores[..., valid:].zero_()
        probs = scores if q.dtype == torch.float32 else scores.to(q.dtype)
        del scores, rows

        out = torch.zeros((b, n, sl, d), dtype=torch.float32, device=q.device)

        def value_block(src, vb):
            out.add_(torch.matmul(probs[..., src * sl:(src + 1) * sl], expand_kv(vb, rep)))

        _ring(v, group, value_block)
        ctx.save_for_backward(q, k, v, probs)
        ctx.group, ctx.scale, ctx.rep = group, scale, rep
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, probs = ctx.saved_tensors
        group, scale, rep = ctx.group, ctx.scale, ctx.rep
        rank, p, _ = group_info(group)
        b, n, sl, d = q.shape
        valid = (rank + 1) * sl
        dout = dout.to(q.dtype)
        dscores = torch.empty((b, n, sl, valid), dtype=torch.float32, device=q.device)
        rowdot = torch.zeros((b, n, sl, 1), dtype=torch.float32, device=q.device)

        def value_grad(src, vb):  # dP_j = dO V_j^T, dV_j = P_j^T dO
            cols = slice(src * sl, (src + 1) * sl)
            dp = dscores[..., cols]
            dp.copy_(torch.matmul(dout, expand_kv(vb, rep).transpose(-1, -2)))
            rowdot.add_((dp * probs[..., cols]).sum(dim=-1, keepdim=True))
            return reduce_kv(torch.matmul(probs[..., cols].transpose(-1, -2), dout), rep).float()

        dv = _ring(v, group, value_grad, grad=True)
        # softmax backward: dS = P * (dP - rowsum(dP * P)), in place
        dscores.sub_(rowdot).mul_(probs[..., :valid])
        del rowdot
        dq = torch.zeros((b, n, sl, d), dtype=torch.float32, device=q.device)

        def key_grad(src, kb):  # dQ += dS_j K_j, dK_j = dS_j^T Q (both times scale)
            ds = dscores[..., src * sl:(src + 1) * sl].to(q.dtype)
            dq.add_(torch.matmul(ds, expand_kv(kb, rep)))
            return reduce_kv(torch.matmul(ds.transpose(-1, -2), q), rep).float().mul_(scale)

        dk = _ring(k, group, key_grad, grad=True)
        return dq.mul_(scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def rsa_attention(q, k, v, group, scale):
    """``q [b, n, s/p, d]``, ``k``/``v`` ``[b, kv, s/p, d]`` to the causal output like ``q``."""
    return RingSelfAttention.apply(q, k, v, group, scale)


class Colossal(zero3.SequenceShardedStrategy):
    name = "colossal"
    description = "Colossal-AI ring self-attention (full score rows, K then V ring), ZeRO-3 weights"

    def core(self, q, k, v, geo):
        return rsa_attention(q, k, v, geo.group, geo.scale)
