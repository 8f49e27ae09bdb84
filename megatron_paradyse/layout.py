"""The run's parallel layout and the typed settings the trainers hand below ``training/``.

:class:`ParallelDims` is the one typed form of the parallel sizes (TP, CP, PP, DP and the
flags that shape the layout). It is built and checked once, at the edge, from the command
line (``training/dims.py``: ``dims_from_args`` and ``check_layout``, for both trainers and
the bench); everything after reads it, never the flags. Its derived units answer the
questions the code asks of the layout: the sequence divisor (:attr:`ParallelDims.seq_divisor`),
whether context parallelism or pipeline stages are on.

:class:`DataConfig` is what the dataset builder needs of the data flags.
"""
from __future__ import annotations

from dataclasses import dataclass


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ParallelDims.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class ParallelDims:
    """The parallel sizes of a run: ``tp`` x ``cp`` x ``pp`` x ``dp`` ranks.

    ``vpp``: virtual pipeline stages per rank (the interleaved schedule; None for one stage
    per rank); ``sequence_parallel``: megatron's sequence parallelism (only with ``tp`` > 1);
    ``cp_comm_type``: megatron's CP exchange per level (``("p2p",)`` is a K/V ring);
    ``hierarchical_cp``: megatron's CP sizes per level (empty: one level); ``dynamic_cp``:
    megatron's Dynamic (hybrid) CP, each micro-batch on a power-of-two group of nodes of the
    DP x CP pool, at least ``dcp_min_size`` (the pool is then ``dp``, with ``cp`` 1: megatron's
    parallel state and the model are built without a fixed CP)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    cp_comm_type: tuple = ("p2p",)
    hierarchical_cp: tuple = ()
    dynamic_cp: bool = False
    dcp_min_size: int = 1

    def __post_init__(self):
        for name in ("tp", "cp", "pp", "dp"):
            _positive(name, getattr(self, name))
        if self.vpp is not None:
            _positive("vpp", self.vpp)
        comm = self.cp_comm_type
        comm = (comm,) if isinstance(comm, str) else tuple(comm or ("p2p",))
        object.__setattr__(self, "cp_comm_type", comm)
        object.__setattr__(self, "hierarchical_cp", tuple(self.hierarchical_cp or ()))
        object.__setattr__(self, "sequence_parallel", bool(self.sequence_parallel and self.tp > 1))
        object.__setattr__(self, "dynamic_cp", bool(self.dynamic_cp))

    @property
    def world(self) -> int:
        """Ranks of the run."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def cp_on(self) -> bool:
        """Context parallelism: each sequence split over ``cp`` ranks."""
        return self.cp > 1

    @property
    def pp_on(self) -> bool:
        """Pipeline stages (megatron's 1F1B schedule)."""
        return self.pp > 1

    @property
    def dp_cp(self) -> int:
        """Ranks a gradient is reduced over (data x context parallel)."""
        return self.dp * self.cp

    @property
    def seq_divisor(self) -> int:
        """What every micro-batch's length must be a multiple of: TP, or with context
        parallelism 2 x CP x TP (each CP rank holds two equal chunks, each split over TP)."""
        return 2 * self.cp * self.tp if self.cp_on else self.tp

    def describe(self) -> str:
        """``TP=2 x PP=1 x CP=2 x DP=1`` (CP only when on)."""
        cp = f"CP={self.cp} x " if self.cp_on else ""
        dynamic = " (Dynamic CP over the DP ranks)" if self.dynamic_cp else ""
        return f"TP={self.tp} x PP={self.pp} x {cp}DP={self.dp}{dynamic}"


@dataclass(frozen=True)
class DataConfig:
    """What the dataset builder needs of the data flags: the source (``data_path``, an
    IndexedDataset prefix, or None for synthetic documents of ``mock_min_length`` ..
    ``seq_length`` tokens) and its train/validation/test ``split`` (megatron-core's
    proportions of the documents), the longest sequence, the vocabulary, the seed and the policy for
    documents longer than ``seq_length`` (``long_docs``); the multiple micro-batches are padded
    to (``pad_multiple``) and packing (``pack``: ``"none"``, ``"greedy"``, ``"balanced"``;
    ``pack_tokens``: a pack's token cap)."""

    seq_length: int
    vocab_size: int
    seed: int = 1234
    data_path: str | None = None
    mock_min_length: int = 16
    long_docs: str = "split"
    pad_multiple: int = 1
    pack: str = "none"
    pack_tokens: int | None = None
    split: str = "969, 30, 1"

    @property
    def mock(self) -> bool:
        """Synthetic documents (``--mock-data``)."""
        return self.data_path is None

    @property
    def packed(self) -> bool:
        return self.pack != "none"
