"""CPU compatibility layer: lets stock megatron-core run on CPU with the gloo backend.

Applied by :func:`apply` only where this process computes on the CPU
(:func:`megatron_paradyse.device.current`: gloo ranks, also on a machine with GPUs); under
NCCL it is a no-op. Idempotent. Each shim names the
megatron-core functions that need it (checked on 0.16.1 and 0.19.x):

``device``
    ``torch.cuda.current_device`` returns ``"cpu"``; ``torch.cuda.synchronize`` is a no-op.
    Needed by RoPE ``RotaryEmbedding.get_emb``, the SP gathers in
    ``tensor_parallel/mappings.py`` and ``layers.py``, ``GlobalMemoryBuffer.get_tensor``,
    DDP's ``param_and_grad_buffer``, and the dist-checkpoint writer
    (``filesystem_async.preload_tensors``, ``state_dict_saver``). All versions.
``rng``
    A CPU ``CudaRNGStatesTracker`` (same API, on ``torch.get_rng_state``), and
    ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``. Needed by
    ``model_parallel_cuda_manual_seed`` and every ``get_cuda_rng_tracker().fork()``
    (``DotProductAttention.forward``, weight init, recompute). All versions.
``sp_norm``
    ``WrappedTorchNorm.__new__`` without its ``sequence_parallel`` assertion; the norm's
    parameters are tagged ``sequence_parallel=True`` as apex's ``FusedLayerNorm`` does, so
    ``finalize_model_grads`` sums their gradients over TP. Needed whenever
    ``sequence_parallel=True`` without apex or Transformer Engine. All versions.
``factory``
    ``torch.tensor/zeros/ones/empty/full/arange``: a CUDA or integer ``device=`` becomes
    CPU and ``pin_memory`` is dropped; ``Tensor.cuda()`` returns the tensor. Needed on the
    training path: ``schedules.forward_backward_no_pipelining`` (``total_num_tokens``),
    ``FP32Optimizer.__init__`` (``_scale``), ``clip_grads``, ``get_default_causal_mask``,
    fully parallel checkpoint loads (``exchange_utils``). All versions.
``clip_grad``
    ``clip_grad_by_total_norm_fp32`` without its ``torch.cuda.FloatTensor`` assertion
    (also the copy imported into ``optimizer/optimizer.py``). Needed when
    ``OptimizerConfig.clip_grad > 0``. All versions.
``streams``
    ``torch.cuda.current_stream/default_stream/Stream/stream/Event`` become dummies.
    Needed by ``param_and_grad_buffer.start_grad_sync`` (from ``finalize_model_grads``) on
    0.19.x, and by ``overlap_grad_reduce=True`` on every version.
``checkpoint``
    ``filesystem_async._process_memory`` returns 0 when psutil is missing (its forked
    writer otherwise dies and the parent waits forever). Debug logging only.

:data:`RANK_ENV` is the environment a CPU rank starts with (read by glibc and torch when the
process starts or first allocates, so it must be set before: ``launch``, ``testing.spawn`` and
the ``scripts/*.sh`` launchers set it); :data:`ALLOCATOR_ENV` its allocator part, recorded in
each profile, since CPU times of large tensors depend on it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import types

import torch

from . import runtime
from .device import is_cpu
from .norms import install_sp_norm

# The allocator settings of a CPU rank. PyTorch's CPU allocator has no cache: a tensor above
# glibc's mmap threshold (at most 32 MiB) is mapped afresh and zero-filled page by page on
# every allocation, and handed back to the kernel when freed; a GPU rank's caching allocator
# keeps such blocks. With 2 MiB transparent huge pages (torch's own switch,
# c10/core/alloc_cpu.cpp) ``colossal``'s layer was 31% faster and grew 3.8x from 4096 to 8192
# tokens (s^2: 4x), but still paid the page faults on every pass: its 8192-token layer took
# 2.4-5.3 s from pass to pass, and 4.1-4.8 s after a whole profile (the kernel's memory state,
# not the layer). glibc's own settings then keep freed memory in the process, as the CUDA
# caching allocator does: no mmap per large block (``MALLOC_MMAP_MAX_=0``), no trimming of the
# heap's top (``MALLOC_TRIM_THRESHOLD_``): the same layer took 2.3-3.4 s, kernel time per
# pass halved (docs/costmodel.md, "The CPU allocator"). Memory is counted by the live-tensor
# tracker, not the process's size, so no measured byte changes.
ALLOCATOR_ENV = types.MappingProxyType({
    "THP_MEM_ALLOC_ENABLE": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
})
RANK_ENV = types.MappingProxyType({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **ALLOCATOR_ENV})

_PREFIX = "cpu_compat:"  # the registry's names of the shims applied (never restored)
ALL_SHIMS = ("device", "rng", "sp_norm", "factory", "clip_grad", "streams", "checkpoint")


def needed() -> bool:
    """True where this process computes on the CPU (the device decision), the only case in
    which shims are applied."""
    return is_cpu()


def apply(skip: tuple = ()) -> tuple:
    """Apply every shim not in ``skip`` (also ``$PARADYSE_CPU_SHIMS_SKIP``). Returns those applied."""
    if not needed():
        return ()
    env_skip = tuple(s for s in os.environ.get("PARADYSE_CPU_SHIMS_SKIP", "").split(",") if s)
    for name in ALL_SHIMS:
        if name in skip or name in env_skip or runtime.is_installed(_PREFIX + name):
            continue
        _SHIMS[name]()
        runtime.mark(_PREFIX + name, f"megatron_paradyse.cpu_compat shim {name!r}")
    return tuple(sorted(n for n in ALL_SHIMS if runtime.is_installed(_PREFIX + n)))


def _patch_everywhere(module_names, attr, new):
    """Replace ``attr`` in each module that defines or imported it by name."""
    for mod_name in module_names:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        if hasattr(mod, attr):
            setattr(mod, attr, new)


def _device():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None


class _CPURNGStatesTracker:
    """The API of megatron's ``CudaRNGStatesTracker`` over the CPU generator."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _rng():
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker = _CPURNGStatesTracker
    get_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    set_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    for mod in ("megatron.core.tensor_parallel.random", "megatron.core.transformer.cuda_graphs"):
        _patch_everywhere([mod], "_get_cuda_rng_state", get_state)
        _patch_everywhere([mod], "_set_cuda_rng_state", set_state)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # A tracker built before the patch is a CUDA one: rebuild it on next use.
    if getattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None) is not None and not isinstance(
        mrandom._CUDA_RNG_STATE_TRACKER, _CPURNGStatesTracker
    ):
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _sp_norm():
    install_sp_norm()


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    return device


