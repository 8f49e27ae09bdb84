"""``metp`` (memory-efficient TP) against stock megatron-core with TP=1.

One reference world (1 rank: stock TP=1, and the plugin's own p=1 METP path) and one world
each at p=2 and p=4; every world runs all its cases in one spawn. Loss, logits and every
parameter gradient (gathered to its TP=1 shape) must match the stock TP=1 model built from
the same seed to a relative error below 1e-5 (fp32). The p>1 worlds also check the memory
contract: nothing autograd saves in forward aliases a pooled communication buffer, and each
METP autograd node keeps only its input ``[s/p, b, h]`` and the rank's own parameter shards.
"""
from __future__ import annotations

import pytest

from megatron_paradyse.testing.spawn import run_world

from .exactness import assert_exact, check_strategies_ran, observe

MHA_GELU = dict()
GQA_SWIGLU_NOBIAS = dict(swiglu=True, num_attention_heads=8, num_query_groups=4, bias=False)
GQA2_GELU_NOBIAS = dict(num_attention_heads=8, num_query_groups=2, bias=False)
MHA_SWIGLU_BIAS = dict(swiglu=True, num_layers=3)

# (spec kwargs, batch, seq, plan): MHA and GQA (one query group per rank included), GELU and
# SwiGLU, bias on and off, b = 1 and 2, s/p odd or not a power of two, mixed plans
CASES = {
    2: [
        (MHA_GELU, 2, 30, "metp"),
        (GQA_SWIGLU_NOBIAS, 1, 30, ["metp", "ring"]),
        (GQA2_GELU_NOBIAS, 2, 22, "metp"),
        (MHA_SWIGLU_BIAS, 1, 24, ["tp_sp", "metp", "ulysses"]),
    ],
    4: [
        (MHA_GELU, 2, 24, ["metp", "ring"]),
        (GQA_SWIGLU_NOBIAS, 1, 36, "metp"),
        (MHA_SWIGLU_BIAS, 1, 36, ["metp", "tp_sp", "metp"]),
    ],
}
# stock megatron-core TP=1 is the reference; the plugin's p=1 METP path runs on the same model
CASES[1] = sorted({(tuple(sorted(kw.items())), b, s) for p in (2, 4) for kw, b, s, _ in CASES[p]})


def _pool_and_param_storages(model):
    from megatron.core import parallel_state

    from megatron_paradyse.parallel.buffers import POOL_PREFIX

    pool = {t.untyped_storage().data_ptr()
            for (name, _), t in parallel_state.get_global_memory_buffer().buffer.items()
            if name.startswith(POOL_PREFIX)}
    return pool, {p.untyped_storage().data_ptr() for p in model.parameters()}


def _graph_nodes(t):
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return seen


