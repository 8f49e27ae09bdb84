"""Attention kernel calibration: the flash attention kernel timed alone, in the profile's
``kernel`` rows, so that the fit reads its ``s**2`` rate off a clean curve.

Why: in a layer's time at the lengths a profile can afford, attention is a third or less, and
the repeats' spread (10-30% on a shared machine) moves the split between the terms linear in s
(GEMMs, collectives) and the one in s**2 (attention): fitted to 2048 tokens on this CPU, the
flash rate came out 19-125 GFLOP/s from one profile to the next, and the layer at 8192 was
mispredicted by up to 42%. The kernel alone has no GEMM and no collective beside it, so its
curve ``a*b*s + r*FLOPs`` separates them (``fit.fit_kernel_rates``); the layer fit then takes
``r`` as the attention rate of every strategy calling the kernel (docs/costmodel.md, "Time far
beyond the profile").

The class calibrated (``analytic.ATTENTION_KERNEL``): ``flash``, the causal kernel of ``tp_sp``
and ``ulysses`` (``attention_kernels.causal_attention``; ``ring`` and ``metp`` call the same
kernel on blocks, whose s**2 work runs at the same rate, their extra calls' cost being linear
in s), timed on a rank's heads (``heads/p``) over the whole sequence. Colossal's score rows are
not calibrated here: the plain rows (matmul, softmax, matmul) alone took half the time per FLOP
that colossal's layer spends on its rows (masked fill, softmax over the seen columns, the
block-wise backward), so their rate stays fitted with the layers'.
"""
from __future__ import annotations

import torch

from ..parallel.attention_kernels import causal_attention
from . import analytic
from .shape import ModelShape

KERNELS = ("flash",)


def kernel_of(strategy: str) -> str:
    """The kernel class whose s**2 rate a strategy's attention FLOPs take."""
    return analytic.ATTENTION_KERNEL[strategy]


def kernel_flops(kernel: str, shape: ModelShape, s: int, b: int) -> float:
    """FLOPs of one calibration pass (fwd+bwd), in ``analytic.flops_parts``' units, so the rate
    fitted on them is the one the layer's attention FLOPs take: exactly ``tp_sp``'s attention."""
    if kernel not in KERNELS:
        raise ValueError(f"no calibration for attention kernel class {kernel!r}; calibrated: {KERNELS}")
    return analytic.flops_parts("tp_sp", shape, s, b)[1]


def pass_fn(kernel: str, shape: ModelShape, s: int, b: int, dev, dtype):
    """``(forward, backward)`` closures of one calibration pass (``measure._timed``' form): q
    ``[b, heads/p, s, d]``, k and v ``[b, max(1, groups/p), s, d]``, causal."""
    kernel_flops(kernel, shape, s, b)  # the class is known
    p, d = shape.p, shape.head_dim
    # made on the device (its own RNG: the values only have to be finite), so the call site
    # also runs on fake CUDA tensors (tests/test_gpu_kernels.py)
    make = lambda n: torch.randn(b, n, s, d, device=dev, dtype=dtype).requires_grad_(True)  # noqa: E731
    q, k, v = make(shape.heads // p), make(max(1, shape.query_groups // p)), make(max(1, shape.query_groups // p))
    scale = d ** -0.5

    def forward():
        return causal_attention(q, k, v, scale)

    def backward(out):
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None

    return forward, backward
