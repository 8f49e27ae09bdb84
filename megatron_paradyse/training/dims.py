"""The parallel layout from the command line: the one builder (:func:`dims_from_args`) and the
one validator (:func:`check_layout`, :func:`check_pad_multiple`) of the layout flags, for both
trainers (``arguments.validate_args``, ``megatron_lm.check_paradyse_args``) and the bench.

Each raises :class:`LayoutError` (a ``ValueError``) with one line naming the flags; each
trainer maps it to its own error (``ArgumentError`` in ``pretrain_gpt_paradyse.py``'s parser,
the ``ValueError`` Megatron-LM's entry point turns into one line). The built
:class:`~megatron_paradyse.layout.ParallelDims` is attached to the parsed flags once
(:func:`attach`; :func:`dims_of` reads it back); below ``training/`` the code gets it as a
parameter.
"""
from __future__ import annotations

from ..layout import DataConfig, ParallelDims
from ..runtime import RuntimeOptions


class LayoutError(ValueError):
    """A parallel layout the flags ask for that cannot run (one line, naming the flags)."""


# the flags that select the interleaved (virtual-pipeline) schedule, as each trainer spells
# them (Megatron-LM's validate_args turns each into args.virtual_pipeline_model_parallel_size)
VIRTUAL_PIPELINE_FLAGS = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                          "pipeline_model_parallel_layout", "virtual_pipeline_model_parallel_size")


def _size(args, name: str) -> int:
    return int(getattr(args, name, 1) or 1)


def dims_from_args(args, world_size: int | None = None) -> ParallelDims:
    """The :class:`ParallelDims` of the parsed flags (either trainer's ``args``) in a world of
    ``world_size`` ranks (default ``args.world_size``; without either, the data-parallel size
    Megatron-LM computed, else 1). :class:`LayoutError` when TP x PP x CP does not divide it."""
    tp = _size(args, "tensor_model_parallel_size")
    pp = _size(args, "pipeline_model_parallel_size")
    cp = _size(args, "context_parallel_size")
    if world_size is None:
        world_size = getattr(args, "world_size", None)
    if world_size is None:
        world_size = tp * pp * cp * _size(args, "data_parallel_size")
    if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp):
        raise LayoutError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                          f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp}")
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    dynamic = bool(getattr(args, "dynamic_context_parallel", False) or getattr(args, "hybrid_context_parallel", False))
    dp = world_size // (tp * pp * cp)
    if dynamic:  # Dynamic CP: the DP x CP pool is megatron's DP, each micro-batch's CP group chosen per micro-batch
        dp, cp = dp * cp, 1
    return ParallelDims(
        tp=tp, cp=cp, pp=pp, dp=dp, vpp=int(vpp) if vpp else None,
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        cp_comm_type=getattr(args, "cp_comm_type", None) or ("p2p",),
        hierarchical_cp=getattr(args, "hierarchical_context_parallel_sizes", None) or (),
        dynamic_cp=dynamic, dcp_min_size=int(getattr(args, "min_dynamic_context_parallel_size", 1) or 1))


# Megatron-LM pickles its args into every checkpoint and loads them with torch's weights-only
# unpickler, which refuses classes it was not told of (a stock run loading the checkpoint would
# fail): its namespace keeps no ParallelDims; the layout is kept here, by the namespace's id
_KEPT: dict = {}


def attach(args, dims: ParallelDims, in_namespace: bool = True) -> ParallelDims:
    """Attach ``dims`` to the parsed flags ``args``: as ``args.paradyse_dims``
    (``pretrain_gpt_paradyse.py``'s, the bench's), or with ``in_namespace=False`` beside it
    (Megatron-LM's, which its checkpoints pickle)."""
    if in_namespace:
        args.paradyse_dims = dims
    else:
        _KEPT[id(args)] = (args, dims)
    return dims


def dims_of(args) -> ParallelDims:
    """The layout :func:`attach` attached at the edge; built from ``args`` (and attached beside
    it) where no edge ran, e.g. a script that calls Megatron-LM's hooks directly."""
    dims = getattr(args, "paradyse_dims", None)
    if dims is not None:
        return dims
    kept = _KEPT.get(id(args))
    if kept is not None and kept[0] is args:
        return kept[1]
    return attach(args, dims_from_args(args), in_namespace=False)


def interleaving_flag(args) -> str | None:
    """The first interleaved-schedule flag given (``--flag-name``), else None."""
    given = [k for k in VIRTUAL_PIPELINE_FLAGS if getattr(args, k, None) is not None]
    return "--" + given[0].replace("_", "-") if given else None