def _factory():
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint"):
        orig = getattr(torch, name)
        if getattr(orig, "_paradyse", False):
            continue

        @functools.wraps(orig)
        def wrapped(*args, _orig=orig, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            kwargs.pop("pin_memory", None)
            return _orig(*args, **kwargs)

        wrapped._paradyse = True
        setattr(torch, name, wrapped)
    for name in ("empty_like", "zeros_like", "ones_like", "full_like"):
        orig = getattr(torch, name)
        if getattr(orig, "_paradyse", False):
            continue

        @functools.wraps(orig)
        def wrapped_like(*args, _orig=orig, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return _orig(*args, **kwargs)

        wrapped_like._paradyse = True
        setattr(torch, name, wrapped_like)
    if not getattr(torch.Tensor.cuda, "_paradyse", False):
        def cuda(self, *args, **kwargs):
            return self

        cuda._paradyse = True
        torch.Tensor.cuda = cuda
        orig_to = torch.Tensor.to

        def to(self, *args, **kwargs):
            args = tuple(_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return orig_to(self, *args, **kwargs)

        torch.Tensor.to = to
        orig_pin = torch.Tensor.pin_memory
        torch.Tensor.pin_memory = lambda self, *a, **k: self
        torch.Tensor._paradyse_orig = (orig_to, orig_pin)


def _clip_grad():
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        grads = []
        for p in parameters:
            g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
            if g is not None:
                grads.append(g.detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for g in grads:
                g.mul_(clip_coeff)

    _patch_everywhere(
        ["megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer",
         "megatron.core.optimizer.distrib_optimizer"],
        "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32,
    )


class _DummyStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _DummyEvent()


class _DummyEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _streams():
    torch.cuda.current_stream = lambda *a, **k: _DummyStream()
    torch.cuda.default_stream = lambda *a, **k: _DummyStream()
    torch.cuda.Stream = _DummyStream
    torch.cuda.Event = _DummyEvent
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def _checkpoint():
    try:
        import psutil  # noqa: F401  (only its presence matters)
        return
    except ImportError:
        pass
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    filesystem_async._process_memory = lambda: 0


_SHIMS = types.MappingProxyType({
    "device": _device, "rng": _rng, "sp_norm": _sp_norm, "factory": _factory,
    "clip_grad": _clip_grad, "streams": _streams, "checkpoint": _checkpoint,
})
