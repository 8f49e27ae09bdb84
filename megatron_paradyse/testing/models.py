"""Build tiny stock megatron-core GPT models inside a rank, and gather their shards.

Shared by the tests, the benchmarks and the demo: every comparison is against a stock
``GPTModel`` built from the same seed, so these helpers only wrap megatron-core.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass
class TinyGPT:
    """The knobs of the small GPTs used in tests; defaults are a 2-layer MHA GELU model."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    swiglu: bool = False
    bias: bool = True
    vocab_size: int = 128
    max_seq_length: int = 256
    params_dtype: torch.dtype = torch.float32

    def transformer_config(self, tp: int, sequence_parallel: bool):
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        return TransformerConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size or (4 * self.hidden_size),
            gated_linear_unit=self.swiglu, activation_func=F.silu if self.swiglu else F.gelu,
            add_bias_linear=self.bias,
            tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1,
            use_cpu_initialization=True, params_dtype=self.params_dtype,
            bf16=self.params_dtype == torch.bfloat16,
            hidden_dropout=0.0, attention_dropout=0.0,
            bias_activation_fusion=False, bias_dropout_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False,
            gradient_accumulation_fusion=False, apply_rope_fusion=False,
        )


def init_megatron(tp: int, seed: int = 1234, **kwargs) -> None:
    """Initialise megatron's parallel state over the already-initialised world (CPU shims included)."""
    from megatron.core import parallel_state, tensor_parallel

    from .. import cpu_compat

    cpu_compat.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, **kwargs)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt(spec: TinyGPT, tp: int, seed: int = 1234, sequence_parallel: bool = True):
    """A stock ``GPTModel`` (the package's one builder, ``megatron_paradyse.model``: megatron's
    local layer spec) with weights drawn from ``seed``, on this process's device."""
    from ..model import build_gpt as build

    config = spec.transformer_config(tp, sequence_parallel)
    return build(config, spec.vocab_size, spec.max_seq_length, position_embedding_type="rope",
                 share_embeddings_and_output_weights=False, seed=seed)


def make_batch(spec: TinyGPT, batch: int, seq: int, seed: int):
    """Deterministic token ids and labels, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def forward_backward(model, tokens, labels, loss_scale: float = 1.0):
    """One stock forward and backward: returns (mean loss, full logits [b, s, V])."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    captured = {}

    def hook(_mod, _inp, out):
        captured["logits"] = out[0] if isinstance(out, tuple) else out

    handle = model.output_layer.register_forward_hook(hook)
    try:
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        per_token = model(tokens, position_ids, None, labels=labels)
    finally:
        handle.remove()
    loss = per_token.float().mean()
    (loss * loss_scale).backward()
    logits = captured["logits"].detach()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return loss.detach(), logits.transpose(0, 1).contiguous()


def allreduce_sequence_parallel_grads(model) -> None:
    """Sum the grads of replicated, sequence-parallel params (norms, row biases) over TP.

    ``finalize_model_grads`` does this in training; tests without DDP call it directly.
    """
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def gather_full(model, what: str = "param", gated_fc1: bool = False) -> dict:
    """Each parameter (or its grad) gathered to its TP=1 shape and layout, keyed by name.

    SwiGLU's ``linear_fc1`` shard on rank r is ``[gate_r; up_r]``, so the gathered shards are
    re-ordered to ``[gate; up]``, the TP=1 layout.
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
