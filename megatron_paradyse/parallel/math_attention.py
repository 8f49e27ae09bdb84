"""The attention block kernel that runs anywhere: explicit scores in fp32, with the log-sum-exp.

The last fallback of ``kernel_select`` (an sm < 80 GPU with bf16, a head size no fused kernel
takes, a fused kernel that raised). Same contract as the fused block kernels: ``q [b, n, sq, d]``,
``k``/``v`` ``[b, n, sk, d]`` (heads already expanded), causal blocks square; the backward takes
the *global* ``out`` and ``lse`` of the rows, so ring blocks merge as with flash kernels.
Memory: one ``[b, n, sq, sk]`` fp32 score block.
"""
from __future__ import annotations

import torch


def _scores(q, k, causal: bool, scale: float):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if causal:
        n = s.shape[-1]
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    return s


def forward(q, k, v, causal: bool, scale: float):
    """(out like q, lse [b, n, sq] fp32)."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) given the rows' global ``out`` and ``lse`` (softmax backward:
    ``dS = P * (dP - rowsum(dO * O))``)."""
    p = torch.exp(_scores(q, k, causal, scale) - lse.float().unsqueeze(-1))
    do = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.float().transpose(-1, -2))
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.float()).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q.float()).mul_(scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
