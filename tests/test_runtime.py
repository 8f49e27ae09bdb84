"""The one registry of patches and the runtime options (``megatron_paradyse/runtime.py``)."""
from __future__ import annotations

import argparse
import types

import pytest

from megatron_paradyse import runtime
from megatron_paradyse.training.dims import runtime_options


class _Target:
    def method(self):
        return "stock"


class _Child(_Target):
    pass


def test_install_restore_idempotent_and_listed():
    mod = types.ModuleType("m")
    mod.f = lambda: "stock"
    stock = mod.f
    assert runtime.install("test:a", runtime.Patch(mod, "f", lambda: "new"),
                           runtime.Patch(_Child, "method", lambda self: "child"))
    try:
        assert mod.f() == "new" and _Child().method() == "child" and _Target().method() == "stock"
        assert not runtime.install("test:a", runtime.Patch(mod, "f", lambda: "again"))  # idempotent
        assert mod.f() == "new"
        assert runtime.original("test:a", mod, "f") is stock
        assert runtime.original("test:a", _Child, "method") is _Target.method  # inherited, as called
        assert runtime.installed()["test:a"] == ["m.f", f"{__name__}._Child.method"]
        with pytest.raises(KeyError):
            runtime.original("test:a", mod, "g")
    finally:
        assert runtime.restore("test:a")
    assert mod.f is stock and "method" not in vars(_Child)  # an inherited attribute is removed again
    assert not runtime.restore("test:a") and "test:a" not in runtime.installed()


def test_restore_all_last_first_and_marks_stay(monkeypatch):
    monkeypatch.setattr(runtime, "_REGISTRY", runtime._Registry())  # this process's patches stay
    mod = types.ModuleType("m")
    mod.f = "stock"
    runtime.install("test:outer", runtime.Patch(mod, "f", "outer"))
    runtime.install("test:inner", runtime.Patch(mod, "f", "inner"))
    assert runtime.original("test:inner", mod, "f") == "outer"
    assert runtime.mark("test:shim", "a shim applied for good") and not runtime.mark("test:shim")
    assert runtime.restore_all() == ["test:inner", "test:outer"] and mod.f == "stock"
    assert runtime.is_installed("test:shim") and not runtime.restore("test:shim")
    assert runtime.installed() == {"test:shim": ["a shim applied for good"]}


def test_a_failed_install_puts_back_what_it_set():
    mod = types.ModuleType("m")
    mod.f = "stock"
    with pytest.raises(AttributeError):
        runtime.install("test:bad", runtime.Patch(mod, "f", "new"), runtime.Patch(object(), "x", 1))
    assert mod.f == "stock" and not runtime.is_installed("test:bad")


def test_the_plugin_installs_every_megatron_patch_through_the_registry():
    import megatron_paradyse as mp
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.transformer.mlp import MLP

    from megatron_paradyse.training import p2p_shapes

    was = mp.installed()
    mp.uninstall()
    stock = (MLP.forward, tensor_parallel.checkpoint, parallel_state.initialize_model_parallel,
             DistributedDataParallel.__init__, P2PCommunicator._communicate_shapes)
    mp.install()
    p2p_shapes.install()
    try:
        got = runtime.installed()
        assert {"dispatch", "recompute", "groups", "grad_order", "p2p_shapes"} <= set(got)
        assert "megatron.core.transformer.mlp.MLP.forward" in got["dispatch"]
        assert got["recompute"] == ["megatron.core.tensor_parallel.random.checkpoint",
                                    "megatron.core.tensor_parallel.checkpoint"]
        assert MLP.forward is not stock[0] and tensor_parallel.checkpoint is not stock[1]
    finally:
        p2p_shapes.uninstall()
        mp.uninstall()
    assert (MLP.forward, tensor_parallel.checkpoint, parallel_state.initialize_model_parallel,
            DistributedDataParallel.__init__, P2PCommunicator._communicate_shapes) == stock
    assert not hasattr(MLP, "paradyse_stock_forward") and not set(runtime.installed()) & {
        "dispatch", "recompute", "groups", "grad_order", "p2p_shapes"}
    if was:
        mp.install()


