"""A pipeline planner as the data side asks a planner of one micro-batch (``MicroBatchView``)."""
from __future__ import annotations

from .core import PlanChoice
from .stages import PipelinePlanner


class MicroBatchView:
    """A pipeline planner as the data side asks a planner (the sampler's cost, the packing
    scheduler's cost and fit, the longest trainable length): a micro-batch fits when it fits
    each stage alone, and costs its slowest stage's seconds (the pipeline's rate at steady state)."""

    def __init__(self, pipeline_planner: PipelinePlanner):
        self.pipeline = pipeline_planner
        self.stages = pipeline_planner.stages
        self.kind = pipeline_planner.kind
        self.budget, self.margin = pipeline_planner.budget, pipeline_planner.margin
        self.refinement = None  # with pipeline stages each stage planner has its own (``pipeline.refinements``)

    def choose(self, seq_len, micro_batch: int) -> PlanChoice:
        """The slowest stage's choice, ``fits`` when every stage fits the micro-batch alone."""
        choices = [st.choose(seq_len, micro_batch) for st in self.stages]
        worst = max(choices, key=lambda c: c.seconds)
        return worst._replace(fits=all(c.fits for c in choices))

    def longest_fit(self, micro_batch: int, multiple: int = 1, upper: int | None = None) -> int:
        """The longest length every stage fits alone (``Planner.longest_fit`` per stage)."""
        return min(st.longest_fit(micro_batch, multiple=multiple, upper=upper) for st in self.stages)

    def no_fit_message(self, s, b: int) -> str:
        """The first stage that does not fit ``(s, b)`` alone, with its message."""
        for r, st in enumerate(self.stages):
            if not st.choose(s, b).fits:
                return f"pipeline stage {r} of {len(self.stages)}: {st.no_fit_message(s, b)}"
        return f"every stage fits {s} tokens alone"
