"""The CPU compatibility layer: applied where the CPU is chosen (gloo ranks), idempotent, and each
shim skippable."""

from megatron_paradyse.testing.spawn import run_world


def _apply_twice(rank, world):
    import torch

    from megatron_paradyse import cpu_compat

    first = cpu_compat.apply()
    patched = (torch.zeros, torch.cuda.current_device, torch.Tensor.cuda)
    second = cpu_compat.apply()
    same = patched == (torch.zeros, torch.cuda.current_device, torch.Tensor.cuda)
    from megatron.core.tensor_parallel import random as mrandom

    return {"first": first, "second": second, "same": same,
            "device": torch.cuda.current_device(),
            "zeros_on_cpu": torch.zeros(2, device="cuda").device.type,
            "tracker": mrandom.CudaRNGStatesTracker.__name__}


def _skip_factory(rank, world):
    import torch

    from megatron_paradyse import cpu_compat

    applied = cpu_compat.apply()
    try:
        torch.zeros(1, device="cuda")
        raised = False
    except Exception:  # noqa: BLE001
        raised = True
    return {"applied": applied, "factory_raised": raised}


def test_apply_is_idempotent_and_complete():
    out = run_world(_apply_twice, 1, timeout=120)[0]
    assert set(out["first"]) == {"device", "rng", "sp_norm", "factory", "clip_grad", "streams", "checkpoint"}
    assert out["second"] == out["first"] and out["same"]
    assert out["device"] == "cpu" and out["zeros_on_cpu"] == "cpu"
    assert out["tracker"] == "_CPURNGStatesTracker"


def test_a_shim_can_be_skipped():
    out = run_world(_skip_factory, 1, timeout=120, env={"PARADYSE_CPU_SHIMS_SKIP": "factory"})[0]
    assert "factory" not in out["applied"] and out["factory_raised"]


def test_nothing_is_patched_on_a_process_that_chose_a_gpu(monkeypatch):
    """Where the device decision is CUDA, neither layer applies a shim (no CUDA is needed to
    show it: the decision is faked, and apply must return before touching anything)."""
    import torch

    from megatron_paradyse import cpu_compat, cpu_compat_training, device

    monkeypatch.setattr(device, "_CHOSEN", [torch.device("cuda", 0)])
    before = (torch.zeros, torch.cuda.current_device, torch.Tensor.cuda)
    assert not cpu_compat.needed() and cpu_compat.apply() == ()
    assert not cpu_compat_training.needed() and cpu_compat_training.apply() == ()
    assert (torch.zeros, torch.cuda.current_device, torch.Tensor.cuda) == before
