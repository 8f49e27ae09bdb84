"""Packs in the cost model: what a pack of documents asks of each strategy, beside one sequence.

A cost model's ``s`` is an int (one sequence per row of the micro-batch) or a
:class:`~megatron_paradyse.parallel.packing.PackShape` (one row, ``b = 1``, several documents
attending inside themselves; the plugin pads it to a multiple of p with one trailing padding
document, and so does every function here). :func:`geometry` reads off, for a pack at p, what
the strategies' code does with it (``parallel/pack_layout.py``, ``attention_kernels``):

* ``tp_sp`` / ``ulysses``: one causal kernel call per document over the whole sequence
  (``heads/p`` heads): attention pairs ``sum d_i^2 / 2`` (per head, the causal half);
* ``ring`` / ``colossal`` / ``metp``: :class:`~megatron_paradyse.parallel.pack_layout.PackedLayout`:
  rank r holds ``count(r)`` tokens inside the layer; the busiest rank's attention pairs are
  the sum of its ``kernel_blocks`` (a causal block of n rows: n(n+1)/2 pairs; a full one rows x
  keys); a K/V block of rank ``src`` travels ``last_hops()[src]`` hops (0: none); the re-layout
  moves the rows of ``moves_plan``; ``colossal`` materialises score rows ``[b, heads, count,
  T]`` and its dS rows up to the last column a local row sees.

Each quantity comes with its value for one sequence of the same padded length (the same
layout code on one document spanning every rank, which is the balanced zig-zag split), so that a
model fitted on single sequences predicts a pack as the single sequence of its length plus the
difference: :func:`ratios`. ``random_packs`` draws the profiler's packs (fixed seed).
"""
from __future__ import annotations

import functools
import random
from typing import NamedTuple

from ..parallel.pack_layout import PackedLayout
from ..parallel.packing import Documents, PackShape, seq_tokens

RING_LIKE = ("ring", "colossal", "metp")
__all__ = ["PackShape", "seq_tokens", "is_pack", "padded", "geometry", "ratios", "random_packs", "describe"]


def is_pack(s) -> bool:
    return isinstance(s, PackShape)


def padded(s, p: int) -> PackShape:
    """``s`` (a pack) as the plugin runs it: padded to a multiple of p."""
    return s.padded(p)


def describe(s) -> str:
    """A short label: the length, or ``pack T=...: n docs (longest d)``."""
    if not is_pack(s):
        return str(int(s))
    return f"pack T={s.tokens} ({s.num_docs} docs, longest {max(s.lengths)})"


class PackGeometry(NamedTuple):
    """What a (padded) pack of ``tokens`` asks of the strategies at p (module docstring); the
    ``*_one`` fields: the same for one sequence of ``tokens``."""

    tokens: int
    docs: int
    pairs_full: float        # sum d_i (d_i + 1) / 2: causal pairs over the whole sequence (tp_sp, ulysses)
    pairs_ring: float        # the busiest rank's pairs under PackedLayout (ring, colossal, metp)
    pairs_ring_one: float
    count: int               # the most tokens a rank holds inside a ring layer
    calls_ring: int          # the busiest rank's attention kernel calls (one K/V visit each)
    calls_ring_one: int
    hop_blocks: float        # sum_src count(src) * last_hops(src) / (tokens/p): blocks' hops
    hop_blocks_one: float
    moved: int               # the most rows a rank sends in one re-layout
    moved_one: int
    rows_cols: int           # colossal: count x the widest dS row (last column a local row sees)
    rows_cols_one: int


def _bounds(lengths) -> tuple:
    out = [0]
    for d in lengths:
        out.append(out[-1] + d)
    return tuple(out)


