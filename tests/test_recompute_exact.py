"""Recompute: every strategy and random mixed plans, planned recompute (``:rc`` entries, and
``:rc-attn`` / ``:rc-mlp``: the layer's attention or MLP block alone) and
megatron's own recompute flags, equal stock megatron-core TP = 1 under the same flags (fp32,
relative error < 1e-5) at p = 2 and 4, one sequence per row and packed.

Each plugin pass sets another plan between its forward and its backward (as a pipeline
schedule does), so a recompute that re-ran the plan set at backward time would run other
strategies: the collectives counted per layer and module (``exactness.observe``: forward hooks
fire again in a recompute) must be the forward plan's, once more for every recomputed module.
"""
import functools
import random
from collections import Counter

import pytest

import megatron_paradyse as mp
from megatron_paradyse.testing.spawn import run_world

from .exactness import REL_TOL, observe, rel_err, signature

SPEC = dict(num_layers=3, hidden_size=64, num_attention_heads=8, num_query_groups=4, swiglu=True, bias=False)
# megatron's flag sets (TransformerConfig fields): full uniform and block, selective
FLAGS = {
    "none": {},
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-3": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    "full-block-2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
}

# layernorm recompute is not here: megatron-core's CheckpointWithoutOutput (0.16 and 0.19) calls
# Transformer Engine's FP8GlobalStateManager whatever fp8 says (a NameError without it)
PACK = (5, 17, 1, 9)
SEQ = 24


def recomputed(flags: dict, plan, layer: int, module: str, num_layers: int) -> bool:
    """Whether ``module`` of ``layer`` runs again in the backward under ``flags`` and ``plan``."""
    g = flags.get("recompute_granularity")
    if g == "full" and (flags["recompute_method"] == "uniform" or layer < flags["recompute_num_layers"]):
        return True  # megatron's checkpoint (a plan's :rc inside it adds nothing)
    entry = plan[layer] if plan is not None else ""
    if entry.endswith(":rc"):
        return True  # the whole layer, once
    if entry.endswith(":rc-attn") and module == "attention" or entry.endswith(":rc-mlp") and module == "mlp":
        return True  # the entry's block, once (megatron's selective mlp inside it adds nothing)
    return g == "selective" and module == "mlp" and "mlp" in flags["recompute_modules"]


