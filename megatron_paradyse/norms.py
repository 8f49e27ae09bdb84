"""The torch LayerNorm / RMSNorm that sequence parallelism needs.

megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel`` (and its local spec uses it for
RMSNorm even where apex exists); apex's ``FusedLayerNorm`` instead tags its parameters
``sequence_parallel`` so that ``finalize_model_grads`` sums their gradients over TP. This is
that norm, with the same maths and state-dict keys as megatron's. The plugin's model builder
(``megatron_paradyse.model``) uses it whenever sequence parallelism is on; the Megatron-LM
entry point and the CPU compatibility layer put it behind ``WrappedTorchNorm``.
"""
from __future__ import annotations

import torch

from . import runtime


def sp_torch_norm(config, hidden_size, eps=1e-5, **unused):
    """A torch norm for ``config.normalization`` whose parameters carry ``sequence_parallel``."""
    if config.layernorm_zero_centered_gamma:
        raise ValueError("layernorm_zero_centered_gamma is not supported by torch norms")
    # persist_layer_norm selects apex's persistent kernel; the maths is the same without it
    cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(config.normalization)
    if cls is None:
        raise ValueError(f"normalization {config.normalization!r} not supported by torch norms")
    norm = cls(hidden_size, eps=eps)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm


class SPTorchNorm:
    """:func:`sp_torch_norm` as a module class for megatron layer specs (``build_module``
    instantiates classes but returns plain functions uncalled)."""

    def __new__(cls, config, hidden_size, eps=1e-5, **unused):
        return sp_torch_norm(config, hidden_size, eps)


def install_sp_norm() -> None:
    """Make megatron's ``WrappedTorchNorm`` (the local spec's norm for RMSNorm on every image,
    and for LayerNorm without apex) build :func:`sp_torch_norm`, which accepts sequence
    parallelism; idempotent. For code that builds megatron's local spec itself (Megatron-LM's
    own model providers); the plugin's builder (``megatron_paradyse.model``) needs no patch. The
    registry's patch named ``sp_norm`` (``runtime.py``)."""
    from megatron.core.transformer import torch_norm

    if getattr(torch_norm.WrappedTorchNorm.__new__, "_paradyse", False):
        return

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        return sp_torch_norm(config, hidden_size, eps)

    __new__._paradyse = True
    runtime.install("sp_norm", runtime.Patch(torch_norm.WrappedTorchNorm, "__new__", __new__))
