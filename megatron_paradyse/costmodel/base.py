"""The cost-model interface the planner depends on, and how a whole step is composed from layers.

A cost model predicts, for one decoder layer run by one strategy on a micro-batch of padded
sequence length ``s`` and micro-batch size ``b`` (per rank of the switching group of size p):

* ``seconds``: forward + backward time of the layer;
* ``saved_bytes``: bytes the layer keeps alive from its forward until its backward;
* ``transient_bytes``: the layer's peak above its saved bytes while it runs (gathered
  weights, communication buffers, score rows, recompute).

A micro-batch is composed from layers: its time is the non-layer time (embedding, output
layer and loss) plus the sum of the layers' times; a training step adds, once after its last
micro-batch, the update (:meth:`CostModel.update_seconds`: gradient reduction and optimizer
step). Its peak is the
static memory (weights, gradients, optimizer state) plus the largest of: the non-layer
activations + every layer's saved bytes + the head's transient (output layer and loss), and,
for each layer i in order, the embedding's output + the saved bytes of layers 0..i + layer
i's transient (layer i peaks in its forward, when later layers have saved nothing yet, or in
its backward, when they have freed theirs and the head's activations are gone), plus the
communication pool of the micro-batch (each buffer name once, at its largest size over the
strategies used and the non-layer part; released between micro-batches). For a plan
given as counts ``{strategy: n}`` the order is unknown and each transient is bounded by the
whole stack's saved bytes (the peak of the worst order; exact for a stack of one strategy).

``s`` is everywhere either an int (one sequence per row of the micro-batch, a multiple of p)
or a :class:`~megatron_paradyse.parallel.packing.PackShape` (one row, ``b = 1``, of documents
attending inside themselves, padded to a multiple of p as the plugin pads it): the layers'
costs depend on the documents (``packs.py``); the non-layer part, the resident embedding
output and the pool's token-sized buffers on the padded tokens (:func:`as_tokens`).
"""
from __future__ import annotations

from typing import NamedTuple

from ..parallel.packing import PackShape


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
    prefetch: bool = True  # the run's ZeRO weight prefetch (RuntimeOptions.prefetch): the pool's gathered weights

    def layer(self, strategy: str, s, b: int) -> LayerCost:
        """One layer under ``strategy`` at ``s`` (a length or a pack) and ``b``."""
        raise NotImplementedError

    def static_bytes(self) -> float:
        """Weights, gradients and optimizer state on one rank (independent of the batch)."""
        raise NotImplementedError

    def device_kind(self) -> str:
        """``"cuda"`` or ``"cpu"``: the device the predictions are for (the planner's default
        margin depends on it, not on the machine that plans)."""
        return "cpu"

    def nonlayer(self, s: int, b: int) -> LayerCost:
        """Embedding, output layer and loss of one micro-batch, as one term."""
        return LayerCost(0.0, 0.0, 0.0)

    def recomputes(self) -> bool:
        """Whether :meth:`layer` and :meth:`pool` price recomputed plan entries (``tp_sp:rc``)."""
        return False

    def recompute_kinds(self) -> tuple:
        """What :meth:`layer` prices recomputed: ``"layer"`` (``st:rc``), ``"attn"`` (``st:rc-attn``),
        ``"mlp"`` (``st:rc-mlp``); default: the whole layer where :meth:`recomputes`."""
        return ("layer",) if self.recomputes() else ()

    def update_seconds(self) -> float:
        """Seconds of a training step's update after its last backward (gradient reduction,
        optimizer step): once per step, whatever its micro-batches; default: unknown, 0."""
        return 0.0

    def pool(self, strategy: str, s: int, b: int) -> dict:
        """``{buffer name: bytes}`` of the communication pool ``strategy`` (or ``"nonlayer"``)
        allocates in a micro-batch at (s, b); default: none known."""
        return {}

    def pool_bytes(self, strategies, s: int, b: int) -> float:
        """The pool of a micro-batch whose layers use ``strategies`` (and the non-layer part):
        buffers of one name are shared, so each name counts once, at its largest size."""
        return union_bytes([self.pool(n, s, b) for n in list(strategies) + ["nonlayer"]])

    def step(self, plan, s: int, b: int) -> StepCost:
        """Predicted (seconds, peak bytes) of one micro-batch's forward+backward under ``plan``.

        ``plan`` is one strategy name per layer, or a mapping ``{strategy: layer count}``.
        """
        counts = plan_counts(plan)
        n = sum(counts.values())
        if self.num_layers and n != self.num_layers:
            raise ValueError(f"plan has {n} layers, the cost model's model has {self.num_layers}")
        extra = self.nonlayer(s, b)
        costs = {name: self.layer(name, s, b) for name in counts}
        seconds = extra.seconds + sum(k * costs[name].seconds for name, k in counts.items())
        total_saved = sum(k * costs[name].saved_bytes for name, k in counts.items())
        # the output layer and loss run with every layer's activations alive
        peak = extra.saved_bytes + total_saved + extra.transient_bytes
        # the layers run with only the embedding's output of the non-layer activations alive
        # (the head's are made after the last layer's forward and freed before its backward)
        resident = self.resident_bytes(s, b)
        if isinstance(plan, dict):
            # order unknown: bound every layer's transient by the whole stack's saved bytes
            peak = max(peak, resident + total_saved + max(c.transient_bytes for c in costs.values()))
        else:
            # layer i's peak (forward, or backward: layers after i already freed) sits on the
            # saved bytes of layers 0..i
            below = resident
            for name in plan:
                below += costs[name].saved_bytes
                peak = max(peak, below + costs[name].transient_bytes)
        # the pool is released before each micro-batch and allocated by its first use; it is
        # all there in the backward, where the layers peak (a bound for the forward)
        return StepCost(seconds, self.static_bytes() + self.pool_bytes(counts, s, b) + peak)

    def resident_bytes(self, s, b: int) -> float:
        """Non-layer activations alive while the decoder layers run (the embedding's output,
        ``[s/p, b, h]``); default: all non-layer saved bytes (an upper bound)."""
        shape = getattr(self, "shape", None)
        if shape is not None:
            s, b = as_tokens(s, b, shape.p)
            return s * b / shape.p * shape.hidden * shape.elt
        return self.nonlayer(s, b).saved_bytes


def as_tokens(s, b: int, p: int) -> tuple:
    """``(s, b)`` of the rows a micro-batch runs: a pack's padded tokens and b = 1, else as given."""
    if isinstance(s, PackShape):
        return s.padded(p).tokens, 1
    return s, b


def check_length(s, b, p: int) -> None:
    """ValueError unless ``s`` is a length >= 1 divisible by p with b >= 1, or a pack with b = 1."""
    if isinstance(s, PackShape):
        if b != 1:
            raise ValueError(f"a pack is one row of the micro-batch: b must be 1, got b={b}")
        return
    if s < 1 or b < 1 or s % p:
        raise ValueError(f"need s >= 1 divisible by p={p} and b >= 1 (got s={s}, b={b})")


def union_bytes(pools) -> float:
    """Bytes of a pool holding every buffer of ``pools`` (dicts name -> bytes), one per name."""
    out: dict = {}
    for d in pools:
        for k, v in d.items():
            out[k] = max(out.get(k, 0.0), float(v))
    return float(sum(out.values()))


def plan_counts(plan) -> dict:
    """``{strategy: number of layers}`` for a per-layer plan (tuple/list) or a counts mapping."""
    if isinstance(plan, dict):
        return {k: int(v) for k, v in plan.items() if int(v) > 0}
    counts: dict = {}
    for name in plan:
        counts[name] = counts.get(name, 0) + 1
    return counts
