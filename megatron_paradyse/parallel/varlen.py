"""Variable-length causal attention: every document of a pack in one kernel call, with the
log-sum-exp, forward and backward.

Used by ``tp_sp`` and ``ulysses`` on packs (:func:`document_attention`) and by the rings for a
rank's own key block of a pack (one causal square per document, together every local row).
``q [1, n, T, d]``, ``k``/``v`` ``[1, kv, T, d]`` (``n % kv == 0``), documents ``packing.Documents``;
returns ``out`` like ``q`` and ``lse [1, n, T]`` fp32, the block kernels' contract
(``attention_kernels``), so the backward takes a ring's *global* out and lse. Kernels, gated and
tried in order by ``kernel_select``: on CUDA flash-attn 2.7/2.8's ``_flash_attn_varlen_*``, then
torch's ``aten._flash_attention_forward/_backward`` with ``cum_seq_q/k`` (fp16/bf16; LSE
``[n, T]``), then its memory-efficient ``_efficient_attention_*`` with ``cu_seqlens`` (fp32 too;
LSE ``[docs, n, max rounded up to 32]``), then one dense block kernel per document; on CPU one
dense block kernel per document (the reference). ``cu_seqlens`` and the LSE row map are built
once per ``Documents`` on the device (``Documents.on_device``). Views are taken with ``narrow`` /
``select``, which run on fake CUDA tensors (the CPU tests), where Python indexing does not.
"""
from __future__ import annotations

import types

import torch

from .. import runtime
from . import attention_kernels as K
from . import kernel_select
from .attention_kernels import attn_backward, attn_forward, causal_attention, dense, expand_kv, reduce_kv
from .packing import to_device

aten = torch.ops.aten

_FAV_FWD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
                 "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap", "alibi_slopes",
                 "return_softmax")
_FAV_BWD_ARGS = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
                 "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size_left",
                 "window_size_right", "softcap", "alibi_slopes", "deterministic")


def flash_attn_varlen_kernels(interface):
    """flash-attn's ``(_flash_attn_varlen_forward, _flash_attn_varlen_backward)`` when their
    signatures are flash-attn 2.7-2.8's (LSE ``[n, T]`` since 2.6), else None."""
    try:
        fwd, bwd = interface._flash_attn_varlen_forward, interface._flash_attn_varlen_backward
        ok = K._takes(fwd, _FAV_FWD_ARGS) and K._takes(bwd, _FAV_BWD_ARGS)
    except (AttributeError, TypeError, ValueError):
        ok = False
    return (fwd, bwd) if ok else None


def _load():
    if K.FLASH_ATTN_VERSION is None:
        return None
    from flash_attn import flash_attn_interface
    return flash_attn_varlen_kernels(flash_attn_interface)


_FAV = _load()


def _fav():
    """flash-attn's varlen kernels where installed and not turned off (``torch_kernels_only``)."""
    return _FAV if K._fa() is not None else None


def _thd(x):
    """``[1, h, T, d]`` as the ``[T, h, d]`` view varlen kernels take (last dim contiguous)."""
    return x.select(0, 0).transpose(0, 1)


def _bhsd(x):
    """``[T, h, d]`` back to ``[1, h, T, d]`` (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _lengths(docs, q):
    return docs.cu_seqlens(q.device), docs.max_length


# -- forward kernels: (q, k, v, docs, scale) -> (out [1, n, T, d], lse [1, n, T] fp32) -----------

def _fwd_flash_attn(q, k, v, docs, scale):
    cu, mx = _lengths(docs, q)
    out, lse = _FAV[0](_thd(q), _thd(k), _thd(v), cu, cu, mx, mx, 0.0, scale, True, -1, -1, 0.0, None, False)[:2]
    return _bhsd(out), lse.unsqueeze(0)


def _fwd_torch_flash(q, k, v, docs, scale):
    cu, mx = _lengths(docs, q)
    out, lse = aten._flash_attention_forward(_thd(q), _thd(k), _thd(v), cu, cu, mx, mx, 0.0, True, False,
                                             scale=scale)[:2]
    return _bhsd(out), lse.unsqueeze(0)


def _lse_rows(docs, device, width: int):
    """For each token, its row in the memory-efficient kernel's LSE ``[docs, n, width]``
    flattened over (doc, row): ``doc * width + offset in doc``."""
    def build(dev):
        rows = [d * width + j for d, n in enumerate(docs.lengths) for j in range(n)]
        return to_device(rows, torch.long, dev)
    return docs.on_device(("lse_rows", width), device, build)


def _efficient_width(docs) -> int:
    return -(-docs.max_length // 32) * 32  # rows padded to a multiple of 32 per document


def _fwd_efficient(q, k, v, docs, scale):
    cu, mx = _lengths(docs, q)
    rep = q.shape[1] // k.shape[1]
    k, v = expand_kv(k, rep), expand_kv(v, rep)
    out, lse = aten._efficient_attention_forward(
        _thd(q).unsqueeze(0), _thd(k).unsqueeze(0), _thd(v).unsqueeze(0), None, cu, cu, mx, mx, 0.0, 1, True,
        scale=scale)[:2]
    n, width = lse.shape[1], lse.shape[2]  # [docs, n, width] to [1, n, T]
    flat = lse.transpose(0, 1).reshape(n, -1)
    return _bhsd(out.select(0, 0)), flat.index_select(1, _lse_rows(docs, q.device, width)).unsqueeze(0)


def _per_document(fn, docs, *tensors):
    """``fn`` on each document's rows of ``tensors`` (dim 2), results concatenated along dim 2."""
    parts = []
    for a, b in zip(docs.bounds, docs.bounds[1:]):
        parts.append(fn(*(t.narrow(2, a, b - a) for t in tensors)))
    return [torch.cat(list(xs), dim=2) for xs in zip(*parts)]