def check_layout(dims: ParallelDims, *, paradyse: bool, seq_length: int | None = None,
                 interleaving: str | None = None, pack: str = "none", plan_given: bool = True,
                 cp_links: str | None = None, dynamic_cp_runs: bool = False, per_token_loss: bool = True,
                 max_seqlen: int | None = None, interleaved: bool = False) -> None:
    """What the plugin can run of ``dims`` (both trainers, the bench): megatron's 1F1B schedule
    (``interleaving``: the flag that selects the interleaved one, refused unless ``interleaved``); ``--paradyse`` keeps
    the sequence-parallel layout with TP; context parallelism only with ``--paradyse``, one K/V
    ring ('p2p') over one level of CP ranks, pipeline stages at the run's CP size, links the planner knows (``cp_links``), sequences (``seq_length``) in
    2 x CP x TP equal pieces (``pack`` and ``plan_given`` are not checked for a fixed C: the
    planner prices packs under CP); Dynamic CP where the trainer runs it (``dynamic_cp_runs``,
    :func:`_check_dynamic_cp`). ``interleaved``: the trainer runs the interleaved schedule too
    (``pretrain_gpt_paradyse.py``; it checks the rest itself). :class:`LayoutError` naming the flag."""
    if not interleaved and (interleaving is not None or dims.vpp is not None):
        flag = interleaving or "--" + VIRTUAL_PIPELINE_FLAGS[0].replace("_", "-")
        raise LayoutError(f"{flag} selects the interleaved (virtual-pipeline) schedule, which is not supported "
                          f"here: only megatron's 1F1B schedule (one stage per pipeline rank) is supported with "
                          f"--pipeline-model-parallel-size (drop {flag}; pretrain_gpt_paradyse.py runs the "
                          "interleaved schedule: docs/pipeline.md)")
    if paradyse and dims.tp > 1 and not dims.sequence_parallel:
        raise LayoutError("--paradyse needs --sequence-parallel: every strategy keeps the "
                          "[s/p, b, h] sequence-parallel layout between layers")
    if dims.dynamic_cp:
        _check_dynamic_cp(dims, paradyse, dynamic_cp_runs, per_token_loss, max_seqlen, pack)
    if dims.cp_on:
        _check_context_parallel(dims, paradyse, seq_length, cp_links)


def _check_dynamic_cp(dims, paradyse, runs, per_token_loss, max_seqlen, pack) -> None:
    """``--dynamic-context-parallel`` (Megatron-LM's ``--hybrid-context-parallel`` too): each
    micro-batch on a power-of-two group of nodes of the DP x CP pool (``parallel/dynamic_cp.py``),
    in the plugin's trainer, with the per-token loss, without pipeline stages."""
    flag = "--dynamic-context-parallel"
    if not runs:
        raise LayoutError(f"{flag} / --hybrid-context-parallel is not supported here (pretrain_gpt_paradyse.py and "
                          "Megatron-LM's pretrain_gpt.py through megatron_paradyse.training.megatron_lm run it): drop the flag")
    if not paradyse:
        raise LayoutError(f"{flag} needs --paradyse: stock megatron-core runs Dynamic CP only with Transformer "
                          "Engine's attention, and this trainer builds the local layer spec")
    if dims.pp_on:
        raise LayoutError(f"{flag} with --pipeline-model-parallel-size {dims.pp} is not supported (Dynamic CP runs "
                          "without pipeline stages, as in megatron)")
    if not per_token_loss:
        raise LayoutError(f"{flag} needs --calculate-per-token-loss (as megatron's Dynamic CP does): each token's "
                          "loss is counted once, on the CP ranks that ran it")
    pool, low = dims.dp, dims.dcp_min_size
    if pool & (pool - 1):
        raise LayoutError(f"{flag}: the pool of DP x CP = {pool} nodes (world / TP) must be a power of two")
    if low < 1 or low & (low - 1) or low > pool:
        raise LayoutError(f"--min-dynamic-context-parallel-size {low} must be a power of two from 1 to the pool "
                          f"of DP x CP = {pool} nodes")
    if max_seqlen is not None and (max_seqlen < 1 or max_seqlen % dims.tp):
        raise LayoutError(f"--max-seqlen-per-dp-cp-rank {max_seqlen} must be a positive multiple of "
                          f"--tensor-model-parallel-size {dims.tp}")
    if any(c != "p2p" for c in dims.cp_comm_type):
        raise LayoutError(f"--cp-comm-type {' '.join(dims.cp_comm_type)}: with {flag} every strategy passes K/V on "
                          "a ring over the micro-batch's CP group (megatron's p2p); give --cp-comm-type p2p")
    if dims.hierarchical_cp:
        raise LayoutError(f"--hierarchical-context-parallel-sizes is not supported with {flag} (drop the flag)")
    if pack != "none":
        raise LayoutError(f"--paradyse-pack with {flag}: Dynamic CP packs each step's documents itself (drop "
                          "--paradyse-pack)")


