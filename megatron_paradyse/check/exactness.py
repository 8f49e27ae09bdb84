"""The check's exactness section: every strategy and three mixed plans (one recomputes layers)
against stock megatron-core TP = 1 on the same weights and batch, in this world.

Reference first: each rank builds the stock model at TP = 1 (every rank computes the same
reference), then the model at TP = p with the same seed and CPU initialisation (shards of the
same weights) runs stock TP+SP and every plan. fp32: loss, logits and every parameter's
gradient within ``FP32_TOL`` of the fp32 reference. bf16: each plan's distance from the fp32
reference is at most twice stock megatron-core's own bf16 distance (TP+SP at p > 1, TP = 1 at
p = 1) plus ``BF16_SLACK``.
"""
from __future__ import annotations

import torch

from ..device import current
from ..model import build_gpt
from ..parallel import megatron_state
from ..parallel.dispatch import install, installed, set_plan
from ..parallel.plans import describe, make_entry
from ..parallel.strategies import STRATEGIES, supports
from .compare import allreduce_sequence_parallel_grads, errors, forward_backward, gather_full
from .results import SKIP, Line

FP32_TOL = 1e-5
BF16_SLACK = 1e-3


def mixed_plans(num_layers: int, names) -> list:
    """Two per-layer mixes of ``names``, cycled from the first and from the ``num_layers``-th:
    with ``2 * num_layers >= len(names)`` every strategy is in one of them. A third mix is the
    first with every other layer recomputed in backward (``:rc``), which re-runs its strategy."""
    names = list(names)
    mixes = [[names[(i + start) % len(names)] for i in range(num_layers)] for start in (0, num_layers)]
    return mixes + [[make_entry(n, i % 2 == 0) for i, n in enumerate(mixes[0])]]


def _init(tp: int, seed: int) -> None:
    from megatron.core import tensor_parallel

    megatron_state.initialize(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _batch(vocab: int, batch: int, seq: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def run_plans(spec, tp: int, dtype, plans: list) -> list:
    """Each plan's ``{loss, logits, grads}`` (on the CPU, TP = 1 form) at TP = ``tp``, one model."""
    _init(tp, spec.seed)
    config = spec.config(tp, dtype)
    model = build_gpt(config, spec.vocab, spec.seq, position_embedding_type="rope", seed=spec.seed)
    tokens, labels = _batch(spec.vocab, spec.batch, spec.seq, spec.seed + 1, current())
    out = []
    for plan in plans:
        if plan is not None:
            install()  # plan None runs stock code, before install and after it alike
        if installed():
            set_plan(model, plan)
        model.zero_grad(set_to_none=True)
        loss, logits = forward_backward(model, tokens, labels)
        allreduce_sequence_parallel_grads(model)
        grads = gather_full(model, "grad", gated_fc1=config.gated_linear_unit)
        out.append({"loss": loss.float().cpu(), "logits": logits.float().cpu(),
                    "grads": {k: v.cpu() for k, v in grads.items()}})
        del loss, logits, grads
    del model
    return out


def _label(plan) -> str:
    if isinstance(plan, str):
        return plan
    return describe(tuple(plan))


def check(spec, tp: int, bf16: bool, kernels: str) -> list:
    """The section's lines for one kernel setting (``kernels``: its name in the table)."""
    names = [n for n in STRATEGIES if supports(n, spec.config(tp, torch.float32), tp)[0]]
    skipped = [Line("exactness", n, SKIP, supports(n, spec.config(tp, torch.float32), tp)[1])
               for n in STRATEGIES if n not in names]
    plans = list(names) + mixed_plans(spec.num_layers, names)
    ref = run_plans(spec, 1, torch.float32, [None])[0]
    lines = list(skipped)
    got = run_plans(spec, tp, torch.float32, plans)
    for plan, g in zip(plans, got):
        e = errors(g, ref)
        ok = max(e["loss"], e["logits"], e["grad"]) < FP32_TOL
        lines.append(Line.verdict("exactness", f"fp32 {_label(plan)} [{kernels}]", ok,
                                  f"loss {e['loss']:.1e} logits {e['logits']:.1e} grad {e['grad']:.1e} "
                                  f"(vs stock TP=1; < {FP32_TOL:g})", **e))
    if bf16:
        lines += _bf16_lines(spec, tp, plans, ref, kernels)
    return lines


def _bf16_lines(spec, tp, plans, ref, kernels) -> list:
    stock = run_plans(spec, tp, torch.bfloat16, [None])[0] if tp > 1 else \
        run_plans(spec, 1, torch.bfloat16, [None])[0]
    base = errors(stock, ref)
    got = run_plans(spec, tp, torch.bfloat16, plans)
    lines = []
    for plan, g in zip(plans, got):
        e = errors(g, ref)
        ok = all(e[k] <= 2 * base[k] + BF16_SLACK for k in ("loss", "logits", "grad"))
        lines.append(Line.verdict(
            "exactness", f"bf16 {_label(plan)} [{kernels}]", ok,
            f"logits {e['logits']:.1e} grad {e['grad']:.1e} vs stock bf16's {base['logits']:.1e} / "
            f"{base['grad']:.1e} (from fp32 stock TP=1; <= 2x + {BF16_SLACK:g})", **e,
            stock_logits=base["logits"], stock_grad=base["grad"]))
    return lines
