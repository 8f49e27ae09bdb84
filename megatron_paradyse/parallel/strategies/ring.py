"""``ring``: context parallelism by a causal KV ring, with ZeRO-3-style weights (MegatronCZ).

Forward: the layer input is re-laid out to the balanced split (``zigzag.py``: ranks r and
p-1-r swap their second halves, so each holds half-chunks c and 2p-1-c); QKV for those tokens
and all heads (weight gathered just in time), RoPE at their global positions, then
:class:`RingAttention`: p steps, each passing the visiting K/V block to the next rank while
attending the local queries to the part of it they see (the rank's own tokens: one causal
block; another rank's: all queries over its first half, or the second-half queries over all
of it, the same work on every rank); partial results are merged with their log-sum-exp.
Output projection, then the inverse re-layout; MLP as in ``zero3.py``.
Backward: the K/V ring runs again; each step's dK/dV is added to an accumulator that travels
one hop behind with the block, and a last hop hands each block's complete gradient to its
owner. Memory: O(s/p) activations, two K/V blocks in flight, one gathered weight at a time.
"""
from __future__ import annotations

import torch

from .. import context, varlen
from ..attention_kernels import bshd, attn_backward, attn_forward, causal_attention, merge_lse
from ..buffers import block_slot
from ..ring_comm import FlatRing, RingComm
from .ring_base import RingStrategy


def _slot(k, slot):
    return block_slot("kv"[k], slot)


def _rows(x, rows: slice):
    """Rows ``rows`` of ``[b, n, s, ...]`` (``narrow``: a view that fake CUDA tensors take too)."""
    return x.narrow(2, rows.start, rows.stop - rows.start)


def _merge_rows(out, lse, rows, blk_out, blk_lse):
    """Merge one block's result into rows ``rows`` of the running (out, lse), in place."""
    o, l = merge_lse(_rows(out, rows), _rows(lse, rows), blk_out, blk_lse)
    torch.ops.aten.copy_(_rows(out, rows), o)  # Tensor.copy_'s kernel; it runs on fake CUDA tensors too
    torch.ops.aten.copy_(_rows(lse, rows), l)


def _own_varlen(layout, rank, src, q) -> bool:
    """Whether a ring step over the rank's own keys of a pack is one variable-length call (one
    causal square per document, together every local row: ``PieceLayout.own_documents``). Rows
    (b > 1, also under context parallelism) hold one document: one block anyway."""
    return src == rank and layout.packed and q.shape[0] == 1


def _shapes(k, v, layout):
    """The shapes of rank ``src``'s K/V block (a packed layout's ranks hold different counts)."""
    def shapes(src):
        n = layout.count(src)
        return [k.shape[:2] + (n,) + k.shape[3:], v.shape[:2] + (n,) + v.shape[3:]]
    return shapes


def kv_stream(k, v, ring: RingComm, layout):
    """``ring``'s stream of ``[k, v]`` as far as ``layout`` needs them to travel."""
    return ring.stream([k, v], _slot, last=ring.reach(layout), shapes=_shapes(k, v, layout))


def ring_forward(q, kv_steps, layout, rank, scale):
    """Rank ``rank``'s forward over the K/V blocks ``kv_steps`` yields as ``(src, (k, v))``
    (None where no block came); returns (out, lse) in fp32. Every row sees at least its own
    token, so no row is left at lse -inf."""
    b, n, sl, d = q.shape
    out = lse = None
    for src, kv in kv_steps:
        if kv is None:
            continue
        if _own_varlen(layout, rank, src, q):
            o, l = varlen.forward(q, *kv, layout.own_documents(rank), scale)
            # in [b, s, n, d] memory, as the CUDA kernels return it (the CPU loop does not), so
            # the context's [s, b, n*d] stays a view of what RingAttention saves, not a copy
            out, lse = merge_lse(out, lse, bshd(o), l)
            continue
        for rows, keys, causal in layout.kernel_blocks(rank, src):
            o, l = attn_forward(_rows(q, rows), _rows(kv[0], keys), _rows(kv[1], keys), causal, scale)
            if out is None and rows == slice(0, sl):  # one block over every row: it is the start
                out, lse = merge_lse(None, None, o, l)
                continue
            if out is None:  # a pack's first block covers some rows only; laid out [b, s, n, d]
                # as the kernels return out, so the context's [s, b, n*d] is a view, not a copy
                out = torch.zeros((b, sl, n, d), dtype=torch.float32, device=q.device).transpose(1, 2)
                lse = torch.full((b, n, sl), float("-inf"), dtype=torch.float32, device=q.device)
            _merge_rows(out, lse, rows, o, l)
    return out, lse


