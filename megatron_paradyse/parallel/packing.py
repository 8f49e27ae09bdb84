"""Packed micro-batches: several documents in one sequence, attention inside each document.

A pack is megatron's THD layout: tokens ``[1, T]`` and ``PackedSeqParams(qkv_format="thd",
cu_seqlens_q=cu_seqlens_kv=[0, d_0, d_0+d_1, ..., T])``. :class:`PackShape` describes a pack
by its document lengths (what cost models and planners take in place of a length ``s``);
:class:`Documents` is a pack's boundaries inside a step (which document each token is in, its
position inside that document, which pieces of documents a range of tokens holds).

Query ``i`` sees key ``j`` iff both are in the same document and ``j <= i``. RoPE positions
restart at 0 in every document (megatron's THD rotary), so a token's rotary position is its
offset inside its document.
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from ..device import copy_to


@dataclasses.dataclass(frozen=True)
class PackShape:
    """A pack's document lengths, in order (what a cost model or planner plans for).

    ``tokens`` is their sum; ``padded(p)`` appends the padding document that makes the total a
    multiple of ``p`` (the plugin pads a pack so; the padding attends only to itself).
    """

    lengths: tuple

    def __post_init__(self):
        lengths = tuple(int(d) for d in self.lengths)
        if not lengths or min(lengths) < 1:
            raise ValueError(f"a pack needs at least one document and no empty ones, got {self.lengths}")
        object.__setattr__(self, "lengths", lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    @property
    def sum_sq(self) -> int:
        """Σ dᵢ²: what causal attention work grows with (megatron's dynamic CP counts it too)."""
        return sum(d * d for d in self.lengths)

    def padded(self, p: int) -> "PackShape":
        pad = (-self.tokens) % int(p)
        return self if pad == 0 else PackShape(self.lengths + (pad,))

    def __int__(self) -> int:
        return self.tokens


def to_device(values, dtype, device) -> torch.Tensor:
    """Host numbers ``values`` as a ``dtype`` tensor on ``device``, without stalling the host
    (``device.copy_to``: pinned and non-blocking on CUDA; a pageable
    ``torch.tensor(..., device="cuda")`` waits for the stream to drain). Every per-micro-batch
    tensor built from host values goes through here."""
    return copy_to(torch.tensor(values, dtype=dtype), device)


def seq_tokens(s) -> int:
    """The token count of a length ``s`` (an int) or of a :class:`PackShape`."""
    return s.tokens if isinstance(s, PackShape) else int(s)


@dataclasses.dataclass(frozen=True)
class Documents:
    """A pack's document boundaries ``bounds = (0, ..., T)`` (strictly increasing).

    The tensors a step needs of them (RoPE positions, a kernel's ``cu_seqlens``) are built on
    the device once per object and kept on it (:meth:`on_device`): a micro-batch's layers, METP's
    head groups and the backward reuse them, with no host work or host-to-device copy per layer.
    """

    bounds: tuple
    _tensors: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @property
    def lengths(self) -> tuple:
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    def doc_of(self, pos: int) -> int:
        """Index of the document that holds token ``pos``."""
        return bisect.bisect_right(self.bounds, pos) - 1

    def pieces(self, start: int, stop: int) -> list:
        """``(doc, a, b)`` for each document that ``[start, stop)`` meets, ``[a, b)`` its part there."""
        out = []
        d = self.doc_of(start)
        while start < stop:
            b = min(stop, self.bounds[d + 1])
            out.append((d, start, b))
            start, d = b, d + 1
        return out

    def _positions(self, ranges: tuple) -> list:
        out = []
        for start, stop in ranges:
            for d, a, b in self.pieces(start, stop):
                off = self.bounds[d]
                out.extend(range(a - off, b - off))
        return out

    def on_device(self, key, device, build):
        """The tensor ``build()`` makes (host values) on ``device``, made once per key and device."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        got = self._tensors.get((key, device))
        if got is None:
            got = self._tensors[(key, device)] = build(device)
        return got

    def positions(self, ranges, device=None) -> torch.Tensor:
        """In-document positions (RoPE's) of the tokens ``ranges`` (``(start, stop)`` pairs) hold."""
        ranges = tuple(tuple(r) for r in ranges)
        return self.on_device(("positions", ranges), device, lambda dev: to_device(
            self._positions(ranges), torch.long, dev))

    def cu_seqlens(self, device=None) -> torch.Tensor:
        """The boundaries as variable-length kernels take them: int32, contiguous, on ``device``."""
        return self.on_device("cu_seqlens", device, lambda dev: to_device(self.bounds, torch.int32, dev))


def check_cu_seqlens(cu, total: int, where: str = "packed_seq_params") -> tuple:
    """``cu`` (a tensor or sequence) as a tuple of boundaries ``0 = c_0 < ... < c_n = total``,
    or ValueError naming what is wrong. Empty documents (repeated boundaries) are dropped."""
    if torch.is_tensor(cu):
        if cu.dim() != 1:
            raise ValueError(f"{where}: cu_seqlens must be 1-D, got shape {tuple(cu.shape)}")
        cu = cu.tolist()
    cu = [int(c) for c in cu]
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"{where}: cu_seqlens must start at 0 and hold at least one document, got {cu[:8]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{where}: cu_seqlens must be non-decreasing, got {cu[:16]}")
    if cu[-1] != total:
        raise ValueError(f"{where}: cu_seqlens ends at {cu[-1]} but the micro-batch holds {total} tokens")
    out = [cu[0]]
    for c in cu[1:]:
        if c != out[-1]:
            out.append(c)
    return tuple(out)


_DOCS_ATTR = "_paradyse_documents"


def attach_documents(params, bounds) -> None:
    """Hand ``params`` (megatron's ``PackedSeqParams``) its boundaries as host values, so that
    :func:`documents_from` reads them from here and never copies ``cu_seqlens`` back from the
    device (a device-to-host sync per micro-batch). ``bounds``: the boundaries its
    ``cu_seqlens_q`` / ``cu_seqlens_kv`` hold; the caller built those tensors from them."""
    setattr(params, _DOCS_ATTR, (Documents(tuple(int(b) for b in bounds)), _inputs(params)))


def documents_from(params, total: int) -> Documents:
    """The :class:`Documents` of megatron's ``PackedSeqParams`` for a pack of ``total`` tokens,
    checked (ValueError naming the problem; the same on every rank, before any collective) and
    cached on ``params``."""
    cached = getattr(params, _DOCS_ATTR, None)
    if cached is not None and cached[0].total == total and _same_inputs(cached[1], _inputs(params)):
        return cached[0]
    fmt = getattr(params, "qkv_format", None)
    if fmt != "thd":
        raise ValueError(f"packed_seq_params.qkv_format must be 'thd' (got {fmt!r}): ParaDySe packs "
                         "documents in megatron's THD layout")
    cu_q, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
    if cu_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is None: a pack needs its document boundaries")
    bounds = check_cu_seqlens(cu_q, total, "packed_seq_params.cu_seqlens_q")
    if cu_kv is not None and check_cu_seqlens(cu_kv, total, "packed_seq_params.cu_seqlens_kv") != bounds:
        raise ValueError("packed_seq_params: cu_seqlens_kv differs from cu_seqlens_q (self-attention "
                         "packs have the same boundaries on both sides)")
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        padded = getattr(params, name, None)
        if padded is not None and check_cu_seqlens(padded, total, f"packed_seq_params.{name}") != bounds:
            raise ValueError(f"packed_seq_params.{name} differs from cu_seqlens_q: per-document padding "
                             "(megatron's CP padding) is not supported; ParaDySe pads the pack's end itself")
    docs = Documents(bounds)
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        got = getattr(params, name, None)
        if got is None or int(got) < docs.max_length:
            raise ValueError(f"packed_seq_params.{name} is {got}, but the longest document holds "
                             f"{docs.max_length} tokens (megatron sizes its RoPE table by it)")
    setattr(params, _DOCS_ATTR, (docs, _inputs(params)))
    return docs


_CU_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def _inputs(params) -> tuple:
    """What the cached documents were read from: each boundary field's object and, for a tensor,
    its version counter (an in-place write bumps it), so reused or rewritten buffers are re-read."""
    return tuple((obj, obj._version if torch.is_tensor(obj) else None)
                 for obj in (getattr(params, f, None) for f in _CU_FIELDS))


def _same_inputs(a: tuple, b: tuple) -> bool:
    return all(x is y and vx == vy for (x, vx), (y, vy) in zip(a, b))


def pad_pack(params, total: int, p: int):
    """``(params, pad)``: ``params`` for the pack padded to a multiple of ``p`` by one trailing
    padding document of ``pad`` tokens (unchanged when ``pad`` is 0)."""
    docs = documents_from(params, total)
    pad = (-total) % p
    if pad == 0:
        return params, 0
    host = docs.bounds + (total + pad,)
    cu = params.cu_seqlens_q
    bounds = to_device(host, torch.int32, cu.device) if torch.is_tensor(cu) else torch.tensor(host, dtype=torch.int32)
    longest = max(docs.max_length, pad)
    new = dataclasses.replace(params, cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=None,
                              cu_seqlens_kv_padded=None, max_seqlen_q=longest, max_seqlen_kv=longest)
    attach_documents(new, host)  # the padded pack's boundaries stay on the host too
    return new, pad
