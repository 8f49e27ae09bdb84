"""``ModelShape``: what a cost model is specific to (one decoder layer's geometry, p, dtype)."""
from __future__ import annotations

import dataclasses
import types

import torch

DTYPE_BYTES = types.MappingProxyType({"fp32": 4, "bf16": 2, "fp16": 2})


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """One model's shape as the cost models see it, per switching group of size ``p``.

    ``vocab`` is the padded vocabulary (megatron pads it to a multiple of
    ``make_vocab_size_divisible_by * p``). ``query_groups`` equals ``heads`` without GQA.
    """

    num_layers: int
    hidden: int
    heads: int
    query_groups: int
    ffn: int
    swiglu: bool
    bias: bool
    vocab: int
    p: int
    dtype: str = "fp32"

    def __post_init__(self):
        bad = []
        for k in ("num_layers", "hidden", "heads", "query_groups", "ffn", "vocab", "p"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad.append(f"{k}={v!r} (a positive int)")
        if self.dtype not in DTYPE_BYTES:
            bad.append(f"dtype={self.dtype!r} (one of {sorted(DTYPE_BYTES)})")
        if not bad:
            if self.hidden % self.heads:
                bad.append(f"hidden={self.hidden} not divisible by heads={self.heads}")
            if self.heads % self.query_groups:
                bad.append(f"heads={self.heads} not divisible by query_groups={self.query_groups}")
        if bad:
            raise ValueError("invalid ModelShape: " + "; ".join(bad))

    # ---- derived
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def elt(self) -> int:
        """Bytes per element of parameters and activations."""
        return DTYPE_BYTES[self.dtype]

    @property
    def qkv_width(self) -> int:
        """Output width of the (unsharded) QKV projection."""
        return (self.heads + 2 * self.query_groups) * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one decoder layer (unsharded)."""
        h, f = self.hidden, self.ffn
        fc1 = (2 * f if self.swiglu else f)
        n = h * self.qkv_width + h * h + h * fc1 + f * h + 4 * h  # two layernorms (weight, bias)
        if self.bias:
            n += self.qkv_width + h + fc1 + h
        return n

    def key(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        g = "" if self.query_groups == self.heads else f" g{self.query_groups}"
        return (f"L{self.num_layers} h{self.hidden} a{self.heads}{g} ffn{self.ffn}"
                f"{' swiglu' if self.swiglu else ''}{'' if self.bias else ' nobias'} V{self.vocab} "
                f"p{self.p} {self.dtype}")

    # ---- constructors
    @classmethod
    def from_dict(cls, d: dict) -> "ModelShape":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown ModelShape fields: {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_config(cls, config, vocab: int, p: int | None = None) -> "ModelShape":
        """From a megatron ``TransformerConfig``; ``vocab`` is the padded vocabulary."""
        p = p if p is not None else config.tensor_model_parallel_size
        dt = getattr(config, "params_dtype", torch.float32)
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt)
        if getattr(config, "bf16", False):
            dtype = "bf16"
        if dtype is None:
            raise ValueError(f"unsupported params dtype {dt}")
        return cls(num_layers=config.num_layers, hidden=config.hidden_size,
                   heads=config.num_attention_heads,
                   query_groups=config.num_query_groups or config.num_attention_heads,
                   ffn=config.ffn_hidden_size or 4 * config.hidden_size,
                   swiglu=bool(config.gated_linear_unit), bias=bool(config.add_bias_linear),
                   vocab=int(vocab), p=int(p), dtype=dtype)


def pad_vocab(vocab: int, p: int, divisible_by: int = 128) -> int:
    m = divisible_by * p
    return ((vocab + m - 1) // m) * m


# The demo's shape (coord RULES.md): 4 layers, h 128, 8 heads, ffn 512, GELU, bias, byte-level
# tokenizer (256 + specials, padded to a multiple of 128 * p), fp32.
def demo_shape(p: int = 4) -> ModelShape:
    return ModelShape(num_layers=4, hidden=128, heads=8, query_groups=8, ffn=512, swiglu=False,
                      bias=True, vocab=pad_vocab(258, p), p=p, dtype="fp32")