def _check_context_parallel(dims, paradyse, seq_length, cp_links) -> None:
    """``--context-parallel-size C > 1``: every strategy attends across the CP ranks itself
    (megatron's local attention cannot; stock megatron runs CP only with Transformer Engine's
    attention), with K/V on a ring, one CP level, 2 x C x TP pieces; with pipeline stages too
    (each stage's layers at CP = C, the p2p tensors of s / C tokens per CP rank)."""
    cp = dims.cp
    if not paradyse:
        raise LayoutError(f"--context-parallel-size {cp} needs --paradyse: stock megatron-core runs context "
                          "parallelism only with Transformer Engine's attention, and this trainer builds the local "
                          "layer spec (give --paradyse, or drop the flag)")
    if any(c != "p2p" for c in dims.cp_comm_type):
        raise LayoutError(f"--cp-comm-type {' '.join(dims.cp_comm_type)}: with --paradyse every strategy passes "
                          "K/V on a ring over the CP group (megatron's p2p); give --cp-comm-type p2p or leave "
                          "the flag out")
    if dims.hierarchical_cp:
        raise LayoutError("--hierarchical-context-parallel-sizes is not supported with --paradyse: one CP ring "
                          "across nodes (drop the flag)")
    if cp_links is not None:
        check_cp_links(cp_links)
    unit = dims.seq_divisor
    if seq_length is not None and seq_length % unit:
        raise LayoutError(f"--seq-length {seq_length} must be a multiple of 2 x --context-parallel-size x "
                          f"--tensor-model-parallel-size = {unit} with --paradyse: each CP rank holds two "
                          "equal chunks, each split over TP")


def check_cp_links(value: str) -> None:
    """``--paradyse-cp-links INTRA,INTER``: two link classes the CP cost model knows."""
    from ..costmodel.cp import Links

    names = value.split(",")
    if len(names) != 2:
        raise LayoutError(f"--paradyse-cp-links {value!r}: give two names, INTRA,INTER (e.g. nvlink4,ib_ndr)")
    try:
        Links.from_config(*names)
    except ValueError as e:
        raise LayoutError(f"--paradyse-cp-links: {e}") from None


def check_pad_multiple(dims: ParallelDims, multiple: int) -> None:
    """``--paradyse-pad-multiple``: a positive multiple of the layout's divisor where the
    sequence is split (sequence parallelism or CP), else any positive number."""
    unit = dims.seq_divisor if (dims.sequence_parallel or dims.cp_on) else 1
    if multiple < 1 or multiple % unit:
        what = f"2 x CP x TP = {unit}" if dims.cp_on else f"TP {dims.tp}"
        raise LayoutError(f"--paradyse-pad-multiple {multiple} must be a positive multiple of {what}")


def default_pad_multiple(dims: ParallelDims, paradyse: bool) -> int:
    """The multiple micro-batches are padded to by default: the layout's divisor where the
    sequence is split (sequence parallelism, ``--paradyse``'s layout, CP), else 1."""
    return dims.seq_divisor if (dims.sequence_parallel or paradyse or dims.cp_on) else 1


def data_config(args) -> DataConfig:
    """The :class:`~megatron_paradyse.layout.DataConfig` of ``pretrain_gpt_paradyse.py``'s
    validated flags (``--mock-data`` or one ``--data-path`` prefix, ``--paradyse-pad-multiple``
    completed, ``--paradyse-pack*``)."""
    paths = list(args.data_path or []) if not args.mock_data else []
    if not args.mock_data and len(paths) != 1:
        raise ValueError(f"--data-path: give one IndexedDataset prefix, got {paths}")
    return DataConfig(seq_length=args.seq_length, vocab_size=args.vocab_size, seed=args.seed,
                      data_path=paths[0] if paths else None, mock_min_length=args.paradyse_mock_min_length,
                      long_docs=args.paradyse_long_docs, pad_multiple=args.paradyse_pad_multiple,
                      pack=args.paradyse_pack, pack_tokens=args.paradyse_pack_tokens,
                      split=getattr(args, "split", None) or "969, 30, 1")


def runtime_options(args) -> RuntimeOptions:
    """The run's :class:`~megatron_paradyse.runtime.RuntimeOptions` from either trainer's flags
    (``--paradyse-no-prefetch``; Megatron-LM's ``--deterministic-mode`` where given)."""
    deterministic = getattr(args, "deterministic_mode", None)
    return RuntimeOptions(prefetch=not getattr(args, "paradyse_no_prefetch", False),
                          deterministic=True if deterministic else None)