def _pass(model, spec, batch, seq, check_memory):
    """Forward (saved tensors recorded) and backward; loss, full logits, full grads, findings.

    With ``check_memory`` (p > 1) the pass also proves each layer ran its planned strategy.
    """
    import torch

    from megatron_paradyse.testing import models as T

    model.zero_grad(set_to_none=True)
    tokens, labels = T.make_batch(spec, batch, seq, seed=5)
    saved, logits = [], {}
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    handle = model.output_layer.register_forward_hook(
        lambda _m, _i, out: logits.__setitem__("v", out[0] if isinstance(out, tuple) else out))
    try:
        with hooks, observe(model) as records:
            per_token = model(tokens, torch.arange(seq).unsqueeze(0).expand_as(tokens), None,
                              labels=labels)
    finally:
        handle.remove()
    if check_memory:
        import megatron_paradyse as mp

        check_strategies_ran(records, mp.get_plan(model), model.config.tensor_model_parallel_size,
                             model.config)
    loss = per_token.float().mean()
    nodes = _graph_nodes(loss)
    names = {type(n).__name__ for n in nodes}
    problems = []
    if check_memory:
        pool, params = _pool_and_param_storages(model)
        problems += [f"saved tensor {tuple(t.shape)} aliases a pooled buffer"
                     for t in saved if t.untyped_storage().data_ptr() in pool]
        # a METP node keeps its input [s/p, b, h] and its own shards (parameters), nothing else
        local = (seq // model.config.tensor_model_parallel_size, batch, model.config.hidden_size)
        for node in nodes:
            if type(node).__name__ in ("METPAttentionBackward", "METPMLPBackward"):
                problems += [f"{type(node).__name__} saves {tuple(t.shape)}"
                             for t in node.saved_tensors if t is not None
                             and t.untyped_storage().data_ptr() not in params and tuple(t.shape) != local]
    del saved, nodes
    loss.backward()
    T.allreduce_sequence_parallel_grads(model)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    full_logits = logits["v"].detach()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        full_logits = gather_from_tensor_model_parallel_region(full_logits)
    return {"loss": loss.detach(), "logits": full_logits.transpose(0, 1).contiguous(),
            "grads": T.gather_full(model, "grad", gated_fc1=spec.swiglu),
            "nodes": names, "problems": problems}


def _world(rank, world, cases):
    import megatron_paradyse as mp
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    mp.install()
    results = []
    for kw, batch, seq, plan in cases:
        spec = T.TinyGPT(**dict(kw))
        model = T.build_gpt(spec, world)
        if world == 1:  # stock TP=1 first, then the plugin's METP on the same weights
            results.append([_pass(model, spec, batch, seq, False)])
            mp.set_plan(model, "metp")
            results[-1].append(_pass(model, spec, batch, seq, False))
        else:
            mp.set_plan(model, plan)
            results.append(_pass(model, spec, batch, seq, True))
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def reference():
    out = run_world(_world, 1, [(kw, b, s, None) for kw, b, s in CASES[1]], timeout=300)[0]
    return {key: res for key, res in zip(CASES[1], out)}


def test_metp_p1_matches_stock_tp1(reference):
    for (kw, b, s), (stock, metp) in reference.items():
        assert "METPAttentionBackward" in metp["nodes"] and "METPMLPBackward" in metp["nodes"]
        errs = assert_exact(metp, stock, f"p=1 {dict(kw)} b={b} s={s}")
        print(f"p=1 {dict(kw)} b={b} s={s}: loss {errs['loss']:.1e} logits {errs['logits']:.1e} "
              f"grad {errs['grad']:.1e}")


@pytest.mark.parametrize("p", [2, 4])
def test_metp_matches_stock_tp1(p, reference):
    got = run_world(_world, p, [(tuple(sorted(kw.items())), b, s, plan) for kw, b, s, plan in CASES[p]],
                    timeout=600)[0]
    worst = 0.0
    for (kw, b, s, plan), g in zip(CASES[p], got):
        label = f"p={p} {kw} b={b} s={s} plan={plan}"
        assert "METPAttentionBackward" in g["nodes"] and "METPMLPBackward" in g["nodes"], label
        assert not g["problems"], f"{label}: {g['problems']}"
        errs = assert_exact(g, reference[(tuple(sorted(kw.items())), b, s)][0], label)
        worst = max(worst, errs["loss"], errs["logits"], errs["grad"])
        print(f"{label}: loss {errs['loss']:.1e} logits {errs['logits']:.1e} grad {errs['grad']:.1e}")
    print(f"p={p}: worst rel. error {worst:.2e}")


def test_metp_needs_whole_query_groups_per_rank():
    import megatron_paradyse as mp
    from megatron_paradyse.testing.models import TinyGPT

    cfg = TinyGPT(**GQA2_GELU_NOBIAS).transformer_config(4, True)
    ok, why = mp.supports("metp", cfg, 4)
    assert not ok and "num_query_groups" in why
    assert mp.supports("metp", TinyGPT(**GQA2_GELU_NOBIAS).transformer_config(2, True), 2) == (True, "")
    assert mp.supports("metp", TinyGPT(**GQA_SWIGLU_NOBIAS).transformer_config(4, True), 4) == (True, "")
