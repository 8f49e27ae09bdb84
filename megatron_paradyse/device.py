"""The one device decision of a process: where its tensors live and its collectives run.

It follows the distributed backend: NCCL computes on the rank's CUDA device (``LOCAL_RANK``),
gloo on the CPU, also on a machine that has GPUs. Everything in the package that needs a
device asks :func:`current`; nothing branches on ``torch.cuda.is_available()`` alone, so a
gloo run on a GPU host (the test suite, the demo, the benchmark) stays on the CPU, and the
CPU shims of :mod:`megatron_paradyse.cpu_compat` apply exactly when the CPU is chosen.

Entry points decide with :func:`select` before they build anything (the trainer, the
profiler, the check, the test harness); library users who initialise ``torch.distributed``
themselves get the same answer from its backend.
"""
from __future__ import annotations

import os

import torch

_CHOSEN: list = []  # [torch.device] once selected


def default_backend() -> str:
    """``nccl`` where CUDA is present, else ``gloo`` (what a launcher picks when not told)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def select(backend: str) -> torch.device:
    """Decide this process's device from its distributed ``backend`` and return it.

    ``nccl``: the CUDA device ``LOCAL_RANK`` (set as the current device here, before any
    NCCL communicator exists); ``gloo``: the CPU. A second call with another answer is an
    error: one process, one device.
    """
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("the nccl backend needs CUDA, which this machine does not have; "
                               "use gloo (CPU ranks)")
        index = int(os.environ.get("LOCAL_RANK", "0"))
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {index} but only {torch.cuda.device_count()} CUDA "
                               "device(s) visible: launch one rank per GPU")
        dev = torch.device("cuda", index)
    elif backend == "gloo":
        dev = torch.device("cpu")
    else:
        raise ValueError(f"unknown distributed backend {backend!r}: nccl (GPUs) or gloo (CPU)")
    if _CHOSEN and _CHOSEN[0] != dev:
        raise RuntimeError(f"this process already computes on {_CHOSEN[0]}; cannot switch to {dev}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    _CHOSEN[:] = [dev]
    return dev


def current() -> torch.device:
    """The device this process computes on: the one :func:`select` chose; before a choice,
    the backend's of an initialised ``torch.distributed``; else CUDA where present."""
    if _CHOSEN:
        return _CHOSEN[0]
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() != "nccl":
            return torch.device("cpu")
    elif not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def is_cpu() -> bool:
    """True where this process computes on the CPU (gloo ranks)."""
    return current().type == "cpu"


def synchronize() -> None:
    """Wait for this process's device work (a no-op on the CPU)."""
    dev = current()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def reset_for_tests() -> None:
    """Forget the decision (tests that play several processes in one)."""
    _CHOSEN.clear()
