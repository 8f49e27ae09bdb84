"""Activation recomputation that re-runs the plan of the forward, whatever plan is set later.

megatron's ``CheckpointFunction`` keeps a layer's input, runs the layer without saving
activations, and runs it again inside the backward. The strategies read their names from
module attributes (``set_plan``), and ``set_plan`` may change them between a micro-batch's
forward and its backward (pipeline schedules run the forwards of later micro-batches first).
So every checkpointed function records, in its first run, the plan entries it reads, and its
re-runs read those instead of the attributes:

* :func:`checkpoint` replaces megatron's ``tensor_parallel.checkpoint`` while the plugin is
  installed (megatron's full recompute in ``TransformerBlock``, selective ``mlp`` recompute in
  ``TransformerLayer``): the function handed to megatron is wrapped in a :class:`Replayed`;
* a plan entry with ``:rc`` checkpoints its whole layer the same way (:func:`layer_forward`),
  unless the layer already runs inside a checkpoint (megatron's own full recompute covers it);
  ``:rc-attn`` / ``:rc-mlp`` checkpoint only the layer's attention or MLP block
  (:func:`block_forward`: megatron's ``_forward_attention`` / ``_forward_mlp``);
* a checkpoint inside a checkpoint just runs its function (each module runs twice at most).

RNG states are saved and restored by megatron's ``CheckpointFunction`` itself (CPU, CUDA and
its tracker), as for stock megatron.
"""
from __future__ import annotations

import threading

from .. import runtime

_STATE = threading.local()
RC_ATTR = "_paradyse_recompute"


def _frames() -> list:
    frames = getattr(_STATE, "frames", None)
    if frames is None:
        frames = _STATE.frames = []
    return frames


def lookup(module, attr: str):
    """``getattr(module, attr, None)`` as the innermost replayed checkpoint recorded it, else as
    set now; recorded into every checkpoint being run for the first time."""
    frames = _frames()
    value, found = None, False
    for frame in reversed(frames):
        if frame.replay and (module, attr) in frame.seen:
            value, found = frame.seen[(module, attr)], True
            break
    if not found:
        value = getattr(module, attr, None)
    for frame in frames:
        if not frame.replay:
            frame.seen.setdefault((module, attr), value)
    return value


def inside_checkpoint() -> bool:
    """Whether a checkpointed function is running (its first run or a recompute)."""
    return bool(_frames())


class _Frame:
    __slots__ = ("replay", "seen")

    def __init__(self, replay: bool, seen: dict):
        self.replay, self.seen = replay, seen


class Replayed:
    """``function`` whose first call records the plan entries it reads and whose later calls
    (megatron's recompute in backward) read the recorded ones."""

    def __init__(self, function):
        self.function, self.seen = function, None

    def __call__(self, *args, **kwargs):
        replay = self.seen is not None
        frame = _Frame(replay, self.seen if replay else {})
        frames = _frames()
        frames.append(frame)
        try:
            out = self.function(*args, **kwargs)
        finally:
            frames.pop()
        if not replay:
            self.seen = frame.seen
        return out


_NAME = "recompute"  # the registry's name of the patch (``runtime.py``)


def _modules() -> tuple:
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random

    return tensor_parallel, tp_random


def checkpoint(function, distribute_saved_activations, *args):
    """megatron's ``tensor_parallel.checkpoint`` with ``function`` replaying its forward's plan.

    Inside another checkpoint (megatron's selective ``mlp`` inside a layer planned ``:rc``) the
    function just runs: the outer checkpoint saves nothing in its first run, and its recompute's
    activations are used at once by its backward, so a second checkpoint would only run the
    module a third time."""
    if inside_checkpoint():
        return function(*args)
    stock = runtime.original(_NAME, _modules()[1], "checkpoint")
    return stock(Replayed(function), distribute_saved_activations, *args)


def install() -> None:
    """Route megatron's ``tensor_parallel.checkpoint`` through :func:`checkpoint`; idempotent."""
    tensor_parallel, tp_random = _modules()
    runtime.install(_NAME, runtime.Patch(tp_random, "checkpoint", checkpoint),
                    runtime.Patch(tensor_parallel, "checkpoint", checkpoint))


def uninstall() -> None:
    runtime.restore(_NAME)


def layer_forward(original, layer, args, kwargs):
    """``TransformerLayer.forward`` of ``layer``: checkpointed when its plan entry says ``:rc``
    (training with gradients, not already inside a checkpoint), else as megatron runs it.

    The layer's input is megatron's ``hidden_states``, given to the checkpoint; the other
    arguments (RoPE table, pack boundaries, masks) need no gradient and are kept as they are.
    """
    return _checkpointed(original, layer, "layer", args, kwargs)


def block_forward(original, layer, block: str, args, kwargs):
    """``TransformerLayer._forward_attention`` (``block`` "attn": input norm, attention, residual
    add) or ``_forward_mlp`` ("mlp": pre-MLP norm, MLP, residual add) of ``layer``: checkpointed
    (megatron's checkpoint function, replaying the forward's plan) when its plan entry says
    ``:rc-attn`` / ``:rc-mlp``, else as megatron runs it. The block's input hidden states are what
    the checkpoint keeps."""
    return _checkpointed(original, layer, block, args, kwargs)


def _checkpointed(original, layer, what: str, args, kwargs):
    import torch

    if not (lookup(layer, RC_ATTR) == what and layer.training and torch.is_grad_enabled()
            and not inside_checkpoint()):
        return original(layer, *args, **kwargs)
    if args:
        hidden, rest = args[0], args[1:]
    else:
        kwargs = dict(kwargs)
        hidden, rest = kwargs.pop("hidden_states"), ()

    def run(hidden_states):
        return original(layer, hidden_states, *rest, **kwargs)

    return checkpoint(run, False, hidden)
