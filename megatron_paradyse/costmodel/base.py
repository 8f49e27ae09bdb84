"""The cost-model interface the planner depends on, and how a whole step is composed from layers.

A cost model predicts, for one decoder layer run by one strategy on a micro-batch of padded
sequence length ``s`` and micro-batch size ``b`` (per rank of the switching group of size p):

* ``seconds``: forward + backward time of the layer;
* ``saved_bytes``: bytes the layer keeps alive from its forward until its backward;
* ``transient_bytes``: the layer's peak above its saved bytes while it runs (gathered
  weights, communication buffers, score rows, recompute).

A step is composed from layers (layers of one model are alike, so only the count of layers per
strategy matters): its time is the non-layer time (embedding, output layer and loss, gradient
reduction, optimizer step) plus the sum of the layers' times; its peak is the static memory
(weights, gradients, optimizer state), plus the non-layer activations, plus the saved bytes of
every layer, plus the largest transient of any layer (the peak is reached in the backward of the
layer with the largest transient while every layer's activations are still alive; bounding it by
the largest is exact for a stack whose layers are alike).
"""
from __future__ import annotations

from typing import NamedTuple


class LayerCost(NamedTuple):
    seconds: float
    saved_bytes: float
    transient_bytes: float


class StepCost(NamedTuple):
    seconds: float
    peak_bytes: float


class CostModel:
    """Base class: subclasses implement :meth:`layer`, :meth:`static_bytes` and the non-layer costs.

    ``strategies`` lists the strategies this model can predict; ``num_layers`` is the number of
    decoder layers on this rank (pipeline stage).
    """

    strategies: tuple = ()
    num_layers: int = 0

    def layer(self, strategy: str, s: int, b: int) -> LayerCost:
        raise NotImplementedError

    def static_bytes(self) -> float:
        """Weights, gradients and optimizer state on one rank (independent of the batch)."""
        raise NotImplementedError

    def nonlayer(self, s: int, b: int) -> LayerCost:
        """Embedding, output layer and loss, gradient reduction and optimizer step, as one term."""
        return LayerCost(0.0, 0.0, 0.0)

    def step(self, plan, s: int, b: int) -> StepCost:
        """Predicted (seconds, peak bytes) of one micro-batch's forward+backward under ``plan``.

        ``plan`` is one strategy name per layer, or a mapping ``{strategy: layer count}``.
        """
        counts = plan_counts(plan)
        n = sum(counts.values())
        if self.num_layers and n != self.num_layers:
            raise ValueError(f"plan has {n} layers, the cost model's model has {self.num_layers}")
        extra = self.nonlayer(s, b)
        seconds, saved, transient = extra.seconds, extra.saved_bytes, extra.transient_bytes
        for name, k in counts.items():
            c = self.layer(name, s, b)
            seconds += k * c.seconds
            saved += k * c.saved_bytes
            transient = max(transient, c.transient_bytes)
        return StepCost(seconds, self.static_bytes() + saved + transient)


def plan_counts(plan) -> dict:
    """``{strategy: number of layers}`` for a per-layer plan (tuple/list) or a counts mapping."""
    if isinstance(plan, dict):
        return {k: int(v) for k, v in plan.items() if int(v) > 0}
    counts: dict = {}
    for name in plan:
        counts[name] = counts.get(name, 0) + 1
    return counts