def _fwd_documents(q, k, v, docs, scale):
    return tuple(_per_document(lambda *t: attn_forward(*t, True, scale), docs, q, k, v))


_FORWARD = types.MappingProxyType({
    kernel_select.FLASH_ATTN: _fwd_flash_attn,
    kernel_select.TORCH_FLASH: _fwd_torch_flash,
    kernel_select.TORCH_EFFICIENT: _fwd_efficient,
    kernel_select.MATH: _fwd_documents,
    kernel_select.CPU_FLASH: _fwd_documents,
})


# -- backward kernels: (dout, q, k, v, out, lse, docs, scale) -> (dq, dk, dv) with k's heads -----

def _bwd_flash_attn(dout, q, k, v, out, lse, docs, scale):
    cu, mx = _lengths(docs, q)
    dq, dk, dv = (torch.empty(_thd(x).shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    _FAV[1](_thd(dout), _thd(q), _thd(k), _thd(v), _thd(out), dense(lse.select(0, 0)), dq, dk, dv, cu, cu,
            mx, mx, 0.0, scale, True, -1, -1, 0.0, None, runtime.options().is_deterministic())
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def _bwd_torch_flash(dout, q, k, v, out, lse, docs, scale):
    cu, mx = _lengths(docs, q)
    grads = aten._flash_attention_backward(_thd(dout), _thd(q), _thd(k), _thd(v), _thd(out),
                                           dense(lse.select(0, 0)), cu, cu, mx, mx, 0.0, True, *K._flash_rng(q),
                                           scale=scale)
    return tuple(_bhsd(g) for g in grads)


def _bwd_efficient(dout, q, k, v, out, lse, docs, scale):
    cu, mx = _lengths(docs, q)
    rep = q.shape[1] // k.shape[1]
    n, width = q.shape[1], _efficient_width(docs)
    rows = _lse_rows(docs, q.device, width)
    padded = lse.new_zeros((n, (len(docs.bounds) - 1) * width)).index_copy(1, rows, lse.select(0, 0).float())
    padded = dense(padded.view(n, -1, width).transpose(0, 1))
    as4 = lambda x: dense(_thd(x)).unsqueeze(0)  # noqa: E731 - [1, T, h, d], contiguous
    dq, dk, dv, _ = aten._efficient_attention_backward(
        as4(dout), as4(q), as4(expand_kv(k, rep)), as4(expand_kv(v, rep)), None, as4(out), cu, cu, mx, mx, padded,
        0.0, *K._efficient_rng(q), 1, False, scale=scale)
    dq, dk, dv = (_bhsd(g.select(0, 0)) for g in (dq, dk, dv))
    return dq, reduce_kv(dk, rep), reduce_kv(dv, rep)


def _bwd_documents(dout, q, k, v, out, lse, docs, scale):
    lse4 = lse.unsqueeze(-1)  # [1, n, T, 1]: split along dim 2 with the others
    return tuple(_per_document(lambda do, q_, k_, v_, o, l: attn_backward(do, q_, k_, v_, o, l.squeeze(-1), True, scale),
                               docs, dout, q, k, v, out, lse4))


_BACKWARD = types.MappingProxyType({
    kernel_select.FLASH_ATTN: _bwd_flash_attn,
    kernel_select.TORCH_FLASH: _bwd_torch_flash,
    kernel_select.TORCH_EFFICIENT: _bwd_efficient,
    kernel_select.MATH: _bwd_documents,
    kernel_select.CPU_FLASH: _bwd_documents,
})


def _families(q):
    if q.shape[0] != 1:
        raise ValueError(f"variable-length attention takes one packed row (b = 1), got b = {q.shape[0]}")
    c = kernel_select.call_of(q)
    return c, kernel_select.candidates(c, _fav() is not None)


def kernel_path(q) -> str:
    """Which varlen kernel runs first for ``q`` (per document: one dense block kernel each)."""
    family = _families(q)[1][0]
    if family in (kernel_select.MATH, kernel_select.CPU_FLASH):
        return f"per document ({K.kernel_path(q)})"
    return f"{family} varlen"


def forward(q, k, v, docs, scale: float):
    """(out like q, lse [1, n, T] fp32) of causal attention inside each document of ``docs``."""
    c, families = _families(q)
    return kernel_select.run(c, families, _FORWARD, q, k, v, docs, scale)


def backward(dout, q, k, v, out, lse, docs, scale: float):
    """(dq, dk, dv) given the rows' global ``out`` and ``lse``; dk/dv have k's heads."""
    c, families = _families(q)
    return kernel_select.run(c, families, _BACKWARD, dout, q, k, v, out, lse, docs, scale)


class VarlenAttention(torch.autograd.Function):
    """Causal attention inside each document, differentiable (saves q, k, v, out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, docs):
        out, lse = forward(q, k, v, docs, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.docs = scale, docs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(dout, q, k, v, out, lse, ctx.docs, ctx.scale)
        return dq, dk, dv, None, None


def document_attention(q, k, v, scale: float, docs=None):
    """Causal attention of ``q [b, n, s, d]`` over its whole sequence (torch's SDPA), or of a
    pack (``docs``) inside each document: one variable-length call (:class:`VarlenAttention`)."""
    if docs is None:
        return causal_attention(q, k, v, scale)
    return VarlenAttention.apply(q, k, v, scale, docs)
