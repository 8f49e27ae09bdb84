"""The torch LayerNorm / RMSNorm that sequence parallelism needs when apex is absent.

megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel``; apex's ``FusedLayerNorm``
instead tags its parameters ``sequence_parallel`` so that ``finalize_model_grads`` sums their
gradients over TP. This is that norm, with the same maths and state-dict keys as megatron's.
Used by the GPU trainer without apex and by the CPU compatibility layer.
"""
from __future__ import annotations

import torch


def sp_torch_norm(config, hidden_size, eps=1e-5, **unused):
    """A torch norm for ``config.normalization`` whose parameters carry ``sequence_parallel``."""
    if config.layernorm_zero_centered_gamma or config.persist_layer_norm:
        raise ValueError("zero_centered_gamma / persist_layer_norm not supported by torch norms")
    cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(config.normalization)
    if cls is None:
        raise ValueError(f"normalization {config.normalization!r} not supported by torch norms")
    norm = cls(hidden_size, eps=eps)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm
