"""Build tiny stock megatron-core GPT models inside a rank, and gather their shards.

Shared by the tests, the benchmarks and the demo: every comparison is against a stock
``GPTModel`` built from the same seed, so these helpers only wrap megatron-core.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import cpu_compat
# the comparison helpers are the check's (product code), shared with the tests
from ..check.compare import allreduce_sequence_parallel_grads, forward_backward, gather_full  # noqa: F401
from ..model import build_gpt as build
from ..parallel import megatron_state


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

    def transformer_config(self, tp: int, sequence_parallel: bool, **extra):
        """megatron's config of this model; ``extra``: more ``TransformerConfig`` fields (e.g. the
        recompute flags, which megatron checks and its layers read when they are built)."""
        from megatron.core.transformer import TransformerConfig

        return TransformerConfig(**extra,
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
    from megatron.core import tensor_parallel

    cpu_compat.apply()
    megatron_state.initialize(tensor_model_parallel_size=tp, **kwargs)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt(spec: TinyGPT, tp: int, seed: int = 1234, sequence_parallel: bool = True, **config):
    """A stock ``GPTModel`` (the package's one builder, ``megatron_paradyse.model``: megatron's
    local layer spec) with weights drawn from ``seed``, on this process's device; ``config``:
    more ``TransformerConfig`` fields."""
    config = spec.transformer_config(tp, sequence_parallel, **config)
    return build(config, spec.vocab_size, spec.max_seq_length, position_embedding_type="rope",
                 share_embeddings_and_output_weights=False, seed=seed)


def make_batch(spec: TinyGPT, batch: int, seq: int, seed: int):
    """Deterministic token ids and labels, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
