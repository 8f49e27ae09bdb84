"""CPU compatibility layer for Megatron-LM's ``megatron.training`` (its ``pretrain()``).

The companion of :mod:`megatron_paradyse.cpu_compat` (which shims megatron-core and must be
applied first; :func:`apply` does). Applied by :func:`apply` only where this process
computes on the CPU (``megatron_paradyse.device``: gloo ranks); under NCCL it is a no-op.
Idempotent. It lets
Megatron-LM's unmodified ``pretrain_gpt.py`` train on CPU with gloo, which this repository
uses to test the plugin against the real ``pretrain()``. Checked on Megatron-LM
core_v0.16.1 (with megatron-core 0.16.1) and core_v0.19.0 (megatron-core 0.19.x's wheel).

Most of ``megatron/training``'s ~75 CUDA call sites are ``torch.tensor(..., device='cuda')``,
``.cuda()`` and ``torch.cuda.current_device()``: the ``device`` and ``factory`` shims of
``cpu_compat`` already send those to the CPU. What is left is shimmed here, each shim
naming the functions that need it:

``batch_invariant``
    Registers a stand-in for ``megatron.core.transformer.custom_layers.batch_invariant_kernels``
    when ``triton`` cannot be imported (its kernels are Triton GPU kernels). Needed by the
    import of ``megatron/training/initialize.py`` (``from ... import
    enable_batch_invariant_mode``), 0.16.1. The stand-in's functions raise a clear error if
    ``--batch-invariant-mode`` is used. It saves installing triton (about 1 GB) for an import.
    (megatron-core 0.19's own imports need triton elsewhere, so its venv installs it and this
    shim does nothing there.)
``no_cuda_assert``
    ``initialize_megatron(..., allow_no_cuda=True)``: it asserts
    ``torch.cuda.is_available()`` ("Megatron requires CUDA.") otherwise. Needed by
    ``training.pretrain()``, which calls it without that argument. Both versions.
``distributed``
    ``initialize._initialize_distributed``: creates the default process group itself
    (``--distributed-backend``, gloo on CPU) and then runs Megatron-LM's own function while
    ``torch.cuda.device_count()`` reads 1 and ``torch.cuda.set_device`` is a no-op. Needed by
    ``initialize_megatron``: that function creates the model-parallel groups
    (``mpu.initialize_model_parallel``) only ``if torch.cuda.device_count() > 0``, and
    everything after it needs them. Both versions.
``seed``
    ``initialize._set_random_seed``: seeds megatron's RNG tracker
    (``model_parallel_cuda_manual_seed``, on ``cpu_compat``'s CPU tracker), which Megatron-LM
    does only ``if torch.cuda.device_count() > 0``. Needed by every
    ``get_cuda_rng_tracker().fork()``: without it the first ``DotProductAttention.forward``
    fails (``cuda rng state model-parallel-rng is not added``). Both versions.
``jit_warmup``
    ``initialize._warmup_jit_function`` runs with the CPU random generator's state saved and
    restored. It draws random inputs of ``--seq-length / --context-parallel-size`` tokens on
    ``device="cuda"``: on a GPU from the CUDA generator, here (``device`` shim) from the CPU
    one, which ``--use-cpu-initialization`` then initialises the weights from, so the
    initial weights would depend on the warmup's shapes (runs at different
    ``--context-parallel-size`` would start from different weights). It also runs eagerly
    (``torch._dynamo`` off for its duration): megatron's fused functions are ``torch.compile``'d,
    and compiling them for a warmup whose point is CUDA's JIT took about 8 s of CPU per rank
    (a later use with fusion on still compiles). Needed by ``training.pretrain()``
    (``set_jit_fusion_options``, before the model is built). Both versions.
``device_arch``
    ``utils.get_device_arch_version`` (also the copy in ``arguments``) returns 0 instead of
    querying CUDA device 0, and ``CUDA_DEVICE_MAX_CONNECTIONS`` defaults to ``1`` (it means
    nothing on CPU). Needed by ``arguments.validate_args`` (TP or CP > 1 asserts that
    variable on pre-Blackwell devices).
``memory``
    ``torch.cuda.memory_allocated / max_memory_allocated / memory_reserved /
    max_memory_reserved / memory_stats / reset_peak_memory_stats / empty_cache`` report 0 (or
    do nothing) instead of raising on a CPU build. Needed by ``training.training_log``
    (``report_memory`` after the first logged iteration), ``utils.report_memory``,
    ``train()``'s ``empty_cache`` calls.
``pipeline_outputs``
    megatron-core's ``schedules.deallocate_output_tensor`` keeps the sent storage: Megatron-LM sets
    ``deallocate_pipeline_outputs`` (a stage's output's storage swapped for one element once
    it is sent), and under the interleaved schedule with ``--overlap-p2p-comm`` (Megatron-LM's
    default there) the swap comes right after the send is posted, before it completes. On a
    GPU the send is ordered on its stream; gloo sends from a background thread out of the
    storage just freed, and the peer received garbage now and then (stock core_v0.16.1 at PP
    = 2 x V = 2: a NaN loss at iteration 3, not reproduced by megatron's rerun). The shim
    still swaps the storage (the backward asserts it) but keeps the old one referenced from
    the tensor until the schedule drops it after its backward: memory only, no number changes. Needed by ``forward_backward_pipelining_with_interleaving``. Both versions.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from datetime import timedelta

import torch

from . import cpu_compat, runtime
from .device import is_cpu

_PREFIX = "cpu_compat_training:"  # the registry's names of the shims applied (never restored)
ALL_SHIMS = ("batch_invariant", "no_cuda_assert", "distributed", "seed", "jit_warmup", "device_arch",
             "memory", "pipeline_outputs")


def needed() -> bool:
    """True where this process computes on the CPU (the device decision), the only case in
    which shims are applied."""
    return is_cpu()


def apply(skip: tuple = ()) -> tuple:
    """Apply megatron-core's CPU shims, then every ``megatron.training`` shim not in ``skip``.

    Call before ``megatron.training`` runs (importing it first is fine). Returns the
    ``megatron.training`` shims applied.
    """
    if not needed():
        return ()
    cpu_compat.apply()
    for name in ALL_SHIMS:
        if name in skip or runtime.is_installed(_PREFIX + name):
            continue
        _SHIMS[name]()
        runtime.mark(_PREFIX + name, f"megatron_paradyse.cpu_compat_training shim {name!r}")
    return tuple(sorted(n for n in ALL_SHIMS if runtime.is_installed(_PREFIX + n)))


@contextlib.contextmanager
def _one_device():
    """``torch.cuda.device_count()`` reads 1 and ``set_device`` does nothing, inside the block."""
    count, set_device = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = count, set_device


def _batch_invariant():
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    mod = types.ModuleType(name)
    mod.__doc__ = "CPU stand-in (megatron_paradyse.cpu_compat_training): triton is not installed."

    def _unavailable(*args, **kwargs):
        raise RuntimeError("--batch-invariant-mode needs triton and a GPU (megatron-core's "
                           "batch-invariant kernels are Triton kernels); drop the flag on CPU")

    mod.enable_batch_invariant_mode = _unavailable
    mod.set_batch_invariant_mode = _unavailable
    mod.disable_batch_invariant_mode = lambda *a, **k: None
    mod.is_batch_invariant_mode_enabled = lambda *a, **k: False
    mod.__all__ = ["set_batch_invariant_mode", "is_batch_invariant_mode_enabled",
                   "disable_batch_invariant_mode", "enable_batch_invariant_mode"]
    sys.modules[name] = mod


def _no_cuda_assert():
    from megatron.training import initialize, training
    import megatron.training as mt

    orig = initialize.initialize_megatron
    if getattr(orig, "_paradyse", False):
        return

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return orig(*args, **kwargs)

    initialize_megatron._paradyse = True
    for mod in (initialize, training, mt):
        if getattr(mod, "initialize_megatron", None) is orig:
            mod.initialize_megatron = initialize_megatron


def _distributed():
    from megatron.training import initialize

    orig = initialize._initialize_distributed
    if getattr(orig, "_paradyse", False):
        return

    def _initialize_distributed(*args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        if not torch.distributed.is_initialized():
            init = dict(backend=margs.distributed_backend, world_size=margs.world_size,
                        rank=margs.rank, timeout=timedelta(minutes=margs.distributed_timeout_minutes))
            store = kwargs.get("store", args[2] if len(args) > 2 else None)
            if store is not None:
                init["store"] = store
            torch.distributed.init_process_group(**init)
        with _one_device():
            return orig(*args, **kwargs)

    _initialize_distributed._paradyse = True
    initialize._initialize_distributed = _initialize_distributed


def _seed():
    from megatron.training import initialize

    orig = initialize._set_random_seed
    if getattr(orig, "_paradyse", False):
        return

    def _set_random_seed(*args, **kwargs):
        with _one_device():
            return orig(*args, **kwargs)

    _set_random_seed._paradyse = True
    initialize._set_random_seed = _set_random_seed


def _jit_warmup():
    from megatron.training import initialize

    orig = getattr(initialize, "_warmup_jit_function", None)
    if orig is None or getattr(orig, "_paradyse", False):
        return

    def _warmup_jit_function(*args, **kwargs):
        import torch._dynamo

        was = torch._dynamo.config.disable
        torch._dynamo.config.disable = True  # eager: nothing to warm up on the CPU
        try:
            with torch.random.fork_rng(devices=[]):
                return orig(*args, **kwargs)
        finally:
            torch._dynamo.config.disable = was

    _warmup_jit_function._paradyse = True
    initialize._warmup_jit_function = _warmup_jit_function


def _device_arch():
    from megatron.training import arguments, utils

    arch = lambda: 0  # noqa: E731 - no CUDA device: the conservative (pre-Blackwell) branches
    for mod in (utils, arguments):
        if hasattr(mod, "get_device_arch_version"):
            mod.get_device_arch_version = arch
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _memory():
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)
    torch.cuda.memory_stats = lambda *a, **k: {}
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None


def _pipeline_outputs():
    from megatron.core.pipeline_parallel import schedules

    orig = schedules.deallocate_output_tensor
    if getattr(orig, "_paradyse", False):
        return

    def deallocate_output_tensor(out, deallocate_pipeline_outputs=False):
        # 0.19 also takes lists and dicts of tensors, recursing through this module global
        kept = out.data if isinstance(out, torch.Tensor) and deallocate_pipeline_outputs else None
        orig(out, deallocate_pipeline_outputs)
        if kept is not None:  # the old storage lives as long as the tensor (until its backward)
            out._paradyse_sent = kept

    deallocate_output_tensor._paradyse = True
    schedules.deallocate_output_tensor = deallocate_output_tensor


_SHIMS = types.MappingProxyType({
    "batch_invariant": _batch_invariant, "no_cuda_assert": _no_cuda_assert,
    "distributed": _distributed, "seed": _seed, "jit_warmup": _jit_warmup, "device_arch": _device_arch,
    "memory": _memory, "pipeline_outputs": _pipeline_outputs,
})
