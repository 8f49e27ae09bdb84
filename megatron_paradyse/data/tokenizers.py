"""Tokenizers for preprocessing: the byte-level default, or a megatron-core tokenizer directory.

* ``byte`` (the default): token id = UTF-8 byte (0..255), ``EOD = 256``, ``PAD = 257``,
  ``vocab_size = 258`` (megatron pads it to a multiple of ``make_vocab_size_divisible_by * TP``).
  No files, no download: every machine can preprocess and train on real text.
* a path: a tokenizer directory megatron-core can restore with
  ``megatron.core.tokenizers.MegatronTokenizer.from_pretrained(path)`` (the directory holds
  the tokenizer files and the ``metadata.json`` written by ``MegatronTokenizer.write_metadata``;
  the library it names, e.g. ``sentencepiece`` or ``transformers``, must be installed). Only the
  byte-level tokenizer is tested in this repository.
"""
from __future__ import annotations

import os

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as token ids; ``eod`` and ``pad`` follow the 256 byte values."""

    name = "byte"
    eod = 256
    pad = 257
    vocab_size = 258

    def tokenize(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64)

    def tokenize_bytes(self, raw: bytes) -> np.ndarray:
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "eod": self.eod, "pad": self.pad}


class MegatronCoreTokenizer:
    """A tokenizer restored by megatron-core from a directory (see the module docstring)."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise ValueError(f"--tokenizer {path!r}: not 'byte' and not a tokenizer directory")
        try:
            from megatron.core.tokenizers import MegatronTokenizer
        except ImportError as e:  # pragma: no cover - megatron-core < 0.14
            raise ValueError(f"--tokenizer {path!r}: this megatron-core has no "
                             f"megatron.core.tokenizers ({e}); use the byte tokenizer") from e
        try:
            self._tok = MegatronTokenizer.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - any library error becomes one clear message
            raise ValueError(f"--tokenizer {path!r}: megatron-core could not build it: "
                             f"{type(e).__name__}: {e}") from e
        self.name = path
        self.vocab_size = int(self._tok.vocab_size)
        eod = getattr(self._tok, "eod", None)
        self.eod = int(eod) if eod is not None else None
        pad = getattr(self._tok, "pad", None)
        self.pad = int(pad) if pad is not None and int(pad) >= 0 else 0

    def tokenize(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.tokenize(text), dtype=np.int64)

    def tokenize_bytes(self, raw: bytes) -> np.ndarray:
        return self.tokenize(raw.decode("utf-8", errors="replace"))

    def detokenize(self, ids) -> str:
        return self._tok.detokenize([int(i) for i in ids])

    def describe(self) -> dict:
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "eod": self.eod, "pad": self.pad}


def build_tokenizer(name: str | None = "byte"):
    """``byte`` (default) or a megatron-core tokenizer directory."""
    if name in (None, "", "byte", "bytes", "byte-level"):
        return ByteTokenizer()
    return MegatronCoreTokenizer(name)
