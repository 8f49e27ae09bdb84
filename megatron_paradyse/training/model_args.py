"""The model's flags at the trainers' edge: the parsed ``args`` (either trainer's) turned into
the typed objects ``model.py`` and ``costmodel/`` take (``model.ModelFlags``,
``costmodel.ModelShape``), and the completed values written back for the trainers' own readers."""
from __future__ import annotations

import torch

from ..costmodel.shape import ModelShape, pad_vocab
from ..model import ModelFlags, complete_model


def model_flags(args) -> ModelFlags:
    """The model's flags of the parsed ``args``."""
    return ModelFlags.from_flags(vars(args))


def complete_model_args(args, tp: int, device: torch.device | None = None) -> list:
    """``model.complete_model`` of ``args``'s model flags, the completed values written back
    into ``args`` (derived sizes, padded vocabulary, dtype, fusions); returns the notes for the
    log. Raises ``model.ModelArgsError`` naming the flags."""
    done = complete_model(model_flags(args), tp, device)
    vars(args).update(done.as_flags())
    return list(done.notes)


def shape_from_args(args, vocab: int | None = None) -> ModelShape:
    """The ``ModelShape`` of either trainer's parsed flags (Megatron-LM's ``args`` too, whose
    bias flag is ``add_bias_linear``). ``vocab``: the padded vocabulary; default
    ``args.padded_vocab_size`` if set, else ``args.vocab_size`` padded to a multiple of
    ``make_vocab_size_divisible_by * p``."""
    p = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    if vocab is None:
        vocab = getattr(args, "padded_vocab_size", None)
    if vocab is None:
        raw = getattr(args, "vocab_size", None)
        if raw is None:
            raise ValueError("shape_from_args needs vocab= or args.padded_vocab_size / args.vocab_size")
        vocab = pad_vocab(raw, p, getattr(args, "make_vocab_size_divisible_by", 128) or 128)
    heads = args.num_attention_heads
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", True) else None
    dtype = "bf16" if getattr(args, "bf16", False) else ("fp16" if getattr(args, "fp16", False) else "fp32")
    return ModelShape(num_layers=args.num_layers, hidden=args.hidden_size, heads=heads,
                      query_groups=groups or heads,
                      ffn=getattr(args, "ffn_hidden_size", None) or 4 * args.hidden_size,
                      swiglu=bool(getattr(args, "swiglu", False)),
                      bias=not getattr(args, "disable_bias_linear", False) and getattr(args, "add_bias_linear", True),
                      vocab=int(vocab), p=p, dtype=dtype)
