"""Attention kernels: torch's SDPA where no log-sum-exp is needed, and block kernels that expose
the log-sum-exp with the merge that ring attention needs.

Layout here is ``[b, heads, s, d]``. For the block kernels: on CPU: torch's flash kernel for CPU
(``_scaled_dot_product_flash_attention_for_cpu``), which returns the log-sum-exp and has a
backward that accepts a global output and log-sum-exp, the property that lets a ring split
one softmax into blocks. On CUDA: flash-attn when installed, else torch's own flash kernel
(fp16/bf16) or memory-efficient kernel (fp32).
"""
from __future__ import annotations

import torch

try:  # optional GPU extra
    from flash_attn.flash_attn_interface import _flash_attn_backward as _fa_bwd
    from flash_attn.flash_attn_interface import _flash_attn_forward as _fa_fwd
    HAVE_FLASH_ATTN = True
except Exception:  # noqa: BLE001 - any import failure means "not available"
    HAVE_FLASH_ATTN = False

aten = torch.ops.aten


def _flash_attn_ok(q):
    return HAVE_FLASH_ATTN and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def attn_forward(q, k, v, causal: bool, scale: float):
    """Softmax attention of one block: returns (out like q, lse [b, heads, sq] in fp32)."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
        return out, lse
    if _flash_attn_ok(q):
        res = _fa_fwd(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                      v.transpose(1, 2).contiguous(), 0.0, scale, causal=causal,
                      window_size_left=-1, window_size_right=-1, softcap=0.0,
                      alibi_slopes=None, return_softmax=False)
        return res[0].transpose(1, 2), res[1]
    if q.dtype in (torch.float16, torch.bfloat16):
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., : q.shape[2]]


def attn_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of one block, given the *global* out and lse of its rows."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale)
    if _flash_attn_ok(q):
        t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
        dq, dk, dv = torch.empty_like(t(q)), torch.empty_like(t(k)), torch.empty_like(t(v))
        _fa_bwd(t(dout), t(q), t(k), t(v), t(out), lse.contiguous(), dq, dk, dv, 0.0, scale, causal,
                -1, -1, 0.0, None, False)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    b, h, sq, _ = q.shape
    if q.dtype in (torch.float16, torch.bfloat16):
        cum = torch.empty(0, dtype=torch.int32, device=q.device)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), cum, cum, sq, k.shape[2],
            0.0, causal, seed, seed, scale=scale)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    pad = (-sq) % 32
    lse_p = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, k, v, None, out.contiguous(), lse_p.contiguous(), seed, seed, 0.0,
        [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def merge_lse(out, lse, blk_out, blk_lse):
    """Merge a block's partial softmax result into the running one; returns (out, lse) in fp32.

    ``out`` may be None (first block). Uses logaddexp, so no exponent overflows.
    """
    blk_out = blk_out.float()
    if out is None:
        return blk_out, blk_lse.float()
    new_lse = torch.logaddexp(lse, blk_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + blk_out * torch.exp(blk_lse - new_lse).unsqueeze(-1)
    return out, new_lse


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
    import torch.nn.functional as F

    rep = q.shape[1] // k.shape[1]
    if rep > 1 and q.is_cuda and q.dtype == torch.float32:
        # fp32 CUDA has no flash kernel and SDPA's GQA would fall back to the quadratic math one
        k, v, rep = expand_kv(k, rep), expand_kv(v, rep), 1
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=rep > 1)
