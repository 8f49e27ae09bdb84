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
