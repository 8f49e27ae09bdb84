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
import torch.distributed as dist

_CHOSEN: list = []  # [torch.device] once selected


def default_backend() -> str:
    """The backend when none is given: that of an initialised ``torch.distributed``, else the
    decision already made, else ``nccl`` where CUDA is present and ``gloo`` elsewhere."""
    if dist.is_available() and dist.is_initialized():
        return "nccl" if dist.get_backend() == "nccl" else "gloo"
    if _CHOSEN:
        return "gloo" if _CHOSEN[0].type == "cpu" else "nccl"
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
        set_allocator()
        torch.cuda.set_device(dev)
    _CHOSEN[:] = [dev]
    return dev


ALLOCATOR_CONF = "expandable_segments:True"


def set_allocator() -> str:
    """The CUDA caching allocator's settings on every path (trainer, Megatron-LM entry point,
    profiler, check): ``expandable_segments`` unless ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise.
    Variable-length micro-batches allocate differently sized activations every step; with
    fixed segments the cached blocks fragment and reserved memory grows past what the cost
    model predicts. Returns the setting in force."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if conf is None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf = ALLOCATOR_CONF
        if torch.cuda.is_initialized():  # too late for the variable: set it directly
            torch.cuda.memory._set_allocator_settings(ALLOCATOR_CONF)
    return conf


# Memory the device will need outside torch's allocator after planning starts: NCCL's buffers
# for communicators first used in the first step, cuBLAS/cuDNN workspaces of new streams.
NON_TORCH_RESERVE_BYTES = 1 << 30


def usable_memory_bytes() -> int:
    """What this rank's device can really hand out to torch's allocator from now on: on CUDA,
    the free device memory plus what torch already reserved (the CUDA context, other
    processes and NCCL/cuBLAS buffers already made are outside), less
    :data:`NON_TORCH_RESERVE_BYTES` for buffers not made yet; on the CPU, the host's memory
    divided by the ranks of this node (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``)."""
    dev = current()
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return max(0, free + torch.cuda.memory_reserved(dev) - NON_TORCH_RESERVE_BYTES)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")) or 1)
    return total // max(1, ranks)


def current() -> torch.device:
    """The device this process computes on: the one :func:`select` chose; before a choice,
    the backend's of an initialised ``torch.distributed``; else CUDA where present."""
    if _CHOSEN:
        return _CHOSEN[0]
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() != "nccl":
            return torch.device("cpu")
    elif not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def is_cpu() -> bool:
    """True where this process computes on the CPU (gloo ranks)."""
    return current().type == "cpu"


def copy_to(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without stalling the host: on CUDA staged in pinned memory and
    copied with ``non_blocking=True`` (a copy from pageable memory waits for the stream to
    drain; torch's caching host allocator keeps the pinned buffer until the copy has run),
    other devices non-blocking, the CPU the tensor itself."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cpu" or host.device == device:
        return host
    if _fake(host):  # FakeTensorMode (tests): no values to copy, only the device, dtype and shape
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    if device.type == "cuda" and host.device.type == "cpu":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def synchronize() -> None:
    """Wait for this process's device work (a no-op on the CPU)."""
    dev = current()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def reset_for_tests() -> None:
    """Forget the decision (tests that play several processes in one)."""
    _CHOSEN.clear()
