"""Attention kernels: torch's SDPA where no log-sum-exp is needed, and block kernels that expose
the log-sum-exp with the merge that ring attention needs.

Layout here is ``[b, heads, s, d]``; ``k``/``v`` may have fewer heads than ``q`` (GQA). The
block kernels, chosen per call by ``kernel_select`` (device, capability, dtype, head size; a
kernel that raises falls back to the next, logged): on CPU torch's flash kernel for CPU
(``_scaled_dot_product_flash_attention_for_cpu``, which returns the log-sum-exp and has a
backward that accepts a global output and log-sum-exp, the property that lets a ring split
one softmax into blocks); on CUDA flash-attn 2.7/2.8 when installed, torch's own flash kernel
(fp16/bf16, sm >= 80), its memory-efficient kernel, then explicit scores (``math_attention``).
The flash kernels take fewer K/V heads natively; for the others K/V are expanded per call and
dK/dV reduced. A causal block must be square (the kernels align a non-square causal mask
differently). Packs: ``varlen.py``.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import types

import torch
import torch.nn.functional as F

from .. import runtime
from . import kernel_select, math_attention

log = logging.getLogger(__name__)
aten = torch.ops.aten

# flash-attn's private kernels as called here (2.7.0 - 2.8.x): window_size_left/right, the
# forward returns (out, lse, S_dmask, rng_state), the backward writes dq/dk/dv in place.
# 2.5/2.6 take one ``window_size`` tuple and return 8 values.
_FA_FWD_ARGS = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left",
                "window_size_right", "softcap", "alibi_slopes", "return_softmax")
_FA_BWD_ARGS = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p",
                "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
                "alibi_slopes", "deterministic")


def _takes(fn, names) -> bool:
    """Whether ``fn``'s parameters start with ``names`` and any others have defaults. flash-attn
    wraps its kernels in ``torch.library.custom_op``, which keeps the function in ``_init_fn``."""
    params = list(inspect.signature(getattr(fn, "_init_fn", fn)).parameters.values())
    head, rest = tuple(p.name for p in params[:len(names)]), params[len(names):]
    return head == tuple(names) and all(p.default is not p.empty for p in rest)


def flash_attn_kernels(interface, version: str):
    """``(forward, backward)`` from flash-attn's ``flash_attn_interface`` module when their
    signatures are the ones called here, else None, after one warning naming ``version``."""
    try:
        fwd, bwd = interface._flash_attn_forward, interface._flash_attn_backward
        ok = _takes(fwd, _FA_FWD_ARGS) and _takes(bwd, _FA_BWD_ARGS)
    except (AttributeError, TypeError, ValueError):
        ok = False
    if ok:
        return fwd, bwd
    log.warning("flash-attn %s is installed, but its _flash_attn_forward/_flash_attn_backward are not "
                "those of flash-attn 2.7-2.8 that ParaDySe calls: using torch's attention kernels",
                version)
    return None


def _load_flash_attn():
    """``((forward, backward), version)`` of an installed, compatible flash-attn, else (None, None)."""
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None, None
    version = getattr(flash_attn, "__version__", "unknown")
    kernels = flash_attn_kernels(flash_attn_interface, version)
    return (kernels, version) if kernels else (None, None)


_FA, FLASH_ATTN_VERSION = _load_flash_attn()


def _fa():
    """flash-attn's kernels where installed and not turned off (the runtime options'
    ``flash_attn``, :func:`torch_kernels_only`)."""
    return _FA if runtime.options().flash_attn else None


@contextlib.contextmanager
def torch_kernels_only():
    """torch's block kernels inside, even where flash-attn is installed (the check runs every
    plan with both): the runtime options with ``flash_attn`` off."""
    with runtime.using(flash_attn=False):
        yield


@contextlib.contextmanager
def default_kernels():
    """The block kernels as chosen by default: flash-attn where installed."""
    yield


def _call(q):
    return kernel_select.call_of(q)


def _families(q) -> list:
    return kernel_select.candidates(_call(q), _fa() is not None)


def kernel_path(q) -> str:
    """Which block kernel :func:`attn_forward` / :func:`attn_backward` run first for ``q``
    (``kernel_select``: by device, capability, dtype and head size)."""
    family = _families(q)[0]
    return f"flash-attn {FLASH_ATTN_VERSION}" if family == kernel_select.FLASH_ATTN else family


def native_gqa(q) -> bool:
    """Whether the block kernel for ``q`` takes fewer K/V heads than query heads itself
    (flash-attn's and torch's CUDA flash kernel: ``num_heads % num_heads_k == 0`` in mha_fwd /
    mha_bwd, which sum dK/dV over each group). The others get K/V expanded per call and dK/dV
    reduced (torch 2.13's CPU kernel takes GQA, not checked for older ones)."""
    return _families(q)[0] in _NATIVE_GQA


_NATIVE_GQA = (kernel_select.FLASH_ATTN, kernel_select.TORCH_FLASH)


def bshd(x):
    """``[b, h, s, d]`` values laid out as contiguous ``[b, s, h, d]``: the layout torch's CUDA
    forwards return ``out`` in, which the memory-efficient backward assumes (o_strideM = h*d).
    ``clone``, not ``contiguous()``: the same copy, which also runs on the CPU tests' fake CUDA
    tensors (``contiguous()`` sets a CUDA device guard there)."""
    t = x.transpose(1, 2)
    return x if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format).transpose(1, 2)


