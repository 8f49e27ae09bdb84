"""Prefetched ZeRO weight gathers: the next gather in flight while the current linear computes.

The ZeRO strategies (``ulysses``, ``ring``, ``colossal``) rebuild each linear's weight from its
TP shards in forward and again in backward (``strategies/zero3.py``). With prefetch on (the
default), a ZeRO linear, once it holds its own weight and before it computes, posts the async
all-gather of the *next* ZeRO linear's weight on the weight communicator (``groups.py``), and
the next linear waits on it where it uses it. So the gather of a layer's projection runs under
its attention core, fc1's under the projection, fc2's under fc1, and the next layer's QKV under
fc2; backward runs the reverse chain (fc2, fc1, projection, QKV, then the previous layer's fc2).

What "next" is comes from the micro-batch's plan, read when the linear runs its forward
(backward's successors are recorded then, so a later micro-batch's plan never steers them):
inside a layer always; across a layer boundary only when the neighbouring layer on this
pipeline stage also runs a ZeRO strategy, and not with recomputation there (megatron's
``recompute_granularity``, a ``:rc`` entry, or inside a recompute), whose backward begins
with a forward. A gather that nobody takes is waited for and dropped, never read.

Memory: the gathered weights alternate between two pool slots by role (``weight0_0``: QKV and
fc1; ``weight0_1``: projection and fc2), so the one in use is never the one being written and
at most one extra gathered weight is held: the larger of the projection and fc2 (and its
staged row-parallel shard, ``weight0_1_in``). Off, every gather is blocking into ``weight0_0``
as before; so at p = 1, where a gather is a copy with nothing to overlap. The cost model prices both (``costmodel.analytic.zero_weight_pool``).

Switch: the runtime options' ``prefetch`` (``runtime.RuntimeOptions``, built by the trainers
from ``--paradyse-no-prefetch``); :func:`enabled` reads it, :func:`set_enabled` and the context
manager :func:`disabled` change it. Toggle between passes, not inside one.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import torch

from .. import runtime
from . import buffers, collectives, groups
from .buffers import weight_slot

TRACE: list | None = None  # a list to record ("issue" | "wait" | "gather" | "drop" | "use", shard)


class Target(NamedTuple):
    """One ZeRO weight to gather: the stock shard, its TP dim, the switching group and its role
    (0: ``linear_qkv`` / ``linear_fc1``, 1: ``linear_proj`` / ``linear_fc2``)."""

    shard: torch.Tensor
    shard_dim: int
    group: object
    role: int

    @property
    def slot(self) -> str:
        return weight_slot(0, self.role if enabled() else 0)

    def key(self) -> tuple:
        return self.shard.data_ptr(), tuple(self.shard.shape), self.shard_dim


class _Gather(NamedTuple):
    key: tuple
    version: int
    out: torch.Tensor


def enabled() -> bool:
    """Whether ZeRO weight gathers are prefetched (the default): the runtime options' ``prefetch``."""
    return runtime.options().prefetch


def set_enabled(on: bool) -> None:
    """Turn prefetch on or off (any gather in flight is waited for first)."""
    buffers.settle_all()
    runtime.set_options(dataclasses.replace(runtime.options(), prefetch=bool(on)))


@contextlib.contextmanager
def disabled():
    """``with prefetch.disabled(): ...``: every ZeRO gather blocking, as without prefetch."""
    before = enabled()
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(before)


def weight(target: Target, then: Target | None = None) -> torch.Tensor:
    """``target``'s gathered weight (its prefetch waited on, else gathered now), after posting
    the gather of ``then`` (the next ZeRO weight) when prefetch is on."""
    w = _take(target)
    if then is not None and enabled():
        issue(then, busy=target.slot)
    _trace("use", target)
    return w


def _take(target: Target) -> torch.Tensor:
    got = buffers.settle(target.slot)
    if isinstance(got, _Gather):
        if got.key == target.key() and got.version == target.shard._version:
            _trace("wait", target)
            return got.out
        _trace("drop", target)
    _trace("gather", target)
    return collectives.gather_shards(target.shard, target.shard_dim, groups.weight_group(target.group),
                                     target.slot)


def issue(target: Target, busy: str) -> None:
    """Post ``target``'s gather into its slot, which must not be ``busy`` (the weight in use)."""
    if target.slot == busy:
        raise RuntimeError(f"prefetch of a weight into pool slot {busy}, which holds the weight in use")
    out, work = collectives.gather_shards(target.shard, target.shard_dim, groups.weight_group(target.group),
                                          target.slot, async_op=True)
    buffers.post_write(target.slot, work, _Gather(target.key(), target.shard._version, out))
    _trace("issue", target)


def _trace(event: str, target: Target) -> None:
    if TRACE is not None:
        TRACE.append((event, target.shard))


# ---------------------------------------------------------------------------------------------
# a layer's neighbours, for the hints across a layer boundary

_LINKS = "_paradyse_links"


class ModuleLinks(NamedTuple):
    """A decoder layer's attention or MLP: the other module of its layer and the neighbouring
    layer in the direction its hint crosses (attention: the previous layer, MLP: the next)."""

    sibling: object
    neighbour: object


def link(layers) -> None:
    """Link each layer's attention and MLP to their neighbours on this pipeline stage (plain
    attributes, not submodules: the modules' parameters and checkpoints are unchanged)."""
    layers = list(layers)
    for i, layer in enumerate(layers):
        prev = layers[i - 1] if i > 0 else None
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        object.__setattr__(layer.self_attention, _LINKS, ModuleLinks(layer.mlp, prev))
        object.__setattr__(layer.mlp, _LINKS, ModuleLinks(layer.self_attention, nxt))


def links(module) -> ModuleLinks:
    """The :class:`ModuleLinks` of a decoder layer's attention or MLP (no neighbours if unlinked)."""
    return getattr(module, _LINKS, None) or ModuleLinks(None, None)
