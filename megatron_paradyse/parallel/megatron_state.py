"""Megatron's parallel state made again in one process, its old process groups destroyed.

``parallel_state.destroy_model_parallel`` only forgets its groups: torch's registry keeps each
one, and gloo keeps a transport thread per group that wakes every 10 ms. A process that builds
the parallel state once per run (a test world training stock and ParaDySe one after the other,
the check's sections, the benches) piled up about 50 such threads per initialisation: 630 per
rank in the 8-rank pipeline test world, a load average of hundreds on two cores, and every job
beside it several times slower. :func:`initialize` destroys the groups the previous state made
before it makes the next; :func:`owned` hands it groups made beside megatron's (Dynamic CP's).
A destroyed group's threads end when its last reference goes: the plugin's own registries
(``collectives.ensure_ready``, the collective trace) hold groups weakly.

Only a state made again by the same maker is torn down that way (``owner``: a second trainer in
one process): those are the processes that build it over and over (test worlds, whose ranks end
with ``os._exit``). Everything else (``owner`` None: the profiler, the check, the benches, the
test models) keeps megatron's behaviour. A launcher run that calibrates and then trains (the
calibration's state, then the trainer's) leaves the calibration's groups to torch, as megatron
does: a process that destroyed groups mid-run and then exited normally aborted now and then at
interpreter exit on a busy host ("terminate called without an active exception"; test ranks
end with ``os._exit``).

The weight communicator's twins and the host group (``groups.py``) are made once per world and
kept. Groups are destroyed in the order they were made, the same on every rank.
"""
from __future__ import annotations

import contextlib
import gc

import torch.distributed as dist

from . import groups

_MADE: list = []  # groups to destroy at the next teardown, in creation order
_OWNER: list = [None]  # who made the current state (initialize's owner)


def _registered() -> list:
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map) if dist.is_initialized() else []


@contextlib.contextmanager
def owned():
    """Groups made inside the block are destroyed at the next :func:`teardown` (every rank
    must make the same groups inside it, as ``new_group`` requires anyway)."""
    before = {id(g) for g in _registered()}
    try:
        yield
    finally:
        kept = groups.kept()
        _MADE.extend(g for g in _registered()
                     if id(g) not in before and g is not dist.group.WORLD and not any(g is k for k in kept))


def teardown() -> None:
    """Megatron's parallel state forgotten and the groups it (and :func:`owned` blocks) made
    destroyed; the dropped objects collected, so that gloo's threads end now. Collective over
    the world: a barrier first, so no rank shuts a group down while a peer still uses it."""
    from megatron.core import parallel_state

    if _MADE and dist.is_initialized():
        dist.barrier()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if not _MADE:
        return
    alive = {id(g) for g in _registered()}
    for group in _MADE:
        if id(group) in alive:  # megatron 0.19 destroys its own gloo groups
            dist.destroy_process_group(group)
    _MADE.clear()
    gc.collect()


def initialize(owner: str | None = None, **kwargs) -> None:
    """``parallel_state.initialize_model_parallel(**kwargs)`` (collective over the world, as
    megatron's own) after :func:`teardown` of the previous state if ``owner`` made that one too;
    else megatron's own destroy, the previous groups left to torch (module docstring)."""
    from megatron.core import parallel_state

    if owner is None or _OWNER[0] != owner:
        _MADE.clear()
    teardown()
    _OWNER[0] = owner
    if owner is None:
        parallel_state.initialize_model_parallel(**kwargs)
        return
    with owned():
        parallel_state.initialize_model_parallel(**kwargs)
