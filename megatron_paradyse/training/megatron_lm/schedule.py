"""Pipeline stages through Megatron-LM's ``pretrain()``: the schedule's p2p shapes from the
plugin's micro-batches.

With ``--pipeline-model-parallel-size`` above 1 Megatron-LM runs megatron-core's 1F1B
schedule, or with ``--num-layers-per-virtual-pipeline-stage`` (or
``--num-virtual-stages-per-pipeline-rank``) its interleaved one over the model chunks it
built (each chunk's layers keep their global numbers, the plan's keys), with a fixed p2p shape (``--seq-length``); the plugin's micro-batches are cut to
their own lengths, so each transfer has its micro-batch's shape. Megatron-LM's
``get_forward_backward_func`` (in ``megatron.training.training``) is wrapped
(:func:`wrap_get_forward_backward_func`): where the plugin's forward step reads the data, each
schedule call first reads, plans and checks its micro-batches on every stage
(``iterator.prefetch_step``; the first stage reads, ``batches.pipeline_batch`` broadcasts),
sets ``variable_seq_lengths`` on the model's config (Megatron-LM has no flag for it) and
queues the micro-batches' ``[s/p, b, h]`` shapes (``training/p2p_shapes.py``: megatron's shape
exchange is answered from the queue), runs the schedule, and clears the queue. Reading inside
the schedule instead would leave a later stage waiting in its first receive while the first
stage waits in the plan check. Under the interleaved schedule every chunk runs the step's
micro-batches in order: the first chunk through the planned iterator, the others through
copies of the step's list, and the receives are queued in the order megatron's interleaved
schedule makes them (:func:`_plan_step`). Without pipeline stages, or stock, the schedule
runs as is.
"""
from __future__ import annotations

import logging

from .. import p2p_shapes
from ..dims import dims_of

log = logging.getLogger(__name__)
_SAID = [False]


def wrap_get_forward_backward_func(orig):
    """``get_forward_backward_func`` whose schedule, where :func:`planned_pipeline` holds, reads
    the micro-batches ahead and supplies the p2p shapes."""
    def get_forward_backward_func(*args, **kwargs):
        return _wrap_schedule(orig(*args, **kwargs))

    get_forward_backward_func._paradyse = True
    return get_forward_backward_func


def planned_pipeline(forward_step_func) -> bool:
    """Pipeline stages and the plugin's forward step reading the data (``--paradyse``, or no
    stock forward step): the schedule's p2p shapes vary per micro-batch."""
    from megatron.training import get_args

    args = get_args()
    reads = getattr(forward_step_func, "reads_planned", None)
    return dims_of(args).pp_on and reads is not None and reads(args)


def planned_dynamic_cp(forward_step_func) -> bool:
    """Dynamic CP (``--paradyse``): a training step runs its schedule's rounds (``dynamic_cp.py``)."""
    from megatron.training import get_args

    args = get_args()
    reads = getattr(forward_step_func, "reads_planned", None)
    return dims_of(args).dynamic_cp and reads is not None and reads(args) and bool(getattr(args, "paradyse", False))


def _dynamic_cp_step(args, kwargs) -> dict:
    """The schedule call's keywords under Dynamic CP: the groups made (once), and at a training
    step its micro-batches read and planned ahead, ``num_microbatches`` the step's rounds."""
    from megatron.training import get_args

    from .dynamic_cp import ensure_groups
    from .iterator import planned_iterator

    if args:
        raise RuntimeError("ParaDySe with Dynamic CP: Megatron-LM's schedule call must pass its arguments by "
                           "keyword (forward_step_func=, data_iterator=, ...)")
    ensure_groups(get_args())
    if kwargs.get("forward_only"):
        return kwargs  # evaluation: each micro-batch on its own node (c = 1)
    model, data = kwargs["model"], kwargs["data_iterator"]
    model = model[0] if isinstance(model, list) else model
    data = data[0] if isinstance(data, list) else data
    items = planned_iterator(data, model).prefetch()
    return {**kwargs, "num_microbatches": len(items)}


def _wrap_schedule(schedule):
    """The schedule, unchanged unless :func:`planned_pipeline`: then read ahead, queue the
    shapes, run it, clear the queue."""
    def forward_backward(*args, **kwargs):
        if planned_dynamic_cp(kwargs.get("forward_step_func")):
            return schedule(*args, **_dynamic_cp_step(args, kwargs))
        if not planned_pipeline(kwargs.get("forward_step_func")):
            return schedule(*args, **kwargs)
        if args:
            raise RuntimeError("ParaDySe with pipeline stages: Megatron-LM's schedule call must pass "
                               "its arguments by keyword (forward_step_func=, data_iterator=, ...)")
        _plan_step(kwargs)
        try:
            return schedule(**kwargs)
        finally:
            p2p_shapes.clear()

    forward_backward._paradyse = True
    return forward_backward


def _plan_step(kwargs) -> None:
    """Read the call's micro-batches on this stage and queue their p2p shapes. Under the
    interleaved schedule (a list of model chunks) every chunk runs the same micro-batches: the
    first reads them from the planned iterator, each other chunk from a copy of the step's list
    (:class:`ChunkMicroBatches`, in place of Megatron-LM's own iterator of that chunk), and each
    direction's receives are queued in its sender's order (``interleaved_receives``)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config
    from megatron.training import get_args

    from ...costmodel.schedule import interleaved_receives
    from .iterator import prefetch_step

    chunks, data = kwargs["model"], kwargs["data_iterator"]
    chunks = list(chunks) if isinstance(chunks, list) else [chunks]
    first = data[0] if isinstance(data, list) else data
    configs = [get_model_config(c) for c in chunks] + [getattr(kwargs.get("p2p_communicator"), "config", None)]
    for holder in configs:
        if holder is not None:
            holder.variable_seq_lengths = True  # after its checks (0.16 refuses it with dense allgather MoE)
    micro = prefetch_step(first, chunks[0], kwargs["num_microbatches"])
    args = get_args()
    dims = dims_of(args)
    shapes = [p2p_shapes.micro_batch_shape(mb, args.hidden_size, dims) for mb in micro]
    if len(chunks) == 1:
        p2p_shapes.expect(shapes)
        _say(f"{dims.pp} pipeline stages (1F1B)")
        return
    group = configs[0].microbatch_group_size_per_vp_stage or dims.pp
    fwd, bwd = interleaved_receives(parallel_state.get_pipeline_model_parallel_rank(), dims.pp, len(micro),
                                    len(chunks), group, bool(kwargs.get("forward_only", False)))
    p2p_shapes.expect([shapes[j] for j in fwd], [shapes[j] for j in bwd])
    kwargs["data_iterator"] = [first] + [ChunkMicroBatches(micro) for _ in chunks[1:]]
    _say(f"{dims.pp} pipeline stages, interleaved ({len(chunks)} model chunks per stage)")


def _say(schedule: str) -> None:
    if not _SAID[0]:
        _SAID[0] = True
        log.info(" [paradyse] %s: each transfer has its micro-batch's shape, from the micro-batches read "
                 "ahead on every stage", schedule)


class ChunkMicroBatches:
    """A model chunk's iterator under the interleaved schedule (not the first chunk's): the
    step's micro-batches, read, planned and checked through the first chunk's planned
    iterator, in its order. The forward step takes it as is (``providers.py``)."""

    def __init__(self, micro: list):
        self._items = iter(list(micro))

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._items)
