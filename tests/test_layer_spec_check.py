"""Modules other than megatron-core's local layer spec are refused by name, for every strategy.

Transformer Engine's spec (Megatron-LM's default) builds ``TELayerNormColumnParallelLinear``
(the input LayerNorm fused into ``linear_qkv`` / ``linear_fc1``, ``input_layernorm`` an
``IdentityOp``), ``TEDotProductAttention`` and ``TERowParallelLinear``: the gathered-weight
strategies would skip the fused norm, and ``tp_sp`` would replace TE's attention. ``set_plan``
checks the decoder layers' module types (exact types: a subclass is not megatron's module)
once per model, before any collective, and ``mp.supports_model`` says the same without raising.
No Transformer Engine here: stand-in classes with TE's names take the modules' place.
"""
import megatron_paradyse as mp
from megatron_paradyse.testing.spawn import run_world


def _swap_class(module, name):
    """Give ``module`` a subclass of its own class named ``name`` (a stand-in for TE's module)."""
    module.__class__ = type(name, (type(module),), {})


def _world(rank, world):
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_paradyse.parallel import dispatch
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    mp.install()
    spec = T.TinyGPT(num_layers=2)
    model = T.build_gpt(spec, world)
    assert mp.supports_model(model) == (True, "")
    layer0, layer1 = model.decoder.layers
    attn, mlp = layer0.self_attention, layer1.mlp

    def fused_norm():
        _swap_class(attn.linear_qkv, "TELayerNormColumnParallelLinear")

    def te_attention():
        _swap_class(attn.core_attention, "TEDotProductAttention")

    def te_row():
        _swap_class(mlp.linear_fc2, "TERowParallelLinear")

    def identity_norm():
        layer1.input_layernorm = IdentityOp()

    def qk_norm():
        attn.q_layernorm = layer0.input_layernorm

    cases = {  # what is changed, and the path the error must name
        "fused_norm": (fused_norm, "decoder.layers.0.self_attention.linear_qkv is TELayerNormColumnParallelLinear"),
        "te_attention": (te_attention, "decoder.layers.0.self_attention.core_attention is TEDotProductAttention"),
        "te_row": (te_row, "decoder.layers.1.mlp.linear_fc2 is TERowParallelLinear"),
        "identity_norm": (identity_norm, "decoder.layers.1.input_layernorm is IdentityOp"),
        "qk_norm": (qk_norm, "decoder.layers.0.self_attention.q_layernorm is LayerNorm"),
    }
    saved = {"qkv": type(attn.linear_qkv), "core": type(attn.core_attention), "fc2": type(mlp.linear_fc2),
             "norm": layer1.input_layernorm, "q": attn.q_layernorm}

    def restore():
        attn.linear_qkv.__class__, attn.core_attention.__class__ = saved["qkv"], saved["core"]
        mlp.linear_fc2.__class__ = saved["fc2"]
        layer1.input_layernorm, attn.q_layernorm = saved["norm"], saved["q"]
        model.__dict__.pop(dispatch._MODULES_CHECKED, None)  # a fresh model, as far as set_plan knows

    errors = {}
    for case, (change, _) in cases.items():
        change()
        errors[case] = {"supports_model": mp.supports_model(model)}
        for name in mp.STRATEGIES:
            try:
                mp.set_plan(model, name)
            except TypeError as e:
                errors[case][name] = str(e)
            else:
                errors[case][name] = None
            assert mp.get_plan(model) is None, (case, name)  # nothing was set
        mp.set_plan(model, None)  # stock megatron code needs no check
        restore()
    # the stock model runs every strategy after the refusals; the check ran once and is cached
    assert mp.set_plan(model, ["ulysses", "metp"]) == ("ulysses", "metp")
    assert getattr(model, dispatch._MODULES_CHECKED)
    tok, lab = T.make_batch(spec, 2, 4 * world, seed=0)
    loss, _ = T.forward_backward(model, tok, lab)
    return {"errors": errors, "loss": loss.item(), "cases": {k: v[1] for k, v in cases.items()}}


def test_non_local_spec_modules_are_refused_by_every_strategy():
    out = run_world(_world, 2, timeout=240)
    for res in out:
        for case, want in res["cases"].items():
            got = res["errors"][case]
            ok, why = got.pop("supports_model")
            assert not ok and want in why, (case, why)
            for name in mp.STRATEGIES:
                msg = got[name]
                assert msg is not None, f"{case}: {name} accepted the model"
                assert want in msg and "--transformer-impl local" in msg, (case, name, msg)
    assert out[0]["loss"] == out[1]["loss"]
