"""Pipeline stages in training: each micro-batch's p2p shape, known before the step, and the
step's sums over the stages.

With varying lengths megatron's pipeline schedule needs ``config.variable_seq_lengths``
(Megatron-LM has no flag for it; the model's config sets it with PP, ``model.py``), and then
exchanges every activation's shape with its peer before sending it
(``P2PCommunicator._communicate_shapes``). The plugin knows every shape before the step's
first transfer: every rank of a data-parallel replica, every stage included, read and agreed
on the step's micro-batches (the iterator's plan check). :func:`expect` queues them; while a
step's queue is there, the shape exchange is answered from it, with no message: forward
receives take the micro-batches' shapes in order, backward receives too (1F1B runs the
backwards in forward order). That skips a round trip per transfer, and the exchange's own
ordering bugs (NVIDIA/Megatron-LM #5100, PP >= 4 with batched p2p; #5271, PP = 2). Without a
queue (stock training, or a schedule run the plugin did not plan) megatron's exchange runs.
"""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from .. import runtime

_NAME = "p2p_shapes"  # the registry's name of the patch (``runtime.py``)


def _state() -> dict:
    """The step's queued shapes per direction, and ``active`` (a step's shapes are queued: its
    receives are answered from them); kept in the registry."""
    state = runtime.cache(_NAME)
    if not state:
        state.update(forward=collections.deque(), backward=collections.deque(), active=False)
    return state


def _queues() -> tuple:
    state = _state()
    return state["forward"], state["backward"]


def activation_shape(seq_length: int, micro_batch: int, hidden: int, tp: int, sequence_parallel: bool) -> list:
    """The ``[s/p, b, h]`` (``[s, b, h]`` without sequence parallelism) tensor a stage sends."""
    return [seq_length // tp if sequence_parallel else seq_length, micro_batch, hidden]


def micro_batch_shape(mb, hidden: int, dims) -> list:
    """:func:`activation_shape` of a micro-batch on this rank of the layout ``dims``
    (``ParallelDims``): its length, or with context parallelism this CP rank's ``s / cp``
    tokens (the data are padded to the layout's divisor, ``2 cp p``); a pack's padded to a
    multiple of p without CP (the first stage pads it, ``dispatch._gpt_forward``). A receive
    buffer of another shape than the peer sends is a hang on NCCL (gloo raises)."""
    s, tp = mb.seq_length, dims.tp
    if dims.cp_on:
        if s % dims.seq_divisor:
            raise ValueError(f"a micro-batch of {s} tokens under CP = {dims.cp} x p = {tp}: the data must "
                             f"be padded to a multiple of {dims.seq_divisor}")
        s //= dims.cp
    elif mb.cu_seqlens is not None:
        s += (-s) % tp
    return activation_shape(s, mb.tokens.shape[0], hidden, tp, dims.sequence_parallel)


def expect(shapes: list, backward: list | None = None) -> None:
    """The step's activation shapes in run order: what this rank's receives will be (forward
    and backward alike under 1F1B); under the interleaved schedule ``backward`` differs
    (``costmodel.schedule.interleaved_receives``: each direction in its sender's order)."""
    install()
    for q, these in zip(_queues(), (shapes, shapes if backward is None else backward)):
        q.clear()
        q.extend(tuple(int(x) for x in s) for s in these)
    _state()["active"] = True


def clear() -> None:
    """Forget the step's shapes (megatron's exchange answers until the next :func:`expect`)."""
    for q in _queues():
        q.clear()
    _state()["active"] = False


def pending() -> dict:
    """Shapes not yet received, per direction (a finished step leaves none)."""
    fwd, bwd = _queues()
    return {"forward": list(fwd), "backward": list(bwd)}


def _communicator():
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    return P2PCommunicator


def install() -> None:
    """Answer megatron's p2p shape exchange from the queues; idempotent."""
    runtime.install(_NAME, runtime.Patch(_communicator(), "_communicate_shapes", _communicate_shapes))


def uninstall() -> None:
    if runtime.restore(_NAME):
        clear()


def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    if not _state()["active"]:
        stock = runtime.original(_NAME, _communicator(), "_communicate_shapes")
        return stock(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)
    fwd, bwd = _queues()
    if (recv_prev and not fwd) or (recv_next and not bwd):
        # the peer answers from its queue too: falling back to the exchange would hang it
        raise RuntimeError("ParaDySe: the pipeline received more activations than the step's "
                           "micro-batches (training/p2p_shapes.py expect); the schedule ran micro-batches "
                           "the planned iterator did not give it")
    prev = list(fwd.popleft()) if recv_prev else [0, 0, 0]
    nxt = list(bwd.popleft()) if recv_next else [0, 0, 0]
    return prev, nxt


def sum_over_stages(values: torch.Tensor, device) -> torch.Tensor:
    """``values`` summed over this rank's pipeline group (only the last stage has losses)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    t = values.to(device)
    dist.all_reduce(t, group=parallel_state.get_pipeline_model_parallel_group())
    return t.cpu()