def _batch(spec, packed, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    if not packed:
        tok = torch.randint(0, spec.vocab_size, (1, SEQ + 1), generator=g)
        pos = torch.arange(SEQ).unsqueeze(0)
        return tok[:, :-1], tok[:, 1:], pos, None
    from megatron.core.packed_seq_params import PackedSeqParams

    docs = [torch.randint(0, spec.vocab_size, (d + 1,), generator=g) for d in PACK]
    tok = torch.cat([d[:-1] for d in docs]).unsqueeze(0)
    lab = torch.cat([d[1:] for d in docs]).unsqueeze(0)
    pos = torch.cat([torch.arange(d) for d in PACK]).unsqueeze(0)
    cu = torch.tensor([0] + [sum(PACK[:i + 1]) for i in range(len(PACK))], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(PACK), max_seqlen_kv=max(PACK))
    return tok, lab, pos, params


def _loss(model, tok, lab, pos, params, packed):
    """Per-token losses: of the whole row, or (stock TP = 1, packed) of each document alone."""
    import torch

    if params is not None or not packed:
        kw = {} if params is None else {"packed_seq_params": params}
        return model(tok, pos, None, labels=lab, **kw)[0]
    out, at = [], 0
    for d in PACK:
        out.append(model(tok[:, at:at + d], torch.arange(d).unsqueeze(0), None, labels=lab[:, at:at + d])[0])
        at += d
    return torch.cat(out)


def _pass(model, spec, flags, plan, other, packed, seed):
    """One forward under ``plan``, ``other`` set before the backward; the per-token losses, the
    gradients gathered to TP = 1 and, at p > 1, the check of what each module ran."""
    from megatron_paradyse.testing import models as T

    model.zero_grad(set_to_none=True)
    tok, lab, pos, params = _batch(spec, packed, seed)
    if plan is None:
        params = None  # stock local attention refuses packs: document by document
    with observe(model) as records:
        losses = _loss(model, tok, lab, pos, params, packed)
        if plan is not None:
            mp.set_plan(model, other)
        losses.float().sum().backward()
    p = model.config.tensor_model_parallel_size
    if plan is not None and p > 1:
        _check(records, plan, flags, model.config, packed)
    T.allreduce_sequence_parallel_grads(model)
    return {"loss": losses.detach(), "grads": T.gather_full(model, "grad", gated_fc1=spec.swiglu)}


def _check(records, plan, flags, config, packed):
    from .test_packed_exact import packed_signature
    import torch.distributed as dist

    p, wrong = config.tensor_model_parallel_size, []
    for (layer, module), seen in sorted(records.items()):
        name = plan[layer].split(":")[0]
        one = (packed_signature(name, module, p, config, PACK, dist.get_rank()) if packed
               else signature(name, module, p, config))
        times = 2 if recomputed(flags, plan, layer, module, len(plan)) else 1
        want = Counter({k: v * times for k, v in one.items()})
        if +seen != +want:
            wrong.append(f"layer {layer} {module} {plan[layer]}: expected {dict(want)}, saw {dict(seen)}")
    if wrong:
        raise AssertionError(f"flags {flags}: the recompute did not re-run the forward's plan:\n" + "\n".join(wrong))


def run_recompute(rank, world, cases):
    """Per flag set one model (megatron reads its recompute flags when it builds the layers),
    then its passes ``(plan, other, packed, seed)``; plan None: stock."""
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    if world > 1:
        mp.install()
    spec = T.TinyGPT(**SPEC)
    out = []
    for key, passes in cases:
        model = T.build_gpt(spec, world, **FLAGS[key])
        model.train()
        res = []
        for plan, other, packed, seed in passes:
            if plan is not None:
                plan = mp.set_plan(model, plan)
            res.append(_pass(model, spec, FLAGS[key], plan, other, packed, seed))
        out.append(res)
    return out if rank == 0 else None


def _cases(p):
    rng = random.Random(31 + p)
    kinds = ("", ":rc", ":rc-attn", ":rc-mlp")
    entries = [s + kind for s in mp.STRATEGIES for kind in kinds]
    cases = []
    for k, key in enumerate(FLAGS):
        uniform = [s + kinds[(i + k) % 4] for i, s in enumerate(mp.STRATEGIES)]
        uniform += [s + kinds[(i + k + 2) % 4] for i, s in enumerate(mp.STRATEGIES)]
        mixed = [[rng.choice(entries) for _ in range(SPEC["num_layers"])] for _ in range(2)]
        plans = uniform + mixed
        passes = []
        for j, plan in enumerate(plans):
            names = [plan] * SPEC["num_layers"] if isinstance(plan, str) else plan
            # the plan set before the backward: every layer on another strategy
            other = [mp.STRATEGIES[(mp.STRATEGIES.index(n.split(":")[0]) + 1) % 5] for n in names]
            passes.append((names, other, (j + k) % 2 == 1, 100 * k + j))
        cases.append((key, passes))
    return cases


@functools.lru_cache(maxsize=None)
def _reference(ref_cases: tuple):
    """Stock TP = 1 on the passes' batches (the same for every p: computed once)."""
    return run_world(run_recompute, 1, [(key, list(passes)) for key, passes in ref_cases], timeout=300)[0]


@pytest.mark.parametrize("p", [2, pytest.param(4, marks=pytest.mark.slow(
    reason="p = 2 runs every strategy and recompute case; p = 4 repeats them on 4 ranks"))])
def test_recompute_matches_stock_tp1_with_the_forward_plan(p):
    cases = _cases(p)
    ref = _reference(tuple((key, tuple((None, None, packed, seed) for _, _, packed, seed in passes))
                           for key, passes in cases))
    got = run_world(run_recompute, p, cases, timeout=600, trace=True)[0]
    covered, worst = set(), 0.0
    for (key, passes), r_case, g_case in zip(cases, ref, got):
        for (plan, _, packed, _), r, g in zip(passes, r_case, g_case):
            label = f"p={p} flags={key} plan={plan} packed={packed}"
            err = rel_err(g["loss"], r["loss"])
            assert err < REL_TOL, f"{label}: loss rel. error {err:.2e}"
            assert set(g["grads"]) == set(r["grads"])
            gerr, name = max((rel_err(g["grads"][n], r["grads"][n]), n) for n in r["grads"])
            assert gerr < REL_TOL, f"{label}: grad {name} rel. error {gerr:.2e}"
            worst = max(worst, err, gerr)
            covered.update(plan)
    assert covered >= set(mp.STRATEGIES) | {f"{s}:rc" for s in mp.STRATEGIES}
    print(f"p={p}: {sum(len(c[1]) for c in cases)} passes over {len(FLAGS)} flag sets, worst rel. error {worst:.2e}")
