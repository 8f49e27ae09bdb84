"""One pipeline stage of a whole-model cost model, and the share of a layer's time in its forward.

With pipeline parallelism (P stages, megatron-core's ``forward_backward_pipelining_without_
interleaving``) stage r holds layers ``[r*L/P, (r+1)*L/P)``; :func:`stage_cost_model` is a
:class:`~megatron_paradyse.costmodel.base.CostModel` of one stage (its layers, its share of the
static memory, the output layer and loss on the last stage, the pipeline tensors it keeps).
The pipeline planner (``planner/stages.py``) and the pipeline simulation
(``bench/simulate_pipeline.py``) price their stages with it; :func:`forward_share` splits a
layer's seconds between its forward and its backward for the 1F1B schedule
(``costmodel/schedule.py``).
"""
from __future__ import annotations

from ..parallel.plans import split_entry
from .analytic import param_counts
from .base import CostModel, LayerCost

FORWARD_SHARE = 1.0 / 3.0     # a layer's (and the non-layer part's) forward: 1 of 3 passes
RC_FORWARD_SHARE = 1.0 / 4.0  # a recomputed layer's: 1 of 4 (its backward runs the forward again)
BLOCK_FORWARD_SHARE = 0.3     # a layer with one block recomputed: 1 of 3 passes plus that block's


def forward_share(entry: str) -> float:
    """The share of a layer's forward + backward seconds spent in its forward, by plan entry."""
    kind = split_entry(entry)[1]
    return FORWARD_SHARE if kind is None else RC_FORWARD_SHARE if kind == "layer" else BLOCK_FORWARD_SHARE


def stage_fraction(cost_model, stage: int, num_stages: int) -> float:
    """The share of the model's parameters on ``stage``: its layers, the embedding on the
    first, the final norm and output layer on the last (``analytic.param_counts``); without
    a ``shape`` on the cost model, an even split (1 / num_stages)."""
    shape = getattr(cost_model, "shape", None)
    if shape is None:
        return 1.0 / num_stages
    pc = param_counts(shape)
    total = pc["layers"] + pc["embedding"] + pc["output"] + pc["final_norm"]
    part = pc["per_layer"] * shape.num_layers / num_stages
    part += pc["embedding"] if stage == 0 else 0.0
    part += pc["output"] + pc["final_norm"] if stage == num_stages - 1 else 0.0
    return part / total


class StageCostModel(CostModel):
    """One pipeline stage of a whole-model cost model (see :func:`stage_cost_model`)."""

    def __init__(self, cost_model, stage: int, num_stages: int):
        L, P = int(cost_model.num_layers), int(num_stages)
        if P < 1 or not 0 <= stage < P:
            raise ValueError(f"stage {stage} of {P}: need 0 <= stage < num_stages and num_stages >= 1")
        if L < 1 or L % P:
            raise ValueError(f"{L} layers do not split evenly over {P} pipeline stages")
        self.model, self.stage, self.num_stages = cost_model, int(stage), P
        self.first, self.last = stage == 0, stage == P - 1
        self.num_layers = L // P
        self.strategies = tuple(cost_model.strategies)
        if getattr(cost_model, "shape", None) is not None:
            self.shape = cost_model.shape  # the whole model's (p, the layer geometry)
        self.fraction = stage_fraction(cost_model, stage, P)

    def layers(self) -> range:
        """The model's layer indices this stage runs."""
        return range(self.stage * self.num_layers, (self.stage + 1) * self.num_layers)

    def layer(self, strategy: str, s, b: int) -> LayerCost:
        return self.model.layer(strategy, s, b)

    def pool(self, strategy: str, s, b: int) -> dict:
        if strategy == "nonlayer" and not self.last:
            return {}  # the output layer's buffers: last stage only
        return self.model.pool(strategy, s, b)

    def recomputes(self) -> bool:
        return bool(self.model.recomputes())

    def recompute_kinds(self) -> tuple:
        return tuple(getattr(self.model, "recompute_kinds", lambda: ("layer",) if self.recomputes() else ())())

    def device_kind(self) -> str:
        return self.model.device_kind()

    def static_bytes(self) -> float:
        return float(self.model.static_bytes()) * self.fraction

    def update_seconds(self) -> float:
        """The model's update seconds times this stage's parameter share (the stages update at once)."""
        return float(self.model.update_seconds()) * self.fraction

    def nonlayer(self, s, b: int) -> LayerCost:
        """The whole non-layer part on the last stage (output layer and loss; the embedding's
        lookup, tiny, is counted there too), nothing elsewhere."""
        return self.model.nonlayer(s, b) if self.last else LayerCost(0.0, 0.0, 0.0)

    def resident_bytes(self, s, b: int) -> float:
        """The stage's input ``[s/p, b, h]`` (embedding output, or the received pipeline input),
        on every stage. A non-last stage's output sent on is kept until its backward (megatron
        frees its data only with ``deallocate_pipeline_outputs``, off here), but it is the last
        layer's output, already in that layer's saved bytes (``costmodel/measure.py``: a
        layer's saved bytes include its output), so it is not counted again. Measured (PP = 2 x
        p = 2, the demo shape, CPU live-bytes tracker, metp / metp:rc / tp_sp:rc / tp_sp on
        every layer): the live bytes a micro-batch leaves on stage 0 from its forward to its
        backward (pool aside) were the planner's held less exactly one ``[s/p, b, h]`` when
        this counted the output too (0.694 MiB at s = 2844, 0.440 at 1804)."""
        return float(self.model.resident_bytes(s, b))


def stage_cost_model(cost_model, stage: int, num_stages: int) -> StageCostModel:
    """A cost model of ``stage`` (0-based) of ``num_stages``: ``num_layers = L / P`` (megatron's
    even split; ValueError otherwise); ``layer``, ``pool``, ``recomputes`` and ``device_kind``
    delegate; ``static_bytes`` and ``update_seconds`` are the stage's parameter share
    (:func:`stage_fraction`: exact for the analytic and fitted models, whose static bytes are
    bytes per parameter times parameters; an even split for a cost model without ``shape``);
    ``nonlayer`` the whole non-layer part on the last stage, zero elsewhere; ``resident_bytes``
    the stage's input (:meth:`StageCostModel.resident_bytes`: the cost model's
    ``resident_bytes``, which for a model without ``shape`` is its non-layer saved bytes, an
    upper bound; the output sent on is the last layer's, in its saved bytes). One stage of one
    is the model itself."""
    return StageCostModel(cost_model, stage, num_stages)
