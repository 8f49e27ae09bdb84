"""The harness proves itself on stock megatron-core: TP=2 + SP equals TP=1 (no plugin)."""
from megatron_paradyse.testing.spawn import run_world

from .exactness import assert_exact


def _stock(rank, world, spec_kw, batch, seq):
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    spec = T.TinyGPT(**spec_kw)
    model = T.build_gpt(spec, world)
    tok, lab = T.make_batch(spec, batch, seq, seed=3)
    loss, logits = T.forward_backward(model, tok, lab)
    T.allreduce_sequence_parallel_grads(model)
    return {"loss": loss, "logits": logits, "grads": T.gather_full(model, "grad", gated_fc1=spec.swiglu)}


def test_stock_tp2_sp_equals_tp1():
    spec_kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
    ref = run_world(_stock, 1, spec_kw, 2, 32, timeout=240)[0]
    out = run_world(_stock, 2, spec_kw, 2, 32, timeout=240)
    for r, got in enumerate(out):
        assert_exact(got, ref, f"stock TP=2+SP rank {r}")
    assert ref["grads"]["decoder.layers.0.mlp.linear_fc1.weight"].abs().sum() > 0
