"""Run the same batches through stock megatron-core TP=1 and through the plugin at TP=p.

Every comparison is against stock megatron-core built from the same seed: loss, full logits
and every parameter's gradient gathered to its TP=1 shape. At p > 1 every plugin pass also
proves that each layer ran its planned strategy and not stock code: :func:`observe` counts
the strategy's own collectives and kernels inside each attention and MLP forward, and
:func:`signature` says what each strategy must show (a rank raises on any difference).
"""
from __future__ import annotations

import contextlib
from collections import Counter

REL_TOL = 1e-5
KINDS = ("all_to_all", "p2p", "broadcast", "weight_gather", "sdpa", "varlen", "relayout")


@contextlib.contextmanager
def observe(model):
    """Count, per decoder layer and module, the calls made inside its forward to
    ``all_to_all_single`` (Ulysses), ``batch_isend_irecv`` (rings), ``broadcast`` (METP),
    a ZeRO linear's taking of its gathered weight (``prefetch.weight``: prefetched or gathered
    there, one per linear), the balanced ring layout's
    exchange (``zigzag.exchange``, whose point-to-point calls count as ``p2p`` too) and torch's
    ``scaled_dot_product_attention`` (megatron's local spec never calls it) and the plugin's
    variable-length attention over a pack's documents (``varlen.forward``).

    Yields a dict ``{(layer index, "attention" | "mlp"): Counter}``.
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    from megatron_paradyse.parallel import dispatch, prefetch, varlen, zigzag

    records, current = {}, []
    targets = [(dist, "all_to_all_single", "all_to_all"), (dist, "batch_isend_irecv", "p2p"),
               (dist, "broadcast", "broadcast"), (prefetch, "weight", "weight_gather"),
               (zigzag, "exchange", "relayout"), (F, "scaled_dot_product_attention", "sdpa"),
               (varlen, "forward", "varlen")]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in targets]

    def counting(fn, kind):
        def wrapper(*args, **kwargs):
            if current:
                records[current[-1]][kind] += 1
            return fn(*args, **kwargs)
        return wrapper

    handles = []
    for i, layer in enumerate(dispatch.unwrap(model).decoder.layers):
        for key, module in ((i, "attention"), layer.self_attention), ((i, "mlp"), layer.mlp):
            records[key] = Counter()
            handles.append(module.register_forward_pre_hook(lambda *_, k=key: current.append(k)))
            handles.append(module.register_forward_hook(lambda *_: current.pop() and None))
    for (mod, attr, kind), (_, _, fn) in zip(targets, saved):
        setattr(mod, attr, counting(fn, kind))
    try:
        yield records
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)
        for h in handles:
            h.remove()


def signature(name, module: str, p: int, config) -> Counter:
    """What strategy ``name`` (None: stock megatron) calls in one attention or MLP forward at p > 1."""
    zero_mlp = Counter(weight_gather=2)  # fc1 and fc2 gathered just in time
    if module == "mlp":
        return {"ulysses": zero_mlp, "ring": zero_mlp, "colossal": zero_mlp,
                "metp": Counter(p2p=p - 1)}.get(name, Counter())  # tp_sp's MLP is megatron's own
    # the ring strategies re-lay out their tokens to the balanced split and back: two
    # exchanges (with p even and s/p >= 2 every rank has a partner to swap with)
    relayout = 2 if p % 2 == 0 else None
    return {
        None: Counter(),
        "tp_sp": Counter(sdpa=1),
        "ulysses": Counter(all_to_all=4, weight_gather=2, sdpa=1),  # q, k, v and the output
        "ring": Counter(p2p=p - 1 + relayout, weight_gather=2, relayout=relayout),
        # a K ring, then a V ring
        "colossal": Counter(p2p=2 * (p - 1) + relayout, weight_gather=2, relayout=relayout),
        # per head group: one broadcast of W_qkv, W_proj (and b_qkv) flat, a ring attention of p-1 hops
        "metp": Counter(broadcast=p, p2p=p * (p - 1) + relayout,
                        relayout=relayout),
    }[name]


def check_strategies_ran(records, plan, p: int, config) -> None:
    """Raise unless every layer's modules made exactly the calls of the strategy it was given."""
    wrong = []
    for (layer, module), seen in sorted(records.items()):
        name = plan[layer] if plan is not None else None
        want = signature(name, module, p, config)
        if +seen != +want:
            wrong.append(f"layer {layer} {module} planned {name}: expected {dict(want)}, saw {dict(seen)}")
    if wrong:
        raise AssertionError("strategy did not run as planned:\n" + "\n".join(wrong))


