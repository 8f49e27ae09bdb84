"""Gradient-accumulation fusion (Megatron-LM's default) in the gathered-weight strategies.

megatron's fused linear adds its weight gradient into ``weight.main_grad`` (DDP's buffer) and
returns a dummy gradient after setting ``weight.grad_added_to_main_grad``, so that DDP's
backward hook does not add it again. The strategies that compute weight gradients themselves
(``ulysses``, ``ring``, ``colossal`` through ``zero3.ZeroLinear``; ``metp``) do the same.

On CPU megatron's own fused path cannot run (it needs apex's CUDA kernel), so the model is
built with fusion off, wrapped in megatron-core's ``DistributedDataParallel`` (which creates
``main_grad``), and then ``gradient_accumulation_fusion`` is switched on in the linears of the
layers that a gathered-weight strategy runs (the attribute megatron's linears and the
strategies read at forward time); ``tp_sp`` layers keep megatron's unfused path. Each
parameter's ``main_grad`` after two micro-batches must equal stock megatron TP+SP's.
"""
import time

from megatron_paradyse.testing.spawn import run_world

LINEARS = (("self_attention", "linear_qkv"), ("self_attention", "linear_proj"),
           ("mlp", "linear_fc1"), ("mlp", "linear_fc2"))
LAYERS = 4
# per case: the plan of each of the two micro-batches (None: stock megatron, no fusion)
CASES = {
    "stock": (None, None),
    "ulysses": ("ulysses", "ulysses"),
    "ring": ("ring", "ring"),
    "colossal": ("colossal", "colossal"),
    "metp": ("metp", "metp"),
    # layer 1 stays tp_sp (unfused); the others change strategy between micro-batches
    "mixed": (["colossal", "tp_sp", "metp", "ring"], ["ulysses", "tp_sp", "ring", "metp"]),
}


def _world(rank, world):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import megatron_paradyse as mp
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    mp.install()
    spec = T.TinyGPT(num_layers=LAYERS, swiglu=True)
    model = T.build_gpt(spec, world)
    assert not model.config.gradient_accumulation_fusion
    ddp = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(),
                                  module=model)
    params = dict(model.named_parameters())
    grads, flags = {}, {}
    for case, plans in CASES.items():
        ddp.zero_grad_buffer()
        first = mp.set_plan(model, plans[0])  # the plan as a tuple, or None
        fused = [first is not None and first[i] != "tp_sp" for i in range(LAYERS)]
        for i, layer in enumerate(model.decoder.layers):
            for mod, lin in LINEARS:
                getattr(getattr(layer, mod), lin).gradient_accumulation_fusion = fused[i]
        if case == "mixed":  # megatron's other dummy: zeros, which DDP's hook adds anyway
            model.decoder.layers[0].mlp.linear_fc1.weight.zero_out_wgrad = True
        for mb, plan in enumerate(plans):
            mp.set_plan(model, plan)
            tok, lab = T.make_batch(spec, 2, 8 * world, seed=mb)
            T.forward_backward(model, tok, lab)
        if case == "mixed":
            del model.decoder.layers[0].mlp.linear_fc1.weight.zero_out_wgrad
        assert all(p.grad is None for p in params.values()), case  # DDP's hook took every grad
        grads[case] = {n: p.main_grad.detach().clone() for n, p in params.items()}
        flags[case] = {n: p.grad_added_to_main_grad for n, p in params.items()}
    mp.set_plan(model, None)
    errs = {}
    for case in CASES:
        errs[case] = {n: ((g - grads["stock"][n]).norm() / grads["stock"][n].norm().clamp_min(1e-30)).item()
                      for n, g in grads[case].items()}
    return {"errs": errs, "flags": flags, "dtypes": {str(g.dtype) for g in grads["stock"].values()}}


def test_gathered_weight_strategies_accumulate_into_main_grad():
    t0 = time.monotonic()
    out = run_world(_world, 2, timeout=240)
    took = time.monotonic() - t0
    for res in out:
        assert res["dtypes"] == {"torch.float32"}
        for case, errs in res["errs"].items():
            worst = max(errs, key=errs.get)
            assert errs[worst] < 1e-5, f"{case}: main_grad of {worst} rel. error {errs[worst]:.2e}"
        for case, plans in CASES.items():
            flags = res["flags"][case]
            for name, added in flags.items():
                layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else None
                fused_layer = (case not in ("stock", "mixed")) or (case == "mixed" and layer != 1)
                weight = name.endswith(".weight") and any(f".{lin}." in name for _, lin in LINEARS)
                want = bool(layer is not None and fused_layer and weight)
                assert added == want, (case, name, added)
    assert took < 120, took
