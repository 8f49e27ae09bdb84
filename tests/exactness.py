"""Run the same batches through stock megatron-core TP=1 and through the plugin at TP=p.

Every comparison is against stock megatron-core built from the same seed: loss, full logits
and every parameter's gradient gathered to its TP=1 shape.
"""
from __future__ import annotations

REL_TOL = 1e-5


def _pass(model, spec, batch, seq, seed):
    from megatron_paradyse.testing import models as T

    model.zero_grad(set_to_none=True)
    tok, lab = T.make_batch(spec, batch, seq, seed=seed)
    loss, logits = T.forward_backward(model, tok, lab)
    T.allreduce_sequence_parallel_grads(model)
    return {"loss": loss, "logits": logits, "grads": T.gather_full(model, "grad", gated_fc1=spec.swiglu)}


def run_cases(rank, world, cases):
    """In each rank (TP = world): for each case build one model, then run each of its passes.

    A case is ``(spec_kwargs, [(plan, batch, seq, seed), ...])``; plan ``None`` runs stock
    megatron-core code; a world whose passes are all ``None`` never installs the plugin, so the
    reference is untouched megatron-core. Returns the results of rank 0.
    """
    import megatron_paradyse as mp
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    plugin = any(plan is not None for _, passes in cases for plan, *_ in passes)
    if plugin:
        mp.install()
    results = []
    for spec_kw, passes in cases:
        spec = T.TinyGPT(**spec_kw)
        model = T.build_gpt(spec, world)
        out = []
        for plan, batch, seq, seed in passes:
            if plugin:
                mp.set_plan(model, plan)
            out.append(_pass(model, spec, batch, seq, seed))
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
