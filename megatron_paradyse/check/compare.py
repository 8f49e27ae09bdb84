"""Run a stock or planned forward and backward and gather what it produced to TP = 1 form, so
that results of different TP sizes and strategies can be compared element by element."""
from __future__ import annotations

import torch
import torch.distributed as dist


def forward_backward(model, tokens, labels, loss_scale: float = 1.0):
    """One forward and backward of a (stock or planned) GPTModel: returns (mean per-token loss,
    full logits ``[b, s, V]`` gathered over TP). With context parallelism every CP rank takes its
    chunks of the whole ``tokens``/``labels`` and the loss and logits are gathered over CP."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from ..parallel import context

    cp = parallel_state.get_context_parallel_world_size()
    count = tokens.numel()
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    if cp > 1:
        rank, group = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group()
        tokens, labels, position_ids = (context.split_for_cp(t, cp, rank) for t in (tokens, labels, position_ids))

    captured = {}

    def hook(_mod, _inp, out):
        # a copy: megatron's vocab-parallel cross entropy rewrites fp32 logits in place
        captured["logits"] = (out[0] if isinstance(out, tuple) else out).detach().clone()

    handle = model.output_layer.register_forward_hook(hook)
    try:
        per_token = model(tokens, position_ids, None, labels=labels)
    finally:
        handle.remove()
    loss = per_token.float().sum() / count
    (loss * loss_scale).backward()
    logits = captured["logits"].detach()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    loss = loss.detach()
    if cp > 1:
        dist.all_reduce(loss, group=group)
        logits = context.gather_from_cp(logits, cp, group, dim=0)
    return loss, logits.transpose(0, 1).contiguous()


def allreduce_sequence_parallel_grads(model) -> None:
    """Sum the grads of replicated, sequence-parallel parameters (norms, row biases) over TP,
    and every grad over CP, as ``finalize_model_grads`` and DDP do in training."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        for p in model.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=group)
    if parallel_state.get_context_parallel_world_size() > 1:  # weights are replicated over CP
        group = parallel_state.get_context_parallel_group()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)


def gather_full(model, what: str = "param", gated_fc1: bool = False) -> dict:
    """Each parameter (or its grad) gathered to its TP = 1 shape and layout, fp32, keyed by name.

    A gated ``linear_fc1`` shard on rank r is ``[gate_r; up_r]``; the gathered shards are
    re-ordered to ``[gate; up]``, the TP = 1 layout.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, p in model.named_parameters():
        t = p.detach() if what == "param" else (p.grad if p.grad is not None else torch.zeros_like(p))
        t = t.detach().float().contiguous()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            dim = p.partition_dim
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t, group=group)
            if gated_fc1 and "linear_fc1" in name:
                halves = [x.chunk(2, dim=dim) for x in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            t = torch.cat(parts, dim=dim)
        out[name] = t
    return out


def rel_err(a, b) -> float:
    """``|a - b| / |b|`` in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def errors(got: dict, ref: dict) -> dict:
    """Relative errors of loss, logits and the worst parameter gradient (and its name)."""
    grads = {k: rel_err(got["grads"][k], ref["grads"][k]) for k in ref["grads"]}
    worst = max(grads, key=grads.get)
    return {"loss": rel_err(got["loss"], ref["loss"]), "logits": rel_err(got["logits"], ref["logits"]),
            "grad": grads[worst], "worst_grad": worst}
