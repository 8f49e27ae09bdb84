"""Context parallelism: every strategy and random mixed plans at C = 2 x p = 2 (4 ranks) give
stock megatron-core TP = 1's loss, logits and every gradient on the same whole sequence, one
sequence per row and packed (fp32, relative error < 1e-5).

Stock megatron-core cannot run CP with its local attention (it needs Transformer Engine), so
the reference is stock TP = 1 without CP: whole sequences, and a pack document by document.
Every CP pass counts each layer's collectives against what its strategy must do: the in-node
strategy's (all-to-alls, weight gathers, re-layout, broadcasts) and the CP ring's hops
(``tp_sp`` / ``ulysses``: a ring over the CP group; the ring family: a two-level ring, an outer
ring over CP whose every step runs an inner ring over TP), with the hops a pack's documents do
not need skipped.
"""
import os
import random
from collections import Counter

import megatron_paradyse as mp
from megatron_paradyse.testing.spawn import run_world

from .exactness import REL_TOL, assert_exact, observe, rel_err
from .test_packed_exact import _hop_steps, _pack, _plugin_pass, _reference_pass

# CP x p: 2 x 2 in the suite; PARADYSE_CP_EXACT=4x2 (8 ranks) or 3x2 for a larger world by hand
C, P = (int(x) for x in os.environ.get("PARADYSE_CP_EXACT", "2x2").split("x"))
UNIT = 2 * C * P
SPECS = [
    dict(num_layers=3, hidden_size=64, num_attention_heads=4, bias=True),
    dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, swiglu=True, bias=False),
]
ROWS = [(2, 5 * UNIT), (1, 3 * UNIT)]           # (b, s): s a multiple of 2 x C x p
PACKS = [(1, 7, 13, 35), (3, 1, 50, 2, 8), (61, 3), (1,) * 9 + (31,), (12, 12, 12, 12), (64,)]
PACKS = [d[:-1] + (d[-1] + (-sum(d)) % UNIT,) for d in PACKS]  # totals a multiple of 2 x C x p
ALL = ("tp_sp", "ulysses", "ring", "colossal", "metp")


def _docs(lengths):
    from megatron_paradyse.parallel.packing import Documents

    bounds = [0]
    for d in lengths:
        bounds.append(bounds[-1] + d)
    return Documents(tuple(bounds))


def _two_level_steps(layout, c, t) -> int:
    """``batch_isend_irecv`` calls of one pass of the two-level ring (outer over CP, inner over
    TP) on rank (c, t): an outer call where an outer hop carries a block some later node needs,
    and per outer step an inner call where an inner hop does; from the blocks alone."""
    def needs(rank, src):
        return bool(layout.kernel_blocks(rank, src))

    def outer_last(sc, u):  # the last outer step at which a rank of some node needs (sc, u)
        return max((j for j in range(C) if any(needs(((sc + j) % C) * P + w, sc * P + u) for w in range(P))), default=0)

    def inner_last(j, u):  # node c at outer step j holds ((c - j) % C, u), if it came
        sc = (c - j) % C
        if j > outer_last(sc, u):
            return -1
        return max((s for s in range(P) if needs(c * P + (u + s) % P, sc * P + u)), default=0)

    calls = sum(1 for j in range(C - 1)
                if j + 1 <= outer_last((c - j) % C, t) or j + 1 <= outer_last((c - j - 1) % C, t))
    for j in range(C):
        calls += sum(1 for s in range(P - 1)
                     if s + 1 <= inner_last(j, (t - s) % P) or s + 1 <= inner_last(j, (t - s - 1) % P))
    return calls