def _layout_numbers(p: int, lengths: tuple) -> tuple:
    """(pairs, calls, count, hop blocks, moved rows, rows x widest column) of the busiest
    ranks of ``PackedLayout(p, lengths)``."""
    lay = PackedLayout(p, Documents(_bounds(lengths)))
    pairs, calls = [], []
    for r in range(p):
        pr, cr = 0, 0
        for src in range(p):
            for rows, keys, causal in lay.kernel_blocks(r, src):
                n, k = rows.stop - rows.start, keys.stop - keys.start
                pr += n * (n + 1) / 2 if causal else n * k
                cr += 1
        pairs.append(pr)
        calls.append(cr)
    chunk = lay.chunk
    hops = sum(lay.count(src) * lay.last_hops()[src] for src in range(p)) / chunk
    moved = 0
    for r in range(p):
        sends, _ = lay.moves_plan(r)
        moved = max(moved, sum(s.stop - s.start for peer, ss in sends.items() if peer != r for s in ss))
    widest = max(lay.count(r) * max((stop for _, stop in lay.row_groups(r)), default=0) for r in range(p))
    return max(pairs), max(calls), max(lay.count(r) for r in range(p)), hops, moved, widest


@functools.lru_cache(maxsize=4096)
def geometry(s: PackShape, p: int) -> PackGeometry:
    """:class:`PackGeometry` of the pack ``s`` padded to a multiple of ``p``."""
    pk = s.padded(p)
    T = pk.tokens
    got = _layout_numbers(p, pk.lengths)
    one = _one(T, p)
    return PackGeometry(T, pk.num_docs, sum(d * (d + 1) / 2 for d in pk.lengths), got[0], one[0], got[2],
                    got[1], one[1], got[3], one[3], got[4], one[4], got[5], one[5])


@functools.lru_cache(maxsize=1024)
def _one(T: int, p: int) -> tuple:
    return _layout_numbers(p, (T,))


def ratios(s: PackShape, p: int) -> dict:
    """The pack's quantities over one sequence's of the same padded length: ``attn_full``
    (tp_sp, ulysses), ``attn_ring`` (ring, metp), ``count`` (tokens inside a ring layer),
    ``hops`` (K/V blocks travelled), ``moved`` (re-layout rows; one sequence's zig-zag swap:
    half the chunk), ``rows`` (colossal's dS rows), and the kernel calls beyond one
    sequence's (``calls_full``, ``calls_ring``)."""
    g = geometry(s, p)
    T = g.tokens
    one_full = T * (T + 1) / 2
    return {"attn_full": g.pairs_full / one_full, "attn_ring": g.pairs_ring / g.pairs_ring_one,
            "count": g.count / (T // p), "hops": g.hop_blocks / max(g.hop_blocks_one, 1e-30),
            "moved": g.moved / max(g.moved_one, 1), "rows": g.rows_cols / g.rows_cols_one,
            "calls_full": float(g.docs - 1), "calls_ring": float(g.calls_ring - g.calls_ring_one)}


def random_packs(totals, per_total: int = 3, seed: int = 0, p: int = 1) -> list:
    """Deterministic packs (``random.Random(seed)``): for each total T (a multiple of p),
    ``per_total`` packs of exactly T tokens cycling through three mixes: many short documents
    (8-128 tokens), lengths log-uniform over 16..T, and one long document (50-90% of T) among
    short ones, in random order. Returns ``[PackShape]`` in the order of ``totals``."""
    rng = random.Random(seed)
    out = []
    for T in totals:
        if T % p:
            raise ValueError(f"pack total {T} is not a multiple of p={p}")
        for k in range(per_total):
            out.append(PackShape(tuple(_mix(rng, T, k % 3))))
    return out


def _mix(rng, T: int, kind: int) -> list:
    lengths, left = [], T
    if kind == 2:
        first = int(T * rng.uniform(0.5, 0.9))
        lengths.append(first)
        left -= first
    lo, hi = (8, 128) if kind in (0, 2) else (16, T)
    while left > 0:
        d = int(round(2 ** rng.uniform(_log2(lo), _log2(max(lo, min(hi, T))))))
        d = max(1, min(d, left))
        lengths.append(d)
        left -= d
    rng.shuffle(lengths)
    return lengths


def _log2(x: float) -> float:
    import math

    return math.log2(x)
