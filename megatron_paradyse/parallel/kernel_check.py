"""One-process check of the ring's block kernels on a device, for a GPU self-check.

Runs the ring's own per-rank code (``ring.ring_forward``, ``ring.step_backward``) for every
rank of a balanced layout, each K/V block taken with its KV heads as the ring does, and
compares out, lse, dq, dk, dv with causal softmax attention in float64 on the same device.
Expected relative errors: fp32 below 1e-5, bf16/fp16 around 1e-2.
"""
from __future__ import annotations

import torch

from . import varlen
from .attention_kernels import expand_kv, kernel_path, native_gqa
from .strategies import ring
from .zigzag import RingLayout

# ranks, tokens per rank (odd: unequal halves), batch, query heads, KV heads, head dim
P, L, B, N, KV, D = 4, 101, 2, 8, 2, 64


def _reference(q, k, v, dout, scale):
    """Causal softmax attention in float64: (out, lse, dq, dk, dv)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    s = q @ expand_kv(k, rep).transpose(-1, -2) * scale
    n = s.shape[-1]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    out = s.softmax(-1) @ expand_kv(v, rep)
    out.backward(dout.double())
    return out, s.logsumexp(-1), q.grad, k.grad, v.grad


def _local(x, layout, rank):
    """Rank ``rank``'s tokens of a global ``[b, h, s, ...]`` tensor, in its local order."""
    return torch.cat([x[:, :, g.cols] for g in layout.segments(rank)], dim=2)


def _to_global(parts, layout, like):
    """Inverse of :func:`_local` over all ranks, in float64."""
    out = torch.zeros_like(like, dtype=torch.float64)
    for rank, part in enumerate(parts):
        for g in layout.segments(rank):
            out[:, :, g.cols] = part[:, :, g.local].double()
    return out


def _order(rank):
    """The sources of a rank's ring steps, its own first (``ring_stream``'s order)."""
    return [(rank - step) % P for step in range(P)]


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def ring_blocks_selfcheck(device, dtype, seed: int = 0) -> dict:
    """Relative errors of the ring's block-kernel results against float64, and the kernel path
    (``kernel_path``) and whether K/V went in with their own heads (``native_gqa``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda h: torch.randn(B, h, P * L, D, device=device, generator=gen).to(dtype)  # noqa: E731
    q, k, v, dout = rand(N), rand(KV), rand(KV), rand(N)
    scale, layout = D ** -0.5, RingLayout(P, L)
    qs, ks, vs, douts = ([_local(x, layout, r) for r in range(P)] for x in (q, k, v, dout))
    outs, lses = [], []
    for r in range(P):
        out, lse = ring.ring_forward(qs[r], ((s, (ks[s], vs[s])) for s in _order(r)), layout, r, scale)
        outs.append(out.to(dtype))  # what RingAttention saves and returns
        lses.append(lse)
    dqs = [torch.zeros_like(x, dtype=torch.float32) for x in qs]
    dks, dvs = ([torch.zeros_like(x, dtype=torch.float32) for x in xs] for xs in (ks, vs))
    for r in range(P):
        for s in _order(r):
            blocks = layout.kernel_blocks(r, s)
            contrib = ring.step_backward(douts[r], qs[r], outs[r], lses[r], dqs[r], ks[s], vs[s], blocks, scale)
            if contrib is not None:
                dks[s] += contrib[0]
                dvs[s] += contrib[1]
    ref = _reference(q, k, v, dout, scale)
    got = [_to_global(parts, layout, like) for parts, like in
           ((outs, q), (lses, q[..., 0]), (dqs, q), (dks, k), (dvs, v))]
    errors = {name: _rel(g, r) for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref)}
    return {"path": kernel_path(q), "native_gqa": native_gqa(q), **errors}


def kernel_choices(device, head_dim: int, dtypes=(torch.float32, torch.bfloat16)) -> list:
    """One line per dtype: which kernel each attention path runs on ``device`` for this head size
    (``kernel_select``'s first choice; a kernel that raises falls back to the next, logged)."""
    lines = []
    for dtype in dtypes:
        q = torch.empty(1, 1, 1, head_dim, device=device, dtype=dtype)
        gqa = "native GQA" if native_gqa(q) else "K/V expanded"
        lines.append(f"{str(dtype).replace('torch.', '')}, head_dim {head_dim}: ring blocks {kernel_path(q)} ({gqa}); "
                     f"packs {varlen.kernel_path(q)}; whole sequences torch SDPA")
    return lines
