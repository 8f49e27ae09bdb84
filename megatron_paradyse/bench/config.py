"""What one benchmark world runs: :class:`BenchConfig`, checked once, pickled to the ranks."""
from __future__ import annotations

from dataclasses import dataclass

from ..layout import ParallelDims

STATIC = ("tp_sp", "ulysses", "ring", "colossal", "metp")
# "<strategy>+rc": every layer recomputed in backward, every step (plan entries "<strategy>:rc");
# "stock+rc": stock megatron-core with its own --recompute-granularity full --recompute-method
# uniform --recompute-num-layers 1
RECOMPUTED = ("stock+rc",) + tuple(f"{s}+rc" for s in STATIC)
# "<strategy>+rc-mlp": every layer's MLP block recomputed (megatron's selective MLP recompute)
MLP_RECOMPUTED = tuple(f"{s}+rc-mlp" for s in STATIC)
UNPACKED = ("stock",) + STATIC + RECOMPUTED + MLP_RECOMPUTED + ("paradyse_heuristic", "paradyse_optimal")
# "<system>+pack": the same documents packed (THD) up to a token cap; stock's local attention
# refuses packed input, so it has no packed form
PACKED = tuple(f"{s}+pack" for s in UNPACKED if not s.startswith("stock"))
ALL_SYSTEMS = UNPACKED + PACKED
# with pipeline stages (--pp > 1): no packed systems; stock+rc and colossal+rc left out by default
# (selectable with --systems): both keep s x s score tensors that recompute does not remove, so
# they are over any budget the others are compared at, and they are the run's slowest systems
PIPELINE_SYSTEMS = tuple(s for s in UNPACKED if s not in ("stock+rc", "colossal+rc") and s not in MLP_RECOMPUTED)
# with context parallelism (--cp > 1): stock cannot run (megatron's local attention asserts CP = 1;
# its CP needs Transformer Engine), so every static in-node strategy x CP, plain and recomputed,
# against the planners; no packed systems (the CP cost model prices one sequence per row)
CP_SYSTEMS = tuple(s for s in UNPACKED if not s.startswith("stock") and s not in MLP_RECOMPUTED)


@dataclass(frozen=True)
class BenchConfig:
    """The systems, the data and the budget of one measured world.

    ``argv``: ``pretrain_gpt_paradyse.py`` flags of the model (``__main__.demo_argv``);
    ``data_prefix``: an IndexedDataset prefix whose documents, from ``first_sample`` on and no
    shorter than ``min_len``, are the ``steps`` batches; ``budget_bytes``: the per-rank budget
    the planners plan for and the summary judges by; ``cost_model``: a fitted model file (None:
    shipped or analytic); ``margin_bytes``: the planners' margin (None: their default);
    ``search``: also find each system's longest fitting length (``search_*``: its cap, number
    of measured probes and resolution); ``memory_pass``: ``"separate"`` or ``"same"``
    (``world._measure``). ``pp``: pipeline stages (world = ``pp`` x p; ``argv`` carries
    ``--pipeline-model-parallel-size``); with ``pp`` > 1 a step is ``pp_microbatches``
    documents, one micro-batch each, run together under megatron's 1F1B schedule, ``steps``
    counts such steps, and neither ``search`` nor packed systems are available."""

    argv: tuple
    data_prefix: str
    steps: int
    budget_bytes: float
    systems: tuple
    long_docs: str = "skip"
    min_len: int = 1
    first_sample: int = 0
    cost_model: str | None = None
    margin_bytes: float | None = None
    search: bool = False
    search_cap: int = 16384
    search_probes: int = 5
    search_resolution: int = 256
    verbose: bool = True
    memory_pass: str = "separate"
    pack_tokens: int | None = None  # the packed systems' token cap (None: the model's seq_length)
    pp: int = 1
    pp_microbatches: int = 4
    cp: int = 1
    dcp_pool: int = 0  # Dynamic CP (bench/dynamic_cp.py): the pool's nodes; 0: off
    global_batch: int = 1  # with dcp_pool: documents per step
    repeats: int = 1  # with dcp_pool: timed steps per step and system (the median)
    vpp: int = 1                    # model chunks per stage (the interleaved schedule; argv carries it)

    def __post_init__(self):
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "systems", tuple(self.systems))
        if self.dcp_pool:  # its systems' names: bench/dynamic_cp.py checks them
            if self.global_batch < 1 or self.repeats < 1:
                raise ValueError(f"--global-batch and --repeats must be >= 1, got {self.global_batch} and {self.repeats}")
            return
        bad = [s for s in self.systems if s not in ALL_SYSTEMS]
        if bad:
            raise ValueError(f"unknown systems {bad}; choose from {ALL_SYSTEMS}")
        if self.dims.pp_on:
            self._check_pipeline()
        if self.dims.cp_on:
            self._check_context_parallel()

    @property
    def dims(self) -> ParallelDims:
        """The world's layout without its TP size (``argv``'s): ``cp`` x ``pp`` (x p), ``vpp`` chunks."""
        return ParallelDims(cp=self.cp, pp=self.pp, vpp=self.vpp if self.vpp > 1 else None)

    @property
    def documents(self) -> int:
        """Documents the run trains: one per step, or ``pp_microbatches`` per step with stages."""
        if self.dcp_pool:
            return self.steps * self.global_batch
        return self.steps * (self.pp_microbatches if self.dims.pp_on else 1)

    def _check_context_parallel(self) -> None:
        """What context parallelism cannot run here (ValueError naming the flag)."""
        from ..training.dims import check_layout

        check_layout(self.dims, paradyse=True)  # the trainers' layout check
        bad = [s for s in self.systems if s not in CP_SYSTEMS]
        if bad:
            raise ValueError(f"with --cp > 1 these systems cannot run: {bad} (stock megatron's local attention "
                             "refuses CP; the bench runs no packed system under CP); choose from "
                             + ",".join(CP_SYSTEMS))
        if self.search:
            raise ValueError("--max-seq-len-search is not available with --cp > 1")

    def _check_pipeline(self) -> None:
        """What pipeline stages cannot run (ValueError naming the flag)."""
        if self.pp_microbatches < 1:
            raise ValueError(f"--pp-microbatches must be >= 1, got {self.pp_microbatches}")
        packed = [s for s in self.systems if s.endswith("+pack")]
        if packed:
            raise ValueError(f"packed systems are not available with --pp > 1: {packed}")
        if self.search:
            raise ValueError("--max-seq-len-search is not available with --pp > 1 (a step is several "
                             "micro-batches in flight)")
