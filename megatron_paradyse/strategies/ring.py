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

from .. import comm
from ..attention_kernels import attn_backward, attn_forward, expand_kv, merge_lse, reduce_kv
from . import zero3


def _visiting_blocks(k, v, group):
    """Yield ``(src, k_block, v_block)`` for the p ring steps, starting with this rank's own
    block; the next block's hop is in flight while one is used. A yielded block (a pooled
    buffer after step 0) is valid until the generator is advanced twice."""
    rank, p, _ = comm.group_info(group)
    cur = (k, v)
    for step in range(p):
        nxt, reqs = None, []
        if step < p - 1:
            nxt = (comm.pool_buffer(comm.block_slot("k", step % 2), k.shape, k.dtype),
                   comm.pool_buffer(comm.block_slot("v", step % 2), v.shape, v.dtype))
            reqs = comm.ring_exchange(list(cur), list(nxt), group)
        yield (rank - step) % p, cur[0], cur[1]
        comm.wait(reqs)
        cur = nxt


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
        for src, cur_k, cur_v in _visiting_blocks(k, v, group):
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
        acc_k = acc_v = None  # gradient of the block held now, summed over the ranks before us
        dreqs = []
        for step, (src, cur_k, cur_v) in enumerate(_visiting_blocks(k, v, group)):
            if src <= rank:
                dq_b, dk_b, dv_b = attn_backward(dout, q, expand_kv(cur_k, rep), expand_kv(cur_v, rep),
                                                 out, lse, src == rank, ctx.scale)
                dq += dq_b
                dk_b, dv_b = reduce_kv(dk_b, rep).float(), reduce_kv(dv_b, rep).float()
            else:
                dk_b = dv_b = None
            comm.wait(dreqs)
            if step == 0:
                acc_k = dk_b if dk_b is not None else k.new_zeros(k.shape, dtype=torch.float32)
                acc_v = dv_b if dv_b is not None else v.new_zeros(v.shape, dtype=torch.float32)
            else:
                acc_k, acc_v = recv_k, recv_v
                if dk_b is not None:
                    acc_k, acc_v = acc_k + dk_b, acc_v + dv_b
            # hand the block's gradient on, one hop behind the block itself
            recv_k = torch.empty(k.shape, dtype=torch.float32, device=k.device)
            recv_v = torch.empty(v.shape, dtype=torch.float32, device=v.device)
            dreqs = comm.ring_exchange([acc_k, acc_v], [recv_k, recv_v], group)
        comm.wait(dreqs)  # after p hops our own block's gradient has come home
        return dq.to(q.dtype), recv_k.to(k.dtype), recv_v.to(v.dtype), None, None


def ring_attention(q, k, v, group, scale):
    """``q [b, n, s/p, d]``, ``k``/``v`` ``[b, kv, s/p, d]`` to the causal output like ``q``."""
    if torch.distributed.get_world_size(group) == 1:
        from ..attention_kernels import FlashAttention

        return FlashAttention.apply(q, k, v, True, scale)
    return RingAttention.apply(q, k, v, group, scale)


class Ring(zero3.SequenceShardedStrategy):
    name = "ring"
    description = "causal K/V ring attention with log-sum-exp merge, ZeRO-3 weights"

    def core(self, q, k, v, geo):
        return ring_attention(q, k, v, geo.group, geo.scale)