def cp_signature(name, module, config, local, docs, cp_rank, tp_rank, batch=1) -> Counter:
    """What ``name`` calls in one attention or MLP forward under CP on this rank."""
    from megatron_paradyse.parallel import context

    if module == "mlp":
        zero = Counter(weight_gather=2)
        return {"ulysses": zero, "ring": zero, "colossal": zero, "metp": Counter(p2p=P - 1)}.get(name, Counter())
    inner = context.inner_layout(P, C, cp_rank, local, docs)
    if docs is None:
        swaps = 2 if inner.moves(tp_rank) else 0
        relayout = Counter(p2p=swaps, relayout=swaps)
    else:
        sends, recvs = inner.moves_plan(tp_rank)
        relayout = Counter(p2p=2 if (set(sends) | set(recvs)) - {tp_rank} else 0)
    cp_hops = _hop_steps(context.cp_layout(C, local, docs), cp_rank)
    joint_hops = _two_level_steps(context.joint_layout(C, P, local, docs), cp_rank, tp_rank)
    own = 1 if batch == 1 else 0  # one row's own keys (a pack's documents): one variable-length call
    return {
        "tp_sp": Counter(p2p=cp_hops, varlen=own),
        "ulysses": Counter(all_to_all=4, weight_gather=2, p2p=cp_hops, varlen=own),
        "ring": Counter(p2p=joint_hops, weight_gather=2, varlen=own) + relayout,
        "colossal": Counter(p2p=2 * joint_hops, weight_gather=2) + relayout,
        "metp": Counter(broadcast=P, p2p=P * joint_hops, varlen=P * own) + relayout,
    }[name]


def check_cp_ran(records, plan, config, local, docs, batch=1):
    from megatron.core import parallel_state as ps

    cp_rank, tp_rank = ps.get_context_parallel_rank(), ps.get_tensor_model_parallel_rank()
    wrong = []
    for (layer, module), seen in sorted(records.items()):
        want = cp_signature(plan[layer], module, config, local, docs, cp_rank, tp_rank, batch)
        if +seen != +want:
            wrong.append(f"layer {layer} {module} {plan[layer]}: expected {dict(want)}, saw {dict(seen)}")
    if wrong:
        raise AssertionError(f"CP rank {cp_rank} TP rank {tp_rank}:\n" + "\n".join(wrong))