def test_runtime_options_one_object_read_by_the_kernels():
    import torch

    from megatron_paradyse.parallel import attention_kernels, kernel_select, prefetch

    assert runtime.options() == runtime.RuntimeOptions()  # defaults: prefetch on, default kernels
    args = argparse.Namespace(paradyse_no_prefetch=True)
    assert runtime_options(args) == runtime.RuntimeOptions(prefetch=False)
    assert runtime_options(argparse.Namespace(deterministic_mode=True)).deterministic
    with pytest.raises(Exception):
        runtime.options().prefetch = False  # frozen
    old = runtime.set_options(runtime_options(args))
    try:
        assert not prefetch.enabled()
    finally:
        runtime.set_options(old)
    assert prefetch.enabled()
    with prefetch.disabled():
        assert runtime.options().prefetch is False
    with kernel_select.only(kernel_select.MATH):
        assert runtime.options().kernel == kernel_select.MATH
        c = kernel_select.Call("cpu", None, torch.float32, 64)
        assert kernel_select.candidates(c, False) == [kernel_select.MATH]
    with attention_kernels.torch_kernels_only():
        assert attention_kernels._fa() is None and not runtime.options().flash_attn
    assert runtime.options() == runtime.RuntimeOptions()
    was = torch.are_deterministic_algorithms_enabled()
    assert runtime.options().is_deterministic() == was
    with runtime.using(deterministic=not was):
        assert runtime.options().is_deterministic() == (not was)
    assert "kernel_select" in runtime._REGISTRY.caches  # the kernel choices live in the registry


def test_the_cost_model_takes_prefetch_as_an_argument():
    from megatron_paradyse.costmodel import build_cost_model
    from megatron_paradyse.costmodel.shape import ModelShape
    from megatron_paradyse.parallel import prefetch

    shape = ModelShape(num_layers=2, hidden=64, heads=4, query_groups=4, ffn=256, swiglu=False, bias=True,
                       vocab=512, dtype="fp32", p=2)
    on, off = build_cost_model(shape), build_cost_model(shape, prefetch=False)
    assert on.prefetch and not off.prefetch
    assert on.pool_bytes(["ulysses"] * 2, 32, 1) > off.pool_bytes(["ulysses"] * 2, 32, 1)
    with prefetch.disabled():  # the kernels' switch is not the cost model's
        assert on.pool_bytes(["ulysses"] * 2, 32, 1) > off.pool_bytes(["ulysses"] * 2, 32, 1)


def test_torch_compile_is_deferred_to_the_first_call():
    """``runtime._deferred_compile``: decorating compiles nothing; the first call compiles once,
    with the decorator's arguments, and every call runs the compiled function; a module (not a
    plain function) is compiled at once."""
    import torch

    made = []

    def fake_compile(fn, **kwargs):
        made.append((fn.__name__ if hasattr(fn, "__name__") else type(fn).__name__, kwargs))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    deferred = runtime._deferred_compile(fake_compile)

    @deferred
    def f(x):
        return x + 1

    @deferred(dynamic=True)
    def g(x):
        return x * 2

    assert made == [] and f.__name__ == "f"
    assert f(1) == ("compiled", 2) and f(2) == ("compiled", 3) and g(3) == ("compiled", 6)
    assert made == [("f", {}), ("g", {"dynamic": True})]
    deferred(torch.nn.Linear(2, 2))
    assert made[-1] == ("Linear", {})


def test_importing_the_plugin_leaves_torchs_compiler_unimported():
    """A fresh process: ``import megatron_paradyse`` imports megatron-core with its fusions'
    ``jit_fuser`` deferred, so torch's compiler stack (seconds per rank) stays unimported;
    ``torch.compile`` itself is put back."""
    import subprocess
    import sys

    code = ("import sys, torch; real = torch.compile; import megatron_paradyse\n"
            "import megatron.core.models.gpt\n"
            "from megatron.core.fusions.fused_bias_gelu import bias_gelu\n"
            "assert torch.compile is real, 'torch.compile not put back'\n"
            "print('inductor' if 'torch._inductor' in sys.modules else 'no inductor')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "no inductor", out.stdout
