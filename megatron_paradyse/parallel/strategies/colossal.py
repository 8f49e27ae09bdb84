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
from ..ring_comm import RingComm
from .ring_base import RingStrategy

_copy = torch.ops.aten.copy_  # Tensor.copy_'s kernel; it also runs on the CPU tests' fake CUDA tensors


def _at(x, rows: slice, cols: slice | None = None):
    """``x[:, :, rows, cols]`` as ``narrow`` views (Python indexing does not run on fake CUDA tensors)."""
    x = x.narrow(2, rows.start, rows.stop - rows.start)
    return x if cols is None else x.narrow(3, cols.start, cols.stop - cols.start)


def _cols(x, start: int, stop: int):
    return x.narrow(-1, start, stop - start)


def _ring(block, ring: RingComm, layout, visit, grad: bool = False):
    """Pass ``block`` around the ring (as far as ``layout`` needs it), calling
    ``visit(src, blk, blocks)`` for every block some local query sees (``blocks``:
    ``layout.score_blocks(rank, src)``).

    With ``grad``, ``visit`` returns this rank's fp32 gradient contribution to the block it
    sees, and the complete gradient of this rank's own block is returned (``ring.grad_ring``).
    """
    rank = ring.position
    last = ring.reach(layout)

    def shapes(src):
        return [block.shape[:2] + (layout.count(src),) + block.shape[3:]]

    grads = ring.grad_ring([block], last=last, shapes=shapes) if grad else None
    for src, held in ring.stream([block], lambda k, slot: block_slot("k", slot), last=last, shapes=shapes):
        blocks = layout.score_blocks(rank, src) if held is not None else ()
        g = visit(src, held[0], blocks) if blocks else None
        if grad:
            grads.add(None if g is None else [g])
    return grads.result()[0] if grad else None


def _softmax_rows(scores, layout, rank):
    """Softmax over the seen columns of each row, in place; unseen columns get probability 0.
    A row's seen columns end at its segment's (or a pack's piece's) stop."""
    for rows, stop in layout.row_groups(rank):
        part = _at(scores, rows, slice(0, stop))
        part.sub_(part.amax(dim=-1, keepdim=True)).exp_()
        part.div_(part.sum(dim=-1, keepdim=True))
        _at(scores, rows, slice(stop, scores.shape[-1])).zero_()


