"""The weight communicator: a second process group with the switching group's ranks.

Weight traffic (the ZeRO strategies' weight gathers, prefetched ahead of their use by
``prefetch.py``, and METP's head-group broadcasts) is posted while the layer's other
collectives run on the switching group (Ulysses' all-to-alls, ring hops). NCCL runs the
collectives of one communicator one after the other, so weight traffic gets a communicator of
its own: the *twin* of each tensor-parallel group, created once, by every rank of the world,
in the same order (:func:`create`). That happens when megatron's parallel state is initialised
while the plugin is installed (:func:`install` wraps ``initialize_model_parallel``), or at
``install()`` if it already is: never inside a layer, where a pipeline stage's ranks alone arrive.
Right after, every group's communicator is created (``communicators.create_all``), before the
planner measures the memory budget.

A group without a twin (a world of torch's fake backend, a group megatron did not make, a
size-1 group) carries its own weight traffic (:func:`weight_group`): correct, not overlapped.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .. import runtime
from ..device import current as current_device
from . import communicators

_STATE = {"world": None, "twins": {}, "created": None, "host": None}  # twins: tuple of global ranks -> group
# (None: not a member); created: communicators.create_all's report of the last initialisation;
# host: a gloo group over the world under NCCL (host_group)
_NAME = "groups"  # the registry's name of the patch (``runtime.py``)


def weight_group(group):
    """The twin of ``group`` (same ranks, same order, its own communicator), else ``group``."""
    if group is None or _STATE["world"] is not _world():
        return group
    return _STATE["twins"].get(tuple(dist.get_process_group_ranks(group))) or group


def create() -> None:
    """Create the twin of every tensor-parallel group not twinned yet (collective over the world:
    every rank calls it at the same point; megatron's parallel state must be initialised)."""
    from megatron.core import parallel_state

    if not dist.is_initialized() or "fake" in str(dist.get_backend()):
        return
    if not parallel_state.model_parallel_is_initialized():
        return
    if _STATE["world"] is not _world():
        _STATE.update(world=_world(), twins={}, host=None)
        if dist.get_backend() == "nccl":  # every rank, at the same point
            _STATE["host"] = dist.new_group(backend="gloo")
    mine = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    for ranks in _all_groups(mine):
        if ranks in _STATE["twins"] or len(ranks) < 2:
            continue
        group = dist.new_group(list(ranks))  # every rank, members or not, in the same order
        member = dist.get_rank() in ranks
        _STATE["twins"][ranks] = group if member and dist.get_process_group_ranks(group) == list(ranks) else None


def _all_groups(mine: list) -> list:
    """Every rank's tensor-parallel group (tuples of global ranks), sorted: one all-gather."""
    mine_t = torch.tensor(mine, dtype=torch.long, device=current_device())
    out = torch.empty(dist.get_world_size() * len(mine), dtype=torch.long, device=mine_t.device)
    dist.all_gather_into_tensor(out, mine_t)
    rows = out.view(-1, len(mine)).tolist()
    return sorted({tuple(r) for r in rows})


def host_group():
    """A gloo group over the whole world where the world runs NCCL (else None: the world's own
    group is already on the host). Host metadata (the plan check) travels on it with CPU
    tensors: no copy to or from the device, so no wait for the kernels queued before it."""
    return _STATE["host"] if _STATE["world"] is _world() else None


def kept() -> list:
    """The groups made once per world and kept across parallel states: the twins and the host
    group (``megatron_state.teardown`` leaves them)."""
    if _STATE["world"] is not _world():
        return []
    return [g for g in list(_STATE["twins"].values()) + [_STATE["host"]] if g is not None]


def created():
    """:class:`~.communicators.Created` of the last ``initialize_model_parallel`` made while
    the plugin was installed (None before one)."""
    return _STATE["created"]


def _world():
    return dist.group.WORLD if dist.is_initialized() else None


def install() -> None:
    """Twin the tensor-parallel groups now (if they exist) and whenever megatron initialises its
    parallel state from now on; idempotent."""
    from megatron.core import parallel_state

    if not runtime.is_installed(_NAME):
        original = parallel_state.initialize_model_parallel

        @functools.wraps(original)
        def initialize_model_parallel(*args, **kwargs):
            out = original(*args, **kwargs)
            create()
            _STATE["created"] = communicators.create_all()  # before any budget is measured
            return out

        runtime.install(_NAME, runtime.Patch(parallel_state, "initialize_model_parallel",
                                             initialize_model_parallel))
    create()


def uninstall() -> None:
    """Restore megatron's ``initialize_model_parallel`` (the twins made stay, unused by stock code)."""
    runtime.restore(_NAME)