def _row_pass(model, spec, plan, batch, seq, seed):
    from megatron_paradyse.testing import models as T

    tokens, labels = T.make_batch(spec, batch, seq, seed=seed)
    with observe(model) as records:
        loss, logits = T.forward_backward(model, tokens, labels)
    check_cp_ran(records, plan, model.config, seq // C, None, batch)
    return loss, logits


def _pack_pass(model, spec, plan, lengths, seed):
    """The pack's CP chunks through the model (boundaries of the whole pack), per-token losses
    and logits gathered over CP, gradients of the losses' sum."""
    from megatron.core import parallel_state as ps

    from megatron_paradyse.parallel import context

    tokens, labels, positions = _pack(lengths, spec.vocab_size, seed)
    rank, group = ps.get_context_parallel_rank(), ps.get_context_parallel_group()
    tokens, labels, positions = (context.split_for_cp(t, C, rank) for t in (tokens, labels, positions))
    loss, logits = _plugin_pass(model, lengths, tokens, labels, positions, plan,
                                check=lambda records: check_cp_ran(records, plan, model.config, sum(lengths) // C,
                                                                   _docs(lengths)))
    full = context.gather_from_cp(loss.unsqueeze(0), C, group, dim=1)[0]
    return full, context.gather_from_cp(logits, C, group, dim=0)


def run_cp(rank, world, cases):
    """Each case ``(spec_kwargs, [(plan, kind, shape, seed), ...])``, kind "rows" (shape (b, s))
    or "pack" (shape: the lengths). World 1: stock TP = 1; world C x p: the plugin at CP = C."""
    from megatron_paradyse.testing import models as T

    cp = C if world > 1 else 1
    T.init_megatron(world // cp, context_parallel_size=cp)
    if world > 1:
        mp.install()
    results = []
    for spec_kw, passes in cases:
        spec = T.TinyGPT(**spec_kw)
        model = T.build_gpt(spec, world // cp, context_parallel_size=cp)
        out = []
        sent = []  # the decoder's output shape: what a pipeline stage would send
        hook = model.decoder.register_forward_hook(lambda m, i, o: sent.append(list(o.shape)))
        for plan, kind, shape, seed in passes:
            model.zero_grad(set_to_none=True)
            sent.clear()
            if world > 1:
                plan = mp.set_plan(model, plan)
            if kind == "rows" and world == 1:
                loss, logits = T.forward_backward(model, *T.make_batch(spec, *shape, seed=seed))
            elif kind == "rows":
                loss, logits = _row_pass(model, spec, plan, *shape, seed)
            elif world == 1:
                loss, logits = _reference_pass(model, shape, *_pack(shape, spec.vocab_size, seed)[:2])
            else:
                loss, logits = _pack_pass(model, spec, plan, shape, seed)
            T.allreduce_sequence_parallel_grads(model)
            out.append({"loss": loss, "logits": logits, "grads": T.gather_full(model, "grad", gated_fc1=spec.swiglu),
                        "shape": (sent[:1], _expected_shape(kind, shape, spec, world))})
        hook.remove()
        results.append(out)
    if world > 1:  # a layer left to stock code refuses to attend within its CP rank only
        mp.set_plan(model, None)
        try:
            T.forward_backward(model, *T.make_batch(spec, *ROWS[0], seed=0))
        except NotImplementedError as e:
            results.append(str(e))
    return results if rank == 0 else results[-1:]


def _expected_shape(kind, shape, spec, world):
    """``training/p2p_shapes.micro_batch_shape`` of the pass's micro-batch on a CP rank: the p2p
    shape a pipeline stage would receive, to equal what the decoder put out."""
    import torch

    from megatron_paradyse.data.datasets import MicroBatch
    from megatron_paradyse.layout import ParallelDims
    from megatron_paradyse.training import p2p_shapes

    cp = C if world > 1 else 1
    b, s = shape if kind == "rows" else (1, sum(shape))
    bounds = None if kind == "rows" else tuple([0] + [sum(shape[:i + 1]) for i in range(len(shape))])
    z = torch.zeros(b, s, dtype=torch.long)
    mb = MicroBatch(z, z, z.float(), z, (s,) * b, cu_seqlens=bounds)
    return p2p_shapes.micro_batch_shape(mb, spec.hidden_size, ParallelDims(tp=world // cp, cp=cp, sequence_parallel=world > 1))


def _usable(spec_kw):
    from megatron_paradyse.testing.models import TinyGPT

    cfg = TinyGPT(**spec_kw).transformer_config(P, True)
    return [s for s in ALL if mp.supports(s, cfg, P)[0]]


def _cases():
    rng = random.Random(36)
    cases = []
    for i, spec_kw in enumerate(SPECS):
        n, usable = spec_kw["num_layers"], _usable(spec_kw)
        plans = usable + [[rng.choice(usable) for _ in range(n)] for _ in range(2)]
        passes = [(plan, "rows", ROWS[j % len(ROWS)], 100 * i + j) for j, plan in enumerate(plans)]
        passes += [(plan, "pack", PACKS[(j + i) % len(PACKS)], 200 * i + j) for j, plan in enumerate(plans)]
        cases.append((spec_kw, passes))
    return cases


def _stock(cases):
    return [(spec_kw, [(None, *rest) for _, *rest in passes]) for spec_kw, passes in cases]


def test_every_strategy_and_mixed_plans_under_cp_match_stock_tp1():
    cases = _cases()
    ref = run_world(run_cp, 1, _stock(cases), timeout=300)[0]
    ranks = run_world(run_cp, C * P, cases, timeout=600, env={"PARADYSE_CP_EXACT": f"{C}x{P}"}, trace=True)
    for r in ranks:  # every rank refused the stock layer
        assert "cannot attend across CP ranks" in r.pop(), "stock attention ran under CP"
    got = ranks[0]
    worst = {}
    for (spec_kw, passes), ref_case, got_case in zip(cases, ref, got):
        for (plan, kind, shape, _), r, g in zip(passes, ref_case, got_case):
            label = f"{spec_kw} {plan} {kind} {shape}"
            sent, expected = g["shape"]
            assert sent == [expected], f"{label}: the decoder put out {sent}, a stage would receive {expected}"
            if kind == "rows":
                errs = assert_exact(g, r, label)
            else:
                errs = {"loss": rel_err(g["loss"], r["loss"]), "logits": rel_err(g["logits"], r["logits"]),
                        "grad": max(rel_err(g["grads"][k], r["grads"][k]) for k in r["grads"])}
                assert max(errs.values()) < REL_TOL, f"{label}: {errs}"
            for key in ("loss", "logits", "grad"):
                worst[(kind, key)] = max(worst.get((kind, key), 0.0), errs[key])
    print(f"worst rel. errors at CP = {C} x p = {P}:", {f"{k} {w}": f"{v:.1e}" for (k, w), v in sorted(worst.items())})
