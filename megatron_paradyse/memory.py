"""Peak memory of a region of code: the measure the strategies' table and the cost models use.

On GPU it is the CUDA caching allocator's peak of *allocated* bytes relative to the region's
start (what the cost models predict), with the peak of *reserved* bytes beside it (what an
out-of-memory error is about: allocated plus the allocator's cached, fragmented blocks). torch
keeps one peak counter per device, so a region resets it; :func:`run_peaks` keeps the
process's peaks across those resets for logs (Megatron-LM's own ``report_memory`` reads the
raw counters; the Megatron-LM entry point never measures regions, so they stay untouched
there). On CPU it is a deterministic tracker of live tensor bytes: a ``TorchDispatchMode``
that counts each new storage an op creates (views, in-place and ``out=`` ops reuse an input's
storage and are not counted) and subtracts it when the storage is freed. It is exact to the
byte and repeatable across runs, unlike RSS (glibc keeps freed heap). It sees tensor storages
only: not Python objects, nor scratch memory a kernel allocates internally.

A storage whose last reference a backend thread drops (gloo's worker, done with an async
collective's tensors after ``wait()`` returned) is freed, and counted free, only once that
thread holds the GIL; at Python's default switch interval (5 ms) the main thread runs on and
allocates meanwhile, and now and then a pass counted a dead tensor (one ``[s, h]`` activation
on one rank of a busy host, 11-25% of a layer's transient memory). In :func:`pass_memory` (the
profiler's measured passes) the switch interval is 10 microseconds (``SWITCH_INTERVAL``), so
such a free waits microseconds; elsewhere (a training step's peak) it stays Python's.
"""
from __future__ import annotations

import contextlib
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .device import current

SWITCH_INTERVAL = 1e-5  # seconds: Python's thread switch interval inside a CPU region (module docstring)


class _LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict = {}

    def _free(self, key):
        nbytes = self._live.pop(key, 0)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = set()
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                seen.add(t.untyped_storage()._cdata)
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in seen or key in self._live:
                continue
            nbytes = st.nbytes()
            self._live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(st, self._free, key)
        return out


class PeakMemory:
    """Context manager: ``peak_bytes`` is the most memory live at once inside the region beyond
    what was live at its start; ``end_bytes`` what the region left allocated.

    ``with PeakMemory() as m: step();  m.peak_bytes``
    """

    def __init__(self, device=None):
        if device is None:
            device = current()
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.end_bytes = 0
        self.peak_reserved = None  # CUDA: the allocator's reserved peak (absolute), else None
        self._mode = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            _fold_run_peaks(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _LiveBytes()
            self._mode.__enter__()
        return self

    def current_bytes(self) -> int:
        """Bytes allocated inside the region and still live now (read inside the region)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device) - self._start
        return self._mode.current

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.end_bytes = torch.cuda.memory_allocated(self.device) - self._start
            self.peak_reserved = torch.cuda.max_memory_reserved(self.device)
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes = self._mode.peak
            self.end_bytes = self._mode.current
        return False


_RUN_PEAKS: dict = {}  # device -> [allocated, reserved] peaks before the last reset


def _fold_run_peaks(device) -> None:
    run = _RUN_PEAKS.setdefault(str(device), [0, 0])
    run[0] = max(run[0], torch.cuda.max_memory_allocated(device))
    run[1] = max(run[1], torch.cuda.max_memory_reserved(device))


def run_peaks(device=None) -> tuple:
    """``(allocated, reserved)`` peak bytes of this process on a CUDA ``device`` since it
    started, across :class:`PeakMemory`'s resets of torch's counters; ``(None, None)`` on CPU."""
    if device is None:
        device = current()
    device = torch.device(device)
    if device.type != "cuda":
        return None, None
    _fold_run_peaks(device)
    return tuple(_RUN_PEAKS[str(device)])


@contextlib.contextmanager
def _prompt_frees():
    """Python's switch interval at ``SWITCH_INTERVAL`` on the CPU (module docstring)."""
    if current().type == "cuda":
        yield
        return
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def pass_memory(forward, backward, between=None) -> dict:
    """Memory of one forward and backward pass, in bytes.

    ``activations``: what the forward leaves alive for the backward (its output included);
    ``peak``: the most live at once during the whole pass beyond the start. One tracker spans
    both halves, so the saved tensors the backward frees as it goes are credited (two trackers,
    one per half, would add the backward's allocations to all the saved bytes and overstate
    the peak). ``between`` runs after the forward (e.g. ``gc.collect``). Call after a warm-up
    pass so that persistent buffers (the communication pool, RoPE caches) are not counted;
    report them separately.
    """
    with _prompt_frees(), PeakMemory() as m:
        out = forward()
        if between is not None:
            between()
        saved = m.current_bytes()
        backward(out)
        del out
    return {"activations": saved, "peak": m.peak_bytes}


def static_bytes(model, optimizer) -> int:
    """Bytes of parameters, their gradient buffers and the optimizer's state on this rank
    (with megatron's mixed-precision optimizer, its fp32 master copies too); each storage once."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
    for p in model.parameters():
        add(p)
        add(getattr(p, "main_grad", None))
    inner = getattr(optimizer, "optimizer", optimizer)
    for opt in (inner if isinstance(inner, (list, tuple)) else [inner]):
        for group in getattr(opt, "param_groups", []):
            for p in group["params"]:
                add(p)
        for state in getattr(opt, "state", {}).values():
            for v in state.values():
                add(v)
    return total
