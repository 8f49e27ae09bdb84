"""Packed micro-batches: which documents go into which pack on which replica, and the collate.

A *pack* is one micro-batch ``[1, T]`` holding several whole documents back to back, with
boundaries ``cu_seqlens = (0, d_0, d_0 + d_1, ..., T)`` (megatron's THD ``PackedSeqParams``):
attention stays inside each document and positions restart at 0 in each one
(:func:`pack_documents`). :class:`PackScheduler` decides the packs.

The stream and the state. The sample stream ``g = 0, 1, 2, ...`` is endless (the dataset
reshuffles per epoch itself). Step ``k`` consumes exactly samples
``[k * docs_per_step, (k + 1) * docs_per_step)``: ``docs_per_step`` is Megatron's
``--global-batch-size`` (samples per iteration) for packed data. Every document of the stream
is used exactly once, in its own step, none dropped. Everything is a pure function of
``(seed, step)`` and the inputs: every rank computes the same packs without communication, and
a run resumed at step ``k`` needs nothing but ``k`` (the state is the step). Steps are computed
``window_steps`` at a time and one window is cached.

The rules every pack keeps. At most ``token_cap`` real tokens (make ``token_cap`` a multiple of
the collate's ``multiple``: the padding document then keeps ``T <= token_cap`` too);
``fits_fn(lengths)`` true (the pack fits the memory budget with the plan the planner would
choose for it; assumed monotone: a part of a fitting pack fits); a document longer than
``alone_above`` (default ``token_cap // 2``) keeps a pack of its own: long documents are
attention-bound and, alone, keep their own plan. A document longer than ``token_cap`` or that
does not fit alone raises ValueError naming its stream index (never dropped silently). Every
replica gets at least one pack (a replica without a micro-batch would break the step), so a
step needs at least ``dp_size`` documents.

The two modes:

* ``"greedy"``: what a Megatron user runs today with a token-cap packer: documents in stream
  order, first-fit into packs, packs dealt round-robin to the replicas. Balances nothing.
* ``"balanced"``: the replicas' *predicted step times* (the sum of ``cost_fn`` over their packs)
  are balanced, not their token counts. The greedy packing under the same rules is a candidate
  too, and the step keeps whichever has the lower predicted time (the most loaded replica's,
  then the total): with a planner's cost, packs and plans chosen together are never predicted
  slower than the greedy packs any fitting uniform plan would run (the planner's plan of a pack
  is at most that plan's time). (1) Documents sorted by cost, most expensive first
  (ties by stream index), each into the pack where joining saves the most predicted time
  (ties: the fullest), or a pack of its own where joining saves nothing: few packs, since
  every pack has a fixed cost, but no pack so large that its plan is slower than two packs'; (2) packs to replicas
  longest-processing-time first; (3) a deterministic local search between the most loaded
  replica and the others (least loaded first): move or swap a document or a whole pack, or
  merge two packs of the loaded replica, taking the change that lowers the pair's maximum
  most, while the maximum decreases (at most ``search_iters`` changes). A new pack is only
  opened there when it lowers the maximum, fixed cost included. The seed relabels the
  replicas (so no replica systematically gets the heaviest share); it changes neither the
  packs nor the balance.

``cost_fn(lengths) -> float`` is the predicted seconds of one pack; the default
:func:`default_pack_cost` is a stand-in proxy in token units (a fixed cost per pack, the tokens,
and ``sum(d^2) / 1024`` for causal attention). :func:`make_pack_fns` builds the real pair from
a planner (``planner.choose(PackShape(lengths), b)``: its ``.seconds`` and ``.fits``).
"""
from __future__ import annotations

import functools
import itertools
from typing import Callable, Iterator

import numpy as np
import torch

from ..parallel.packing import PackShape
from .datasets import MicroBatch, padded_length

MODES = ("balanced", "greedy")
PACK_OVERHEAD_TOKENS = 256  # the default cost's fixed cost of a pack, in token units

Pack = tuple  # stream indices, ascending
CostFn = Callable[[tuple], float]
FitsFn = Callable[[tuple], bool]


def default_pack_cost(lengths: tuple) -> float:
    """A stand-in for a pack's predicted time, in token units: a fixed cost per pack, one per
    token (the linear layers) and ``d^2 / 1024`` per document of ``d`` tokens (causal attention)."""
    return float(PACK_OVERHEAD_TOKENS + sum(lengths) + sum(d * d for d in lengths) / 1024)


def _always_fits(lengths: tuple) -> bool:
    return True