def _pass(model, spec, batch, seq, seed, plan=None, check=False):
    from megatron_paradyse.testing import models as T

    model.zero_grad(set_to_none=True)
    tok, lab = T.make_batch(spec, batch, seq, seed=seed)
    with observe(model) as records:
        loss, logits = T.forward_backward(model, tok, lab)
    if check:
        p = model.config.tensor_model_parallel_size
        check_strategies_ran(records, plan, p, model.config)
    T.allreduce_sequence_parallel_grads(model)
    return {"loss": loss, "logits": logits, "grads": T.gather_full(model, "grad", gated_fc1=spec.swiglu)}


def run_cases(rank, world, cases):
    """In each rank (TP = world): for each case build one model, then run each of its passes.

    A case is ``(spec_kwargs, [(plan, batch, seq, seed), ...])``; plan ``None`` runs stock
    megatron-core code; a world whose passes are all ``None`` never installs the plugin, so the
    reference is untouched megatron-core. ``spec_kwargs["config"]`` (optional) sets
    TransformerConfig fields on the built model. At p > 1 each pass checks that every layer
    ran its planned strategy (:func:`check_strategies_ran`). Returns the results of rank 0.
    """
    import megatron_paradyse as mp
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    plugin = any(plan is not None for _, passes in cases for plan, *_ in passes)
    if plugin:
        mp.install()
    results = []
    for spec_kw, passes in cases:
        spec_kw = dict(spec_kw)
        overrides = spec_kw.pop("config", {})
        spec = T.TinyGPT(**spec_kw)
        model = T.build_gpt(spec, world)
        for key, value in overrides.items():
            setattr(model.config, key, value)
        if overrides.get("bias_activation_fusion"):
            import torch._dynamo

            # megatron's fused activations are torch.compile'd: eager here (same math), since
            # compiling them on CPU takes a minute
            torch._dynamo.config.disable = True
        out = []
        for plan, batch, seq, seed in passes:
            if plugin:
                plan = mp.set_plan(model, plan)
            out.append(_pass(model, spec, batch, seq, seed, plan, check=world > 1))
        results.append(out)
    return results if rank == 0 else None


def stock(cases):
    """The same cases with every plan replaced by stock megatron code: the reference at TP=1."""
    return [(spec_kw, [(None, *rest) for _, *rest in passes]) for spec_kw, passes in cases]


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def worst_errors(got: dict, ref: dict) -> dict:
    errs = {"loss": rel_err(got["loss"], ref["loss"]), "logits": rel_err(got["logits"], ref["logits"])}
    grad_errs = {k: rel_err(got["grads"][k], ref["grads"][k]) for k in ref["grads"]}
    assert set(got["grads"]) == set(ref["grads"])
    worst = max(grad_errs, key=grad_errs.get)
    errs["grad"] = grad_errs[worst]
    errs["worst_grad"] = worst
    return errs


def assert_exact(got: dict, ref: dict, label: str) -> dict:
    errs = worst_errors(got, ref)
    for key in ("loss", "logits", "grad"):
        assert errs[key] < REL_TOL, f"{label}: {key} rel. error {errs[key]:.2e} ({errs})"
    return errs