def dense(x):
    """``x`` contiguous (``clone``: runs on fake CUDA tensors too, see :func:`bshd`)."""
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _flash_rng(q):
    """RNG state for torch's flash backward, shaped as its forward returns it (uint64 ``[2]``
    and ``[]`` on q's device); read only when dropout_p > 0, never here."""
    return (torch.empty(2, dtype=torch.uint64, device=q.device),
            torch.empty((), dtype=torch.uint64, device=q.device))


def _efficient_rng(q):
    """Philox seed and offset for torch's memory-efficient backward (int64 scalars); read only
    when dropout_p > 0, never here."""
    return (torch.empty((), dtype=torch.int64, device=q.device),
            torch.empty((), dtype=torch.int64, device=q.device))


def _expanded(fn):
    """``fn`` over K/V expanded to the query heads (for kernels without native GQA)."""
    def call(q, k, v, *rest):
        rep = q.shape[1] // k.shape[1]
        return fn(q, expand_kv(k, rep), expand_kv(v, rep), *rest)
    return call


def _fwd_flash_attn(q, k, v, causal, scale):
    # [b, s, h, d] views: flash-attn needs only a contiguous last dim, so nothing is copied
    out, lse = _FA[0](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, scale, causal,
                      -1, -1, 0.0, None, False)[:2]
    return out.transpose(1, 2), lse


def _fwd_torch_flash(q, k, v, causal, scale):
    return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]


def _fwd_efficient(q, k, v, causal, scale):
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return out, lse.narrow(-1, 0, q.shape[2])  # the kernel pads the lse rows to a multiple of 32


def _fwd_cpu(q, k, v, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]


_FORWARD = types.MappingProxyType({
    kernel_select.FLASH_ATTN: _fwd_flash_attn,
    kernel_select.TORCH_FLASH: _fwd_torch_flash,
    kernel_select.TORCH_EFFICIENT: _expanded(_fwd_efficient),
    kernel_select.CPU_FLASH: _expanded(_fwd_cpu),
    kernel_select.MATH: _expanded(math_attention.forward),
})


def attn_forward(q, k, v, causal: bool, scale: float):
    """Softmax attention of one block: returns (out like q, lse [b, heads, sq] in fp32)."""
    c = _call(q)
    return kernel_select.run(c, kernel_select.candidates(c, _fa() is not None), _FORWARD, q, k, v, causal, scale)


def attn_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of one block, given the *global* out and lse of its rows; dk/dv
    have k's heads."""
    c = _call(q)
    return kernel_select.run(c, kernel_select.candidates(c, _fa() is not None), _BACKWARD,
                             dout, q, k, v, out, lse, causal, scale)


def _reduced(fn):
    """``fn`` over K/V expanded to the query heads, dK/dV summed back to K's heads."""
    def call(dout, q, k, v, *rest):
        rep = q.shape[1] // k.shape[1]
        dq, dk, dv = fn(dout, q, expand_kv(k, rep), expand_kv(v, rep), *rest)
        return dq, reduce_kv(dk, rep), reduce_kv(dv, rep)
    return call


def _bwd_cpu(dout, q, k, v, out, lse, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale)