def step_backward(dout, q, out, lse, dq, cur_k, cur_v, blocks, scale):
    """One ring step's backward over the visiting ``cur_k``/``cur_v``: adds the blocks' dQ into
    ``dq`` (fp32) and returns the block's fp32 [dK, dV], or None where no query sees it.
    ``blocks``: the step's ``kernel_blocks``, or a ``Documents`` for the rank's own keys of a
    pack (one variable-length call)."""
    if not isinstance(blocks, tuple):
        dq_b, dk_b, dv_b = varlen.backward(dout, q, cur_k, cur_v, out, lse, blocks, scale)
        dq.add_(dq_b)
        return [dk_b.float(), dv_b.float()]
    if not blocks:
        return None
    contrib = [torch.zeros_like(cur_k, dtype=torch.float32), torch.zeros_like(cur_v, dtype=torch.float32)]
    for rows, keys, causal in blocks:
        dq_b, dk_b, dv_b = attn_backward(_rows(dout, rows), _rows(q, rows), _rows(cur_k, keys), _rows(cur_v, keys),
                                         _rows(out, rows), _rows(lse, rows), causal, scale)
        _rows(dq, rows).add_(dq_b)
        _rows(contrib[0], keys).add_(dk_b)
        _rows(contrib[1], keys).add_(dv_b)
    return contrib


def step_blocks(layout, rank, src, q):
    """What :func:`step_backward` takes for the step over ``src``'s keys."""
    if _own_varlen(layout, rank, src, q):
        return layout.own_documents(rank)
    return layout.kernel_blocks(rank, src)


class RingAttention(torch.autograd.Function):
    """Causal attention of local queries ``[b, n, s/p, d]`` over the whole sequence by a K/V ring.

    Rank r holds the tokens ``layout.segments(r)`` (``zigzag.RingLayout``: balanced, or
    contiguous). ``k``/``v`` are ``[b, kv, s/p, d]`` with ``n % kv == 0``; the block kernels
    take them with their KV heads (``attention_kernels.native_gqa``). ``ring``: the
    :class:`~..ring_comm.RingComm` the K/V blocks travel, this rank its ``position``.
    """

    @staticmethod
    def forward(ctx, q, k, v, ring, scale, layout):
        rank = ring.position
        out, lse = ring_forward(q, kv_stream(k, v, ring, layout), layout, rank, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.layout = ring, scale, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        rank = ring.position
        dq = torch.zeros_like(q, dtype=torch.float32)
        layout = ctx.layout
        grads = ring.grad_ring([k, v], last=ring.reach(layout), shapes=_shapes(k, v, layout))
        for src, kv in kv_stream(k, v, ring, layout):
            blocks = step_blocks(layout, rank, src, q) if kv is not None else ()
            grads.add(step_backward(dout, q, out, lse, dq, *(kv or (None, None)), blocks, ctx.scale))
        dk, dv = grads.result()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q, k, v, ring: RingComm, scale, layout):
    """``q [b, n, s/p, d]``, ``k``/``v`` ``[b, kv, s/p, d]`` holding ``layout``'s tokens of this
    rank (``ring``'s owner), to the causal output like ``q`` (attention inside each document of
    a packed layout)."""
    if ring.size == 1 and not layout.packed:
        return causal_attention(q, k, v, scale)
    return RingAttention.apply(q, k, v, ring, scale, layout)


def sequence_attention(q, k, v, scale, docs=None, cp=None):
    """Causal attention of ``tp_sp`` and ``ulysses``: ``q [b, n, s, d]`` over its whole sequence
    (inside each document of a pack), or with context parallelism (``cp``: ``context.CPPlace``) over
    this CP rank's local tokens and, by a K/V ring over the CP group, every other CP rank's."""
    if cp is None:
        return varlen.document_attention(q, k, v, scale, docs)
    layout = context.cp_layout(cp.size, q.shape[2], docs)
    return RingAttention.apply(q, k, v, FlatRing(cp.group), scale, layout)


class Ring(RingStrategy):
    name = "ring"
    description = "causal K/V ring attention (balanced zig-zag split) with log-sum-exp merge, ZeRO-3 weights"

    def core(self, q, k, v, ring, scale, layout):
        return ring_attention(q, k, v, ring, scale, layout)