def make_pack_fns(planner, micro_batch_size: int = 1, cache_size: int = 1 << 16,
                  per_pack_seconds: float = 0.0) -> tuple:
    """``(cost_fn, fits_fn)`` from a planner: the seconds and fit of
    ``planner.choose(PackShape(lengths), micro_batch_size)`` (``choose`` touches no hysteresis
    state; ``plan`` is used by a planner without it). One cached call per lengths tuple.
    ``per_pack_seconds``: added to every pack's seconds, where each pack is a step of its own
    (the benchmark's packed systems: every pack pays an optimizer update)."""
    query = getattr(planner, "choose", None) or planner.plan

    @functools.lru_cache(maxsize=cache_size)
    def choice(lengths: tuple):
        return query(PackShape(lengths), int(micro_batch_size))

    def cost_fn(lengths: tuple) -> float:
        return float(choice(tuple(int(d) for d in lengths)).seconds) + per_pack_seconds

    def fits_fn(lengths: tuple) -> bool:
        return bool(choice(tuple(int(d) for d in lengths)).fits)
    return cost_fn, fits_fn


# --------------------------------------------------------------------------- collate
def pack_documents(samples, multiple: int = 1, pad_id: int = 0) -> MicroBatch:
    """Documents (each ``L_i + 1`` token ids: inputs ``doc[:-1]``, labels ``doc[1:]``) packed
    into one ``[1, T]`` micro-batch, in order, ``T`` rounded up to a multiple of ``multiple`` by
    one trailing padding document (``pad_id``, ``loss_mask`` 0, its own positions from 0).

    ``position_ids`` restart at 0 in each document; ``cu_seqlens`` are the boundaries, the
    padding document included (ends at ``T``); ``lengths`` are the real documents' lengths.
    """
    docs = [np.asarray(d, dtype=np.int64).reshape(-1) for d in samples]
    if not docs:
        raise ValueError("a pack needs at least one document")
    lengths = tuple(len(d) - 1 for d in docs)
    short = [i for i, n in enumerate(lengths) if n < 1]
    if short:
        raise ValueError(f"every document needs at least two token ids (one input, one label): "
                         f"document {short[0]} of the pack has {lengths[short[0]] + 1}")
    real = sum(lengths)
    total = padded_length(real, multiple)
    tokens = torch.full((1, total), pad_id, dtype=torch.long)
    labels = torch.full((1, total), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((1, total), dtype=torch.float32)
    parts = list(lengths) + ([total - real] if total > real else [])
    position_ids = torch.cat([torch.arange(n, dtype=torch.long) for n in parts]).unsqueeze(0)
    start = 0
    for d, n in zip(docs, lengths):
        t = torch.from_numpy(d)
        tokens[0, start:start + n] = t[:n]
        labels[0, start:start + n] = t[1:n + 1]
        loss_mask[0, start:start + n] = 1.0
        start += n
    cu = tuple(int(c) for c in np.concatenate([[0], np.cumsum(parts)]))
    return MicroBatch(tokens, labels, loss_mask, position_ids, lengths, cu_seqlens=cu)


# --------------------------------------------------------------------------- packing rules
class _Packer:
    """One step's documents and the pack rules (cap, alone threshold, fit, cost) on stream indices."""

    def __init__(self, lens: dict, cap: int, alone_above: int, cost_fn: CostFn, fits_fn: FitsFn):
        self.lens, self.cap, self.alone_above = lens, cap, alone_above
        self._cost, self._fits = cost_fn, fits_fn

    def lengths(self, pack: Pack) -> tuple:
        return tuple(self.lens[g] for g in pack)

    def ok(self, pack: Pack) -> bool:
        """Under the cap, a long document alone, and fitting the memory budget."""
        d = self.lengths(pack)
        if sum(d) > self.cap or (len(d) > 1 and max(d) > self.alone_above):
            return False
        return bool(self._fits(d))

    def cost(self, pack: Pack) -> float:
        return float(self._cost(self.lengths(pack)))

    def load(self, packs: list) -> float:
        return sum(self.cost(p) for p in packs)


def _add(pack: Pack, g: int) -> Pack:
    return tuple(sorted(pack + (g,)))


def _without(pack: Pack, g: int) -> Pack:
    return tuple(x for x in pack if x != g)


def _split_until(packs: list, n: int) -> list:
    """At least ``n`` packs: the pack with the most documents gives up its last one, repeatedly
    (needs at least ``n`` documents; a part of a fitting pack fits)."""
    packs = list(packs)
    while len(packs) < n:
        i = max(range(len(packs)), key=lambda k: (len(packs[k]), -k))
        packs[i], last = packs[i][:-1], packs[i][-1]
        packs.append((last,))
    return packs


def greedy_step(P: _Packer, gs: list, dp_size: int) -> list:
    """Stream order, first-fit under the rules, packs dealt round-robin (module docstring)."""
    packs: list = []
    for g in gs:
        for i, p in enumerate(packs):
            if P.ok(p + (g,)):
                packs[i] = p + (g,)
                break
        else:
            packs.append((g,))
    reps: list = [[] for _ in range(dp_size)]
    for i, p in enumerate(_split_until(packs, dp_size)):
        reps[i % dp_size].append(p)
    return reps


def _best_fit(P: _Packer, gs: list) -> list:
    """Most expensive document first, each into the pack where joining saves the most predicted
    time (ties: the fullest), or a pack of its own where joining none saves any: a pack that
    would need a slower plan to fit the budget costs more than two, and is not formed."""
    packs: list = []
    for g in sorted(gs, key=lambda g: (-P.cost((g,)), g)):
        best, best_key, alone = None, None, P.cost((g,))
        for i, p in enumerate(packs):
            cand = _add(p, g)
            if not P.ok(cand):
                continue
            gain = P.cost(p) + alone - P.cost(cand)
            key = (gain, sum(P.lengths(cand)))
            if gain > 0 and (best_key is None or key > best_key):
                best, best_key = i, key
        if best is None:
            packs.append((g,))
        else:
            packs[best] = _add(packs[best], g)
    return packs


def _lpt(P: _Packer, packs: list, dp_size: int) -> list:
    """Packs, most expensive first, each to the replica with the least predicted time so far."""
    reps: list = [[] for _ in range(dp_size)]
    load = [0.0] * dp_size
    for p in sorted(packs, key=lambda p: (-P.cost(p), p)):
        r = min(range(dp_size), key=lambda k: (load[k], k))
        reps[r].append(p)
        load[r] += P.cost(p)
    return reps


# --------------------------------------------------------------------------- local search
def _doc_moves(P: _Packer, H: list, L: list) -> Iterator[tuple]:
    """``(H', L')`` after moving one document of ``H`` into a pack of ``L``, a new pack on
    ``L``, or swapping it with one document of ``L``."""
    for i, p in enumerate(H):
        for x in p:
            rest = _without(p, x)
            if not rest and len(H) == 1:
                continue
            if rest and not P.ok(rest):
                continue
            H2 = H[:i] + ([rest] if rest else []) + H[i + 1:]
            yield H2, L + [(x,)]
            for j, q in enumerate(L):
                into = _add(q, x)
                if P.ok(into):
                    yield H2, L[:j] + [into] + L[j + 1:]
                if not rest:
                    continue
                for y in q:
                    p2, q2 = _add(rest, y), _add(_without(q, y), x)
                    if P.ok(p2) and P.ok(q2):
                        yield H[:i] + [p2] + H[i + 1:], L[:j] + [q2] + L[j + 1:]


def _pack_moves(P: _Packer, H: list, L: list) -> Iterator[tuple]:
    """``(H', L')`` after moving a pack of ``H`` to ``L``, swapping two packs, or merging two
    packs of ``H`` (one fixed cost less)."""
    for i, p in enumerate(H):
        if len(H) > 1:
            yield H[:i] + H[i + 1:], L + [p]
        for j, q in enumerate(L):
            yield H[:i] + [q] + H[i + 1:], L[:j] + [p] + L[j + 1:]
        for k in range(i + 1, len(H)):
            merged = tuple(sorted(p + H[k]))
            if P.ok(merged):
                yield [m for n, m in enumerate(H) if n not in (i, k)] + [merged], L


def _best_change(P: _Packer, H: list, L: list) -> tuple | None:
    """The change between ``H`` (the most loaded) and ``L`` that lowers ``max(load H, load L)``
    most (ties: fewer packs, then the first found), or None if none lowers it."""
    limit = P.load(H) * (1 - 1e-12)
    best, best_key = None, None
    for H2, L2 in itertools.chain(_pack_moves(P, H, L), _doc_moves(P, H, L)):
        key = (max(P.load(H2), P.load(L2)), len(H2) + len(L2))
        if key[0] < limit and (best_key is None or key < best_key):
            best, best_key = (H2, L2), key
    return best


def local_search(P: _Packer, reps: list, iters: int) -> list:
    """Lower the most loaded replica's predicted time against the others, least loaded first,
    while it decreases (at most ``iters`` changes)."""
    reps = [list(r) for r in reps]
    for _ in range(iters):
        load = [P.load(r) for r in reps]
        hi = max(range(len(reps)), key=lambda k: (load[k], -k))
        for lo in sorted((k for k in range(len(reps)) if k != hi), key=lambda k: (load[k], k)):
            change = _best_change(P, reps[hi], reps[lo])
            if change is not None:
                reps[hi], reps[lo] = change
                break
        else:
            return reps
    return reps


def balanced_step(P: _Packer, gs: list, dp_size: int, iters: int) -> list:
    """The better by predicted time of (a) best-fit packs, longest-processing-time to replicas,
    local search, and (b) the greedy token-cap packs under the same rules (module docstring)."""
    packs = _split_until(_best_fit(P, gs), dp_size)
    searched = local_search(P, _lpt(P, packs, dp_size), iters)
    return min((searched, greedy_step(P, gs, dp_size)), key=lambda reps: _step_key(P, reps))


def _step_key(P: _Packer, reps: list) -> tuple:
    """What a step's packing is judged by: the most loaded replica's predicted time, then the
    total, then the number of packs."""
    loads = [P.load(r) for r in reps]
    return (max(loads), sum(loads), sum(len(r) for r in reps))


# --------------------------------------------------------------------------- scheduler
class PackScheduler:
    """The packs of each step on each data-parallel replica (module docstring).

    ``lengths``: ``g -> int`` (the training tokens of stream sample ``g``, ``len(dataset[g]) - 1``)
    or a dataset with ``.length(g)``. ``docs_per_step``: samples per step (Megatron's
    ``--global-batch-size``). ``token_cap`` (keyword): the most real tokens of a pack.
    """

    def __init__(self, lengths, docs_per_step: int, dp_size: int = 1, *, token_cap: int,
                 seed: int = 1234, mode: str = "balanced", cost_fn: CostFn | None = None,
                 fits_fn: FitsFn | None = None, window_steps: int = 1,
                 alone_above: int | None = None, search_iters: int = 256):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if dp_size < 1 or token_cap < 1 or window_steps < 1:
            raise ValueError(f"dp_size, token_cap and window_steps must be >= 1, got {dp_size}, "
                             f"{token_cap}, {window_steps}")
        if docs_per_step < dp_size:
            raise ValueError(f"{docs_per_step} documents per step cannot give each of {dp_size} "
                             "data-parallel replicas a micro-batch: docs_per_step must be >= dp_size")
        self._len = lengths.length if hasattr(lengths, "length") else lengths
        self.docs_per_step, self.dp_size, self.token_cap = int(docs_per_step), int(dp_size), int(token_cap)
        self.seed, self.mode, self.window_steps = seed, mode, int(window_steps)
        self.alone_above = int(token_cap // 2 if alone_above is None else alone_above)
        self.search_iters = int(search_iters)
        self.cost_fn = functools.lru_cache(maxsize=1 << 16)(cost_fn or default_pack_cost)
        self.fits_fn = functools.lru_cache(maxsize=1 << 16)(fits_fn or _always_fits)
        self._cache: dict = {}

    def _lengths(self, step: int) -> dict:
        """``{g: tokens}`` of step ``step``'s documents, each checked to be packable alone."""
        lens = {}
        for g in range(step * self.docs_per_step, (step + 1) * self.docs_per_step):
            d = int(self._len(g))
            if d < 1:
                raise ValueError(f"stream sample {g} has {d} training tokens: a document needs at least one")
            if d > self.token_cap:
                raise ValueError(f"stream sample {g} has {d} tokens, more than token_cap {self.token_cap}: "
                                 "split or truncate long documents, or raise the cap")
            if not self.fits_fn((d,)):
                raise ValueError(f"stream sample {g} ({d} tokens) does not fit the memory budget even "
                                 "alone: split or truncate long documents, or raise the budget")
            lens[g] = d
        return lens

    def _step(self, step: int) -> tuple:
        lens = self._lengths(step)
        P = _Packer(lens, self.token_cap, self.alone_above, self.cost_fn, self.fits_fn)
        if self.mode == "greedy":
            return greedy_step(P, list(lens), self.dp_size), lens
        reps = balanced_step(P, list(lens), self.dp_size, self.search_iters)
        perm = np.random.default_rng([self.seed, step, 25]).permutation(self.dp_size)
        return [sorted(reps[int(r)]) for r in perm], lens

    def _window(self, w: int) -> list:
        got = self._cache.get(w)
        if got is None:
            first = w * self.window_steps
            got = [self._step(k) for k in range(first, first + self.window_steps)]
            self._cache = {w: got}  # one window at a time
        return got

    def step_packs(self, step: int) -> list:
        """``[replica] -> list of packs`` (tuples of stream indices) of step ``step``."""
        w, k = divmod(int(step), self.window_steps)
        return [list(r) for r in self._window(w)[k][0]]

    def replica_packs(self, step: int, dp_rank: int) -> list:
        return self.step_packs(step)[dp_rank]

    def predicted(self, step: int) -> list:
        """Per replica, the predicted seconds of step ``step``: the sum of ``cost_fn`` over its packs."""
        w, k = divmod(int(step), self.window_steps)
        reps, lens = self._window(w)[k]
        return [sum(self.cost_fn(tuple(lens[g] for g in p)) for p in r) for r in reps]

    def describe(self, step: int) -> str:
        """One line per replica: packs, tokens, predicted time (for logs)."""
        w, k = divmod(int(step), self.window_steps)
        reps, lens = self._window(w)[k]
        pred = self.predicted(step)
        lines = [f"step {step} ({self.mode}): max/mean predicted {max(pred) / (sum(pred) / len(pred)):.3f}"]
        for r, (packs, t) in enumerate(zip(reps, pred)):
            tokens = [sum(lens[g] for g in p) for p in packs]
            lines.append(f"  replica {r}: {len(packs)} pack(s), tokens {tokens}, predicted {t:.4g}")
        return "\n".join(lines)


class PackedLoader:
    """An endless iterator of one data-parallel replica's packed micro-batches, step by step.

    Step ``k``'s packs are ``scheduler.replica_packs(k, dp_rank)``, collated by
    :func:`pack_documents` (padded to a multiple of ``multiple``); :meth:`counts` says how many
    micro-batches this replica and the busiest one run at a step (replicas differ, which the
    trainer's plan check needs to know). Resuming at ``start_step`` needs nothing else.
    """

    def __init__(self, dataset, scheduler: PackScheduler, dp_rank: int, multiple: int = 1,
                 start_step: int = 0, pad_id: int = 0):
        self.dataset, self.scheduler, self.dp_rank = dataset, scheduler, dp_rank
        self.multiple, self.pad_id = multiple, pad_id
        self.step, self._queue = start_step, []

    def counts(self, step: int) -> tuple:
        """(this replica's micro-batches, the most any replica runs) at ``step``."""
        packs = self.scheduler.step_packs(step)
        return len(packs[self.dp_rank]), max(len(x) for x in packs)

    def __iter__(self):
        return self

    def __next__(self) -> MicroBatch:
        if not self._queue:
            self._queue = list(self.scheduler.replica_packs(self.step, self.dp_rank))
            self.step += 1
        pack = self._queue.pop(0)
        return pack_documents([self.dataset[int(g)] for g in pack], self.multiple, self.pad_id)


class PackedStream:
    """Packs of consecutive documents of a stream, next-fit up to ``token_cap`` tokens: pack
    ``k`` is ``dataset[starts[k] .. starts[k+1])``, computed once in order and kept (so any pack
    is found again after a restart). For Megatron-LM's data path, where a sample is a pack and
    Megatron's own sampler deals samples to replicas (no balancing here). A document longer
    than the cap is an error naming it."""

    def __init__(self, dataset, token_cap: int, first: int = 0):
        self.dataset, self.cap = dataset, int(token_cap)
        self._starts = [int(first)]

    def _length(self, g: int) -> int:
        ds = self.dataset
        return int(ds.length(g)) if hasattr(ds, "length") else len(ds[g]) - 1

    def pack(self, k: int) -> range:
        """Stream indices of pack ``k``."""
        while len(self._starts) <= k + 1:
            g, total = self._starts[-1], 0
            while True:
                d = self._length(g)
                if d > self.cap:
                    raise ValueError(f"document {g} holds {d} tokens, more than the pack's cap {self.cap}")
                if total + d > self.cap:
                    break
                total, g = total + d, g + 1
            self._starts.append(g)
        return range(self._starts[k], self._starts[k + 1])

    def __getitem__(self, k: int) -> MicroBatch:
        return pack_documents([self.dataset[g] for g in self.pack(int(k))])


def cu_seqlens_from_positions(position_ids, length: int) -> tuple:
    """A pack's document boundaries from its positions (they restart at 0 in every document),
    within its first ``length`` tokens: what Megatron-LM's TP broadcast carries of a pack."""
    row = position_ids.reshape(-1)[:length]
    starts = torch.nonzero(row == 0).reshape(-1).tolist()
    if not starts or starts[0] != 0:
        raise ValueError("a packed micro-batch's positions must start at 0 (position_ids restart per document)")
    return tuple(starts) + (int(length),)