class RingSelfAttention(torch.autograd.Function):
    """Causal RSA of local queries ``[b, n, s/p, d]`` over the whole sequence (inside each
    document of a pack).

    Rank r holds the tokens of ``layout`` (``zigzag.RingLayout`` or ``pack_layout.PackedLayout``);
    score columns are global positions. ``k``/``v`` are ``[b, kv, s/p, d]`` with ``n % kv == 0``.
    Saves q, k, v and the probabilities ``P [b, n, s/p, s]`` (in q's dtype, as stock megatron
    saves its attention probs). In a pack, columns no block writes (other documents) start at
    -inf, so they get probability 0.
    """

    @staticmethod
    def forward(ctx, q, k, v, ring, scale, layout):
        rank = ring.position
        b, n, sl, d = q.shape
        rep = n // k.shape[1]
        make = torch.full if layout.packed else (lambda shape, _, **kw: torch.empty(shape, **kw))
        scores = make((b, n, sl, layout.total), float("-inf"), dtype=torch.float32, device=q.device)

        def score_block(src, kb, blocks):
            for blk in blocks:
                part = _at(scores, blk.rows, blk.cols)
                _copy(part, torch.matmul(_at(q, blk.rows), expand_kv(_at(kb, blk.keys), rep).transpose(-1, -2)))
                part.mul_(scale)
                if blk.causal:
                    m = blk.rows.stop - blk.rows.start
                    diag = torch.ones(m, m, dtype=torch.bool, device=q.device).triu_(1)
                    part.masked_fill_(diag, float("-inf"))

        _ring(k, ring, layout, score_block)
        _softmax_rows(scores, layout, rank)
        probs = scores if q.dtype == torch.float32 else scores.to(q.dtype)
        del scores
        out = torch.zeros((b, n, sl, d), dtype=torch.float32, device=q.device)

        def value_block(src, vb, blocks):
            for blk in blocks:
                _at(out, blk.rows).add_(torch.matmul(_at(probs, blk.rows, blk.cols), expand_kv(_at(vb, blk.keys), rep)))

        _ring(v, ring, layout, value_block)
        ctx.save_for_backward(q, k, v, probs)
        ctx.ring, ctx.scale, ctx.rep, ctx.layout = ring, scale, rep, layout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, probs = ctx.saved_tensors
        ring, scale, rep, layout = ctx.ring, ctx.scale, ctx.rep, ctx.layout
        rank = ring.position
        b, n, sl, d = q.shape
        groups = layout.row_groups(rank)
        dout = dout.to(q.dtype)
        # each row's seen columns end at its group's stop: the last group's is the widest; in
        # a pack unwritten entries must be zeros (they meet P = 0 in the softmax backward)
        make = torch.zeros if layout.packed else torch.empty
        dscores = make((b, n, sl, max((stop for _, stop in groups), default=0)),
                       dtype=torch.float32, device=q.device)
        rowdot = torch.zeros((b, n, sl, 1), dtype=torch.float32, device=q.device)

        def value_grad(src, vb, blocks):  # dP_j = dO V_j^T, dV_j = P_j^T dO
            dv = torch.zeros(vb.shape, dtype=torch.float32, device=vb.device)
            for blk in blocks:
                dp = _at(dscores, blk.rows, blk.cols)
                _copy(dp, torch.matmul(_at(dout, blk.rows), expand_kv(_at(vb, blk.keys), rep).transpose(-1, -2)))
                pj = _at(probs, blk.rows, blk.cols)
                _at(rowdot, blk.rows).add_((dp * pj).sum(dim=-1, keepdim=True))
                _at(dv, blk.keys).add_(reduce_kv(torch.matmul(pj.transpose(-1, -2), _at(dout, blk.rows)), rep))
            return dv

        dv = _ring(v, ring, layout, value_grad, grad=True)
        # softmax backward: dS = P * (dP - rowsum(dP * P)), in place, on the seen columns
        for rows, stop in groups:
            _at(dscores, rows, slice(0, stop)).sub_(_at(rowdot, rows)).mul_(_at(probs, rows, slice(0, stop)))
        del rowdot
        dq = torch.zeros((b, n, sl, d), dtype=torch.float32, device=q.device)

        def key_grad(src, kb, blocks):  # dQ += dS_j K_j, dK_j = dS_j^T Q (both times scale)
            dk = torch.zeros(kb.shape, dtype=torch.float32, device=kb.device)
            for blk in blocks:
                ds = _at(dscores, blk.rows, blk.cols).to(q.dtype)
                _at(dq, blk.rows).add_(torch.matmul(ds, expand_kv(_at(kb, blk.keys), rep)))
                _at(dk, blk.keys).add_(reduce_kv(torch.matmul(ds.transpose(-1, -2), _at(q, blk.rows)), rep))
            return dk.mul_(scale)

        dk = _ring(k, ring, layout, key_grad, grad=True)
        return dq.mul_(scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def rsa_attention(q, k, v, ring: RingComm, scale, layout):
    """``q [b, n, s/p, d]``, ``k``/``v`` ``[b, kv, s/p, d]`` holding ``layout``'s tokens of this
    rank, to the causal output like ``q``."""
    return RingSelfAttention.apply(q, k, v, ring, scale, layout)


class Colossal(RingStrategy):
    name = "colossal"
    description = ("Colossal-AI ring self-attention (full score rows, K then V ring, balanced "
                   "zig-zag split), ZeRO-3 weights")

    def core(self, q, k, v, ring, scale, layout):
        return rsa_attention(q, k, v, ring, scale, layout)
