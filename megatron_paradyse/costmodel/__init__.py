"""Cost models: what a decoder layer under each strategy costs (time, memory), per rank.

``build_cost_model(shape)`` is what the planner and the data / benchmark code use:

    from megatron_paradyse.costmodel import ModelShape, build_cost_model
    cm = build_cost_model(ModelShape.from_config(config, vocab=padded_vocab, p=4))
    cm.layer("ring", s=4096, b=1)        # LayerCost(seconds, saved_bytes, transient_bytes)
    cm.step(("tp_sp",) * 2 + ("metp",) * 2, s=4096, b=1)   # StepCost(seconds, peak_bytes)

``path=None``: the fitted model shipped in the package for this shape (``models/``), if any,
else the analytic model (memory formulas, roofline time). A path: that fitted model, checked
against the shape (a mismatch, a truncated or corrupt file is a clear error).
"""
from __future__ import annotations

from .analytic import AnalyticCostModel
from .base import CostModel, LayerCost, StepCost, plan_counts
from .fitted import FittedCostModel, extrapolation_note, find_shipped
from .shape import ModelShape, demo_shape, pad_vocab

__all__ = ["ModelShape", "build_cost_model", "CostModel", "LayerCost", "StepCost", "plan_counts",
           "demo_shape", "pad_vocab", "shipped_model_path", "extrapolation_note"]


def shipped_model_path(shape: ModelShape) -> str | None:
    """The fitted model shipped in the package for ``shape`` (metadata file path), or None."""
    return find_shipped(shape)


def build_cost_model(shape: ModelShape, path: str | None = None, prefetch: bool = True,
                     **analytic_kwargs) -> CostModel:
    """The cost model for ``shape``: fitted (``path``, or shipped) or analytic; ``prefetch``: the
    run's ZeRO weight prefetch (``RuntimeOptions.prefetch``), which its pool depends on."""
    if not isinstance(shape, ModelShape):
        raise TypeError(f"build_cost_model needs a ModelShape, got {type(shape).__name__}")
    if path is None:
        path = find_shipped(shape)
        if path is None:
            return AnalyticCostModel(shape, prefetch=prefetch, **analytic_kwargs)
    return FittedCostModel.load(path, shape, prefetch=prefetch)
