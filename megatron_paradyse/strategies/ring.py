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

from .. import comm
from ..attention_kernels import attn_backward, attn_forward, expand_kv, merge_lse, reduce_kv
from . import zero3
from .base import Strategy, apply_rope, from_bhsd, geometry, rope_freqs, to_bhsd, zero_support


class RingAttention(torch.autograd.Function):
    """Causal attention of local queries ``[b, n, s/p, d]`` over the whole sequence by a K/V ring.

    Rank r holds the r-th contiguous chunk of the sequence. ``k``/``v`` are ``[b, kv, s/p, d]``
    with ``n % kv == 0``; each block is expanded to the query heads only for the kernel.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        rank, p, _ = comm.group_info(group)
        rep = q.shape[1] // k.shape[1]
        out = lse = None
        cur_k, cur_v = k, v
        for step in range(p):
            src = (rank - step) % p
            reqs = []
            if step < p - 1:
                nk = comm.pool_buffer(comm.block_slot("k", step % 2), k.shape, k.dtype)
                nv = comm.pool_buffer(comm.block_slot("v", step % 2), v.shape, v.dtype)
                reqs = comm.ring_exchange([cur_k, cur_v], [nk, nv], group)
            if src <= rank:
                o, l = attn_forward(q, expand_kv(cur_k, rep), expand_kv(cur_v, rep), src == rank, scale)
                out, lse = merge_lse(out, lse, o, l)
            comm.wait(reqs)
            if step < p - 1:
                cur_k, cur_v = nk, nv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.rep = group, scale, rep
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, rep = ctx.group, ctx.rep
        rank, p, _ = comm.group_info(group)
        dq = torch.zeros_like(q, dtype=torch.float32)
        cur_k, cur_v = k, v
        acc_k = acc_v = None  # gradient of the block held now, summed over the ranks before us
        dreqs = []
        for step in range(p):
            src = (rank - step) % p
            reqs = []
            if step < p - 1:
                nk = comm.pool_buffer(comm.block_slot("k", step % 2), k.shape, k.dtype)
                nv = comm.pool_buffer(comm.block_slot("v", step % 2), v.shape, v.dtype)
                reqs = comm.ring_exchange([cur_k, cur_v], [nk, nv], group)
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
            comm.wait(reqs)
            if step < p - 1:
                cur_k, cur_v = nk, nv
        comm.wait(dreqs)  # after p hops our own block's gradient has come home
        return dq.to(q.dtype), recv_k.to(k.dtype), recv_v.to(v.dtype), None, None


def ring_attention(q, k, v, group, scale):
    """``q [b, n, s/p, d]``, ``k``/``v`` ``[b, kv, s/p, d]`` to the causal output like ``q``."""
    if torch.distributed.get_world_size(group) == 1:
        from ..attention_kernels import FlashAttention

        return FlashAttention.apply(q, k, v, True, scale)
    return RingAttention.apply(q, k, v, group, scale)


class Ring(Strategy):
    name = "ring"
    description = "causal K/V ring attention with log-sum-exp merge, ZeRO-3 weights"

    def supports(self, config, p):
        return zero_support(config, p)

    def attention(self, attn, hidden_states, rotary_pos_emb):
        geo = geometry(attn)
        q, k, v = zero3.qkv_local_tokens(attn, hidden_states, geo)
        start = geo.rank * hidden_states.shape[0]
        qf, kf = rope_freqs(rotary_pos_emb)
        q, k = apply_rope(q, qf, attn.config, start), apply_rope(k, kf, attn.config, start)
        ctx = ring_attention(to_bhsd(q), to_bhsd(k).contiguous(), to_bhsd(v).contiguous(),
                             geo.group, geo.scale)
        return zero3.row(attn.linear_proj, from_bhsd(ctx), geo.group)

    def mlp(self, mlp, hidden_states):
        return zero3.mlp(mlp, hidden_states)
