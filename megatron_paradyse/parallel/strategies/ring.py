"""``ring``: context parallelism by a causal KV ring, with ZeRO-3-style weights (MegatronCZ).

Forward: QKV for local tokens and all heads (weight gathered just in time), RoPE at global
positions, then :class:`RingAttention`: p steps, each passing the visiting K/V block to the
next rank while attending the local queries to it; partial results are merged with their
log-sum-exp. Blocks from later ranks are fully masked by causality and skipped (the ring
still carries them). Output projection and MLP as in ``zero3.py``.
Backward: the K/V ring runs again; each step's dK/dV is added to an accumulator that travels
one hop behind with the block, and a last hop hands each block's complete gradient to its
owner. Memory: O(s/p) activations, two K/V blocks in flight, one gathered weight at a time.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention_kernels import attn_backward, attn_forward, causal_attention, expand_kv, merge_lse, reduce_kv
from ..buffers import block_slot
from ..ring_comm import GradRing, ring_stream
from . import zero3


def _slot(k, slot):
    return block_slot("kv"[k], slot)


class RingAttention(torch.autograd.Function):
    """Causal attention of local queries ``[b, n, s/p, d]`` over the whole sequence by a K/V ring.

    Rank r holds the r-th contiguous chunk of the sequence. ``k``/``v`` are ``[b, kv, s/p, d]``
    with ``n % kv == 0``; each block is expanded to the query heads only for the kernel.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        rank = dist.get_rank(group)
        rep = q.shape[1] // k.shape[1]
        out = lse = None
        for src, (cur_k, cur_v) in ring_stream([k, v], group, _slot):
            if src <= rank:
                o, l = attn_forward(q, expand_kv(cur_k, rep), expand_kv(cur_v, rep), src == rank, scale)
                out, lse = merge_lse(out, lse, o, l)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.rep = group, scale, rep
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, rep = ctx.group, ctx.rep
        rank = dist.get_rank(group)
        dq = torch.zeros_like(q, dtype=torch.float32)
        grads = GradRing([k, v], group)
        for src, (cur_k, cur_v) in ring_stream([k, v], group, _slot):
            contrib = None
            if src <= rank:
                dq_b, dk_b, dv_b = attn_backward(dout, q, expand_kv(cur_k, rep), expand_kv(cur_v, rep),
                                                 out, lse, src == rank, ctx.scale)
                dq += dq_b
                contrib = [reduce_kv(dk_b, rep).float(), reduce_kv(dv_b, rep).float()]
            grads.add(contrib)
        dk, dv = grads.result()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q, k, v, group, scale):
    """``q [b, n, s/p, d]``, ``k``/``v`` ``[b, kv, s/p, d]`` to the causal output like ``q``."""
    if torch.distributed.get_world_size(group) == 1:
        return causal_attention(q, k, v, scale)
    return RingAttention.apply(q, k, v, group, scale)


class Ring(zero3.SequenceShardedStrategy):
    name = "ring"
    description = "causal K/V ring attention with log-sum-exp merge, ZeRO-3 weights"

    def core(self, q, k, v, geo):
        return ring_attention(q, k, v, geo.group, geo.scale)