def _bwd_flash_attn(dout, q, k, v, out, lse, causal, scale):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    t = lambda x: x.transpose(1, 2)  # noqa: E731 - [b, s, h, d] views, written in place
    # deterministic: the runtime options' (default torch's global setting, which Megatron-LM's
    # --deterministic-mode sets)
    _FA[1](t(dout), t(q), t(k), t(v), t(out), dense(lse), t(dq), t(dk), t(dv), 0.0, scale, causal,
           -1, -1, 0.0, None, runtime.options().is_deterministic())
    return dq, dk, dv


def _bwd_torch_flash(dout, q, k, v, out, lse, causal, scale):
    # cum_seq_q/k None (undefined): the dense kernel; defined ones select the varlen one. The
    # kernel reads lse by pointer as [b, h, sq]: contiguous
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, dense(lse), None, None, q.shape[2], k.shape[2], 0.0, causal, *_flash_rng(q),
        scale=scale)


def _bwd_efficient(dout, q, k, v, out, lse, causal, scale):
    pad = (-q.shape[2]) % 32  # rows padded to a multiple of 32, as its forward returns them
    lse = torch.nn.functional.pad(lse, (0, pad)) if pad else dense(lse)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, bshd(out), lse, *_efficient_rng(q), 0.0, [True, True, True, False],
        causal, scale=scale)
    return dq, dk, dv


_BACKWARD = types.MappingProxyType({
    kernel_select.FLASH_ATTN: _bwd_flash_attn,
    kernel_select.TORCH_FLASH: _bwd_torch_flash,
    kernel_select.TORCH_EFFICIENT: _reduced(_bwd_efficient),
    kernel_select.CPU_FLASH: _reduced(_bwd_cpu),
    kernel_select.MATH: _reduced(math_attention.backward),
})


def merge_lse(out, lse, blk_out, blk_lse):
    """Merge a block's partial softmax result into the running one; returns (out, lse) in fp32.

    ``out`` may be None (first block). Uses logaddexp, so no exponent overflows. A row that saw
    no key has no softmax mass: flash-attn 2 reports its LSE as +inf, flash-attn 3/4 and torch
    as -inf; both are read as -inf (:func:`empty_rows_as_neg_inf`), such a block adds nothing,
    and a row empty in both keeps output 0 and LSE -inf instead of NaN.
    """
    blk_out, blk_lse = blk_out.float(), empty_rows_as_neg_inf(blk_lse.float())
    if out is None:
        return blk_out, blk_lse
    new_lse = torch.logaddexp(lse, blk_lse)
    out = out * _weight(lse, new_lse) + blk_out * _weight(blk_lse, new_lse)
    return out, new_lse


def empty_rows_as_neg_inf(lse):
    """LSE with flash-attn 2's +inf for a row without keys turned into -inf (no mass): a real
    row's log-sum-exp of finite scores is finite."""
    return torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)


def _weight(lse, new_lse):
    """``exp(lse - new_lse)`` as a ``[..., 1]`` factor; 0 where the merged row is still empty
    (both -inf: their difference is NaN)."""
    w = torch.exp(lse - new_lse)
    return torch.where(torch.isneginf(new_lse), torch.zeros_like(w), w).unsqueeze(-1)


def expand_kv(x, rep: int):
    """``[b, kv_heads, s, d]`` to ``[b, kv_heads * rep, s, d]`` (each KV head serves ``rep`` queries)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def reduce_kv(dx, rep: int):
    """Adjoint of :func:`expand_kv`: sum each KV head's gradient over the queries it served."""
    if rep == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // rep, rep, s, d).sum(2)


def causal_attention(q, k, v, scale: float):
    """Causal attention of ``q [b, n, s, d]`` over ``k``/``v`` ``[b, kv, s, d]`` (``n % kv == 0``).

    torch's ``scaled_dot_product_attention`` (flash on CPU and for fp16/bf16 on CUDA), for the
    strategies that attend over whole sequences and need no log-sum-exp (``tp_sp``, ``ulysses``).
    """
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and q.is_cuda and q.dtype == torch.float32:
        # fp32 CUDA has no flash kernel and SDPA's GQA would fall back to the quadratic math one
        k, v, rep = expand_kv(k, rep), expand_kv(v, rep), 1
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=rep > 1)

