"""One-process check of the attention kernels on a device, for a GPU self-check.

Runs the ring's own per-rank code (``ring.ring_forward``, ``ring.step_backward``) for every
rank of a balanced layout (:func:`ring_blocks_selfcheck`) and of a pack's layout, and the
variable-length primitive over the whole pack (:func:`packed_selfcheck`), each K/V block taken
with its KV heads as the ring does, and compares out, lse, dq, dk, dv with causal softmax
attention (inside each document) in float64 on the same device. Expected relative errors:
fp32 below 1e-5, bf16/fp16 around 1e-2.
"""
from __future__ import annotations

import torch

from . import kernel_select, varlen
from . import attention_kernels as K
from .attention_kernels import expand_kv, kernel_path, native_gqa
from .pack_layout import PackedLayout
from .packing import Documents
from .strategies import ring
from .zigzag import RingLayout

# ranks, tokens per rank (odd: unequal halves), batch, query heads, KV heads, head dim
P, L, B, N, KV, D = 4, 101, 2, 8, 2, 64


def _reference(q, k, v, dout, scale, docs=None):
    """Causal softmax attention in float64 (inside each document of ``docs``): (out, lse, dq, dk, dv)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    s = q @ expand_kv(k, rep).transpose(-1, -2) * scale
    n = s.shape[-1]
    seen = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
    if docs is not None:
        doc = torch.tensor([docs.doc_of(i) for i in range(n)], device=s.device)
        seen &= doc.unsqueeze(1) == doc.unsqueeze(0)
    s = s.masked_fill(~seen, float("-inf"))
    out = s.softmax(-1) @ expand_kv(v, rep)
    out.backward(dout.double())
    return out, s.logsumexp(-1), q.grad, k.grad, v.grad


def _segments(layout, rank):
    return layout.segments(rank) if hasattr(layout, "segments") else layout.pieces(rank)


def _local(x, layout, rank):
    """Rank ``rank``'s tokens of a global ``[b, h, s, ...]`` tensor, in its local order."""
    return torch.cat([x[:, :, g.cols] for g in _segments(layout, rank)], dim=2)


def _to_global(parts, layout, like):
    """Inverse of :func:`_local` over all ranks, in float64."""
    out = torch.zeros_like(like, dtype=torch.float64)
    for rank, part in enumerate(parts):
        for g in _segments(layout, rank):
            out[:, :, g.cols] = part[:, :, g.local].double()
    return out


def _order(rank):
    """The sources of a rank's ring steps, its own first (``RingComm.stream``'s order)."""
    return [(rank - step) % P for step in range(P)]


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def _inputs(device, dtype, batch, total, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda h: torch.randn(batch, h, total, D, device=device, generator=gen).to(dtype)  # noqa: E731
    return rand(N), rand(KV), rand(KV), rand(N)


def _ring_errors(q, k, v, dout, layout, scale, docs=None) -> dict:
    """Every rank's ring forward and backward over ``layout`` against float64."""
    dtype = q.dtype
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
            blocks = ring.step_blocks(layout, r, s, qs[r])
            contrib = ring.step_backward(douts[r], qs[r], outs[r], lses[r], dqs[r], ks[s], vs[s], blocks, scale)
            if contrib is not None:
                dks[s] += contrib[0]
                dvs[s] += contrib[1]
    ref = _reference(q, k, v, dout, scale, docs)
    got = [_to_global(parts, layout, like) for parts, like in
           ((outs, q), (lses, q[..., 0]), (dqs, q), (dks, k), (dvs, v))]
    return {name: _rel(g, r) for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref)}


def ring_blocks_selfcheck(device, dtype, seed: int = 0) -> dict:
    """Relative errors of the ring's block-kernel results against float64, and the kernel path
    (``kernel_path``) and whether K/V went in with their own heads (``native_gqa``)."""
    q, k, v, dout = _inputs(device, dtype, B, P * L, seed)
    errors = _ring_errors(q, k, v, dout, RingLayout(P, L), D ** -0.5)
    return {"path": kernel_path(q), "native_gqa": native_gqa(q), **errors}


# a pack of documents of 1 token, short ones, and ones across the p = 4 chunks
PACK = (1, 37, 3, 90, 1, 150, 11, 111)


def packed_selfcheck(device, dtype, seed: int = 0) -> dict:
    """A pack through the ring's code over its pack layout (own keys in one variable-length call)
    and through the variable-length primitive whole (``tp_sp``/``ulysses``), against float64
    attention inside each document: ``{"path": ..., "ring": errors, "varlen": errors}``."""
    bounds = [0]
    for n in PACK:
        bounds.append(bounds[-1] + n)
    docs, scale = Documents(tuple(bounds)), D ** -0.5
    q, k, v, dout = _inputs(device, dtype, 1, docs.total, seed)
    out, lse = varlen.forward(q, k, v, docs, scale)
    grads = varlen.backward(dout, q, k, v, out, lse, docs, scale)
    ref = _reference(q, k, v, dout, scale, docs)
    whole = {name: _rel(g, r) for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(grads), ref)}
    return {"path": varlen.kernel_path(q), "ring": _ring_errors(q, k, v, dout, PackedLayout(P, docs), scale, docs),
            "varlen": whole}


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


def kernel_families(device, dtype, head_dim: int = D) -> list:
    """Every kernel family that may run ``dtype`` attention on ``device`` (first choice first)."""
    q = torch.empty(1, 1, 1, head_dim, device=device, dtype=dtype)
    return kernel_select.candidates(kernel_select.call_of(q), K._fa() is not None)
