"""Dynamic CP planning: each micro-batch's CP size c and per-layer plan chosen together.

A step's documents run on a pool of N nodes (a node: one TP group of p ranks; N a power of two,
the DP x CP pool). The step is a list of rounds; in every round the pool is cut into aligned
power-of-two blocks ``[first, first + size)`` and each block runs one micro-batch at
``c = size``: a pack of documents (one document: one sequence), with the per-layer plan
(strategy and recompute per layer) the planner chose for it at c. Every node runs one
micro-batch per round, so every rank runs as many micro-batches (Megatron's schedules need
that); a block with nothing to run gets a **filler**: an :class:`Assignment` with no documents,
a padding micro-batch of the smallest legal length (``2 c p`` tokens; p at c = 1), its loss
masked, planned and priced like the others.

The predicted step time is the sum over rounds of the slowest block's micro-batch seconds, plus
the update (the same for every system). :func:`plan_dynamic_cp` builds the schedule:

1. each document's smallest c (a power of two, at least ``min_size``, at most N) with at most
   ``per_node`` tokens per node (``--max-seqlen-per-dp-cp-rank``) at which a plan fits;
   a document that fits at no c is refused (:class:`NoFitError`, every rank alike);
2. per c, the documents packed first-fit decreasing into micro-batches of at most
   ``c * pack_tokens`` tokens (default ``per_node``, else the longest document) whose
   plan fits;
3. the rounds: first-fit decreasing by predicted seconds (:func:`arrange`), blocks of a round
   in decreasing size (so aligned), the rest of the pool fillers;
4. a local search: on the bottleneck micro-batches (the slowest of each round) double its c,
   halve it, or split a pack in two; or pack a micro-batch of the cheapest round into one of
   another round (at that one's c; ``pack_tokens`` is not enforced there, the cap and the
   budget are); the move that lowers the predicted step time most, until none does;
5. megatron's Dynamic CP layout (:func:`megatron_layout`) with the planner's plans in place of
   megatron's: taken if it is faster.

What it guarantees (``tests/test_planner_dcp.py`` checks each against brute force):

* every micro-batch's plan is the planner's own answer at its (pack, c): with the optimal
  planner the exact optimum within that c, and its predicted peak within the budget (never
  a micro-batch that does not fit);
* every round is a partition of the pool into aligned power-of-two blocks, every document in
  exactly one micro-batch;
* for the micro-batches it chose, the rounds' time is at most ``t_max + 2 A / N`` (``t_max``
  the slowest micro-batch's seconds, ``A`` the node-seconds ``sum c t``; first-fit decreasing
  height shelf packing), so at most 3x the best arrangement of those micro-batches into rounds
  (fillers aside: a round of tiny micro-batches takes its filler's seconds if longer); in the
  random cases checked (up to 9 micro-batches) it was the best arrangement, observed, not proven;
* it is never slower (predicted, same models) than megatron's Dynamic CP policy
  (:func:`megatron_dcp`: smallest power-of-two c under the cap, groups balanced by workload
  ``s^2/c``, ``tp_sp`` or ``tp_sp:rc`` on every layer), since step 5 keeps megatron's layout
  with plans that are each at least as fast.

It is not an exact optimum over all packings, sizes and rounds (that problem contains bin
packing); the test reports how far it is from the brute-force optimum on small pools. Pure
and deterministic: every rank computes the same schedule from the same documents.
"""
from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from typing import Mapping

from ..parallel.packing import PackShape
from .core import NoFitError, PlanChoice

SEARCH_MOVES = 64   # most local-search moves per step (each strictly lowers the predicted step time)


@dataclasses.dataclass(frozen=True)
class Assignment:
    """One block of a round: nodes ``[first, first + size)`` run the micro-batch of
    ``documents`` (indices into the step's documents, in pack order; empty: a filler) at
    CP size ``size`` under ``plan`` (one entry per layer), predicted ``seconds`` and
    ``peak_bytes`` per rank."""

    first: int
    size: int
    documents: tuple = ()
    plan: tuple = ()
    seconds: float = 0.0
    peak_bytes: float = 0.0

    @property
    def filler(self) -> bool:
        return not self.documents


@dataclasses.dataclass(frozen=True)
class DCPSchedule:
    """A step: ``rounds`` (each a tuple of :class:`Assignment` covering the pool), the
    predicted ``seconds`` (the rounds' slowest blocks plus ``update_seconds``) and the
    ``policy`` that made it (``paradyse``, ``megatron``)."""

    rounds: tuple
    seconds: float
    update_seconds: float
    policy: str

    def round_seconds(self) -> tuple:
        return tuple(max(a.seconds for a in r) for r in self.rounds)

    def sizes(self) -> Counter:
        """How many micro-batches (fillers excluded) ran at each CP size."""
        return Counter(a.size for r in self.rounds for a in r if not a.filler)

    def micro_batches(self) -> list:
        return [a for r in self.rounds for a in r if not a.filler]

    def for_node(self, node: int) -> tuple:
        """Node ``node``'s assignment in every round (the block that holds it): what its ranks run."""
        return tuple(next(a for a in r if a.first <= node < a.first + a.size) for r in self.rounds)


def power_sizes(pool: int) -> tuple:
    """1, 2, 4, ..., ``pool`` (ValueError unless ``pool`` is a power of two >= 1)."""
    if isinstance(pool, bool) or int(pool) != pool or pool < 1 or pool & (pool - 1):
        raise ValueError(f"the pool (nodes of the DP x CP group) must be a power of two >= 1, got {pool!r}")
    return tuple(1 << k for k in range(int(pool).bit_length()))


class MicroBatchPricer:
    """The micro-batches' plans: ``planners[c]`` (one per CP size c, each on its own cost model:
    the in-node model at c = 1, ``CPCostModel`` at c > 1) answers ``choose(shape, 1)``; cached
    per (documents, c). ``uniform``: price a fixed per-layer rule instead (megatron's)."""

    def __init__(self, lengths, planners: Mapping[int, object], p: int):
        self.lengths = tuple(int(d) for d in lengths)
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"documents need lengths >= 1, got {lengths!r}")
        self.planners, self.p = dict(planners), int(p)
        self._memo: dict = {}

    def multiple(self, c: int) -> int:
        return self.p if c == 1 else 2 * c * self.p

    def shape(self, docs: tuple, c: int):
        """One document: its length padded to the layout's multiple; several: a pack; none: a filler."""
        if not docs:
            return self.multiple(c)
        if len(docs) == 1:
            m = self.multiple(c)
            return -(-self.lengths[docs[0]] // m) * m
        return PackShape(tuple(self.lengths[i] for i in docs))

    def choice(self, docs: tuple, c: int) -> PlanChoice:
        key = (docs, c)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self.planners[c].choose(self.shape(docs, c), 1)
        return got

    def uniform(self, docs: tuple, c: int, entries=("tp_sp", "tp_sp:rc")) -> PlanChoice:
        """The first of ``entries`` that fits on every layer (megatron's: ``tp_sp``, else full
        recompute), priced by the planner's cost model; ``fits`` False if none does."""
        pl = self.planners[c]
        s, out = self.shape(docs, c), None
        for e in entries:
            if e.split(":")[0] not in pl.cm.strategies or (":" in e and not pl.cm.recomputes()):
                continue
            plan = (e,) * pl.num_layers
            st = pl.cm.step(plan, s, 1)
            out = PlanChoice(plan, st.seconds, st.peak_bytes, st.peak_bytes <= pl.limit, f"megatron's {e}")
            if out.fits:
                return out
        if out is None:
            raise ValueError(f"the cost model prices none of {entries}")
        return out

    def tokens(self, docs) -> int:
        return sum(self.lengths[i] for i in docs)


def smallest_size(pr: MicroBatchPricer, doc: int, sizes: tuple, min_size: int, per_node: int | None,
                  fit=None) -> int | None:
    """The smallest c of ``sizes`` (>= ``min_size``) with at most ``per_node`` tokens per node
    and ``fit((doc,), c)`` (default: the planner's plan fits); None if none."""
    fit = fit or (lambda d, c: pr.choice(d, c).fits)
    for c in sizes:
        if c < min_size or (per_node is not None and pr.lengths[doc] > c * per_node):
            continue
        if fit((doc,), c):
            return c
    return None


def pack_ffd(pr: MicroBatchPricer, docs, c: int, capacity: int | None, fit=None) -> list:
    """``docs`` packed first-fit decreasing (longest first) into micro-batches of at most
    ``capacity`` tokens with ``fit(pack, c)`` (default: the planner's plan fits); a tuple of
    document indices each."""
    fit = fit or (lambda d, k: pr.choice(d, k).fits)
    packs: list = []
    for d in sorted(docs, key=lambda i: (-pr.lengths[i], i)):
        for k, pk in enumerate(packs):
            if capacity is not None and pr.tokens(pk) + pr.lengths[d] > capacity:
                continue
            if not fit(pk + (d,), c):
                continue
            packs[k] = pk + (d,)
            break
        else:
            packs.append((d,))
    return packs


def arrange(items, pool: int, key=None) -> list:
    """Rounds for ``items`` ``[(size, seconds, ...)]``: first-fit decreasing by ``key`` (default
    the seconds): each item, slowest first, into the first round with room, else a new round.
    Returns rounds as lists of item indices, blocks in decreasing size (aligned)."""
    key = key or (lambda it: it[1])
    order = sorted(range(len(items)), key=lambda i: (-key(items[i]), -items[i][0], i))
    rounds, used = [], []
    for i in order:
        for r, u in enumerate(used):
            if u + items[i][0] <= pool:
                rounds[r].append(i)
                used[r] += items[i][0]
                break
        else:
            rounds.append([i])
            used.append(items[i][0])
    return [sorted(r, key=lambda i: (-items[i][0], -key(items[i]), i)) for r in rounds]


def shelf_seconds(items, pool: int) -> float:
    """Sum over :func:`arrange`'s rounds of the slowest item's seconds (fillers aside)."""
    return sum(max(items[i][1] for i in r) for r in arrange(items, pool))


def fillers(used: int, pool: int) -> list:
    """``(first, size)`` of aligned power-of-two blocks covering ``[used, pool)``."""
    out = []
    while used < pool:
        size = 1
        while used % (size * 2) == 0 and used + size * 2 <= pool:
            size *= 2
        out.append((used, size))
        used += size
    return out


def build_rounds(pr: MicroBatchPricer, mbs: list, pool: int, price, key=None) -> tuple:
    """:class:`Assignment` rounds for micro-batches ``mbs`` ``[(docs, c)]`` priced by
    ``price(docs, c) -> PlanChoice`` (also the fillers'), arranged by :func:`arrange`."""
    chosen = [price(d, c) for d, c in mbs]
    items = [(c, ch.seconds, d) for (d, c), ch in zip(mbs, chosen)]
    out = []
    for r in arrange(items, pool, key):
        blocks, first = [], 0
        for i in r:
            (d, c), ch = mbs[i], chosen[i]
            blocks.append(Assignment(first, c, d, tuple(ch.layers), ch.seconds, ch.peak_bytes))
            first += c
        for f, c in fillers(first, pool):
            ch = price((), c)
            blocks.append(Assignment(f, c, (), tuple(ch.layers), ch.seconds, ch.peak_bytes))
        out.append(tuple(blocks))
    return tuple(out)


def _schedule(pr: MicroBatchPricer, rounds: tuple, policy: str) -> DCPSchedule:
    update = float(pr.planners[1].cm.update_seconds()) if 1 in pr.planners else 0.0
    return DCPSchedule(rounds, sum(max(a.seconds for a in r) for r in rounds) + update, update, policy)


def _refuse(pr: MicroBatchPricer, doc: int, sizes: tuple, min_size: int, per_node) -> NoFitError:
    cap = f", at most {per_node} tokens per node" if per_node is not None else ""
    budget = pr.planners[sizes[-1]].budget / 2**30
    return NoFitError(f"document {doc} of {pr.lengths[doc]} tokens fits no CP size in "
                      f"{[c for c in sizes if c >= min_size]} (memory budget {budget:.2f} GiB{cap}): raise the "
                      f"budget, the pool or the cap, or drop the document")


def megatron_layout(pr: MicroBatchPricer, pool: int, min_size: int = 1, per_node: int | None = None,
                    entries=("tp_sp", "tp_sp:rc")) -> list:
    """megatron's Dynamic CP micro-batches ``[(docs, c)]``: each document at the smallest
    power-of-two c (>= ``min_size``) with at most ``per_node`` tokens per node, documents of one
    c packed first-fit decreasing up to ``c * per_node`` tokens (megatron's cap is its memory
    rule: no other check). Without a cap, the memory rule itself: the smallest c at which the
    document fits under megatron's plan (:meth:`MicroBatchPricer.uniform`), packs while they fit so."""
    sizes = power_sizes(pool)
    fit = (lambda d, c: True) if per_node is not None else (lambda d, c: pr.uniform(d, c, entries).fits)
    by_size: dict = {}
    for i in range(len(pr.lengths)):
        c = smallest_size(pr, i, sizes, min_size, per_node, fit)
        if c is None:
            raise _refuse(pr, i, sizes, min_size, per_node)
        by_size.setdefault(c, []).append(i)
    return [(pk, c) for c in sorted(by_size)
            for pk in pack_ffd(pr, by_size[c], c, None if per_node is None else c * per_node, fit)]


def workload(pr: MicroBatchPricer, docs: tuple, c: int) -> float:
    """megatron's balance key: attention work ``sum s^2 / c`` (no linear layers, no ring)."""
    return sum(pr.lengths[i] ** 2 for i in docs) / c


def megatron_dcp(pr: MicroBatchPricer, pool: int, min_size: int = 1, per_node: int | None = None,
                 entries=("tp_sp", "tp_sp:rc")) -> DCPSchedule:
    """megatron's Dynamic CP policy priced by the same models: :func:`megatron_layout`, rounds
    balanced by :func:`workload`, every layer ``tp_sp`` (else ``tp_sp:rc``). NoFitError if a
    micro-batch fits neither."""
    mbs = megatron_layout(pr, pool, min_size, per_node, entries)
    for d, c in mbs:
        if not pr.uniform(d, c, entries).fits:
            raise NoFitError(f"megatron's Dynamic CP policy: the micro-batch of documents {d} "
                             f"({pr.tokens(d)} tokens) at CP size {c} fits neither of {entries}")
    return _schedule(pr, build_rounds(pr, mbs, pool, lambda d, c: pr.uniform(d, c, entries),
                                      key=lambda it: workload(pr, it[2], it[0])), "megatron")


def _fits(pr: MicroBatchPricer, docs: tuple, c: int, per_node) -> bool:
    return (per_node is None or pr.tokens(docs) <= c * per_node) and pr.choice(docs, c).fits


def _moves(pr: MicroBatchPricer, mbs: list, k: int, sizes: tuple, min_size: int, per_node) -> list:
    """Neighbours of ``mbs`` changing micro-batch k: its c doubled or halved, or its pack split;
    each as ``(removed indices, added micro-batches)`` (:func:`_neighbour`)."""
    docs, c = mbs[k]
    out = []
    for c2 in (2 * c, c // 2):
        if c2 in sizes and c2 >= min_size and _fits(pr, docs, c2, per_node):
            out.append(((k,), [(docs, c2)]))
    if len(docs) > 1:
        halves = (docs[0::2], docs[1::2])
        if all(_fits(pr, h, c, per_node) for h in halves):
            out.append(((k,), [(h, c) for h in halves]))
    return out


def _merges(pr: MicroBatchPricer, mbs: list, items: list, rounds: list, per_node) -> list:
    """Neighbours of ``mbs`` emptying the cheapest round: one of its micro-batches packed into
    a micro-batch of another round (at that one's c), where the pack fits; as :func:`_moves`."""
    cheapest = min(rounds, key=lambda r: (max(items[i][1] for i in r), r))
    out = []
    for k in cheapest:
        for j in range(len(mbs)):
            if j in cheapest:
                continue
            docs, c = mbs[j][0] + mbs[k][0], mbs[j][1]
            if _fits(pr, docs, c, per_node):
                out.append((tuple(sorted((j, k))), [(docs, c)]))
    return out


def _neighbour(rows: list, removed: tuple, added: list) -> list:
    """``rows`` (micro-batches) without the ``removed`` indices, ``added`` after."""
    return [m for i, m in enumerate(rows) if i not in removed] + added


def _items(pr: MicroBatchPricer, mbs: list) -> list:
    return [(c, pr.choice(d, c).seconds, d) for d, c in mbs]


def _shelf(keys: list, pool: int) -> float:
    """:func:`shelf_seconds` of items given as their sorted ``(-seconds, -size)`` (items of equal
    seconds and size are interchangeable there): first-fit decreasing places each round's
    slowest item first, so a round's seconds are its first item's; the same number, without
    building the rounds."""
    used, total = [], 0.0
    for nt, nc in keys:
        for r, u in enumerate(used):
            if u - nc <= pool:
                used[r] = u - nc
                break
        else:
            used.append(-nc)
            total += -nt
    return total


def _neighbour_keys(keys: list, removed: tuple, added: list) -> list:
    """The sorted keys of :func:`_shelf` for a neighbour: ``keys`` ``[(-seconds, -size, index)]``
    of the current items less the ``removed`` indices, the ``added`` items inserted."""
    out = [(nt, nc) for nt, nc, i in keys if i not in removed]
    for c, t, _ in added:
        bisect.insort(out, (-t, -c))
    return out


def local_search(pr: MicroBatchPricer, mbs: list, pool: int, min_size: int, per_node,
                 moves: int = SEARCH_MOVES) -> list:
    """Step 4 of the module docstring: the best move while it lowers :func:`shelf_seconds`.
    A neighbour's rounds' seconds by :func:`_shelf` on the current items less the removed plus
    the added (their plans cached per (documents, c))."""
    sizes = power_sizes(pool)
    best = shelf_seconds(_items(pr, mbs), pool)
    for _ in range(moves):
        items = _items(pr, mbs)
        rounds = arrange(items, pool)
        keys = sorted((-t, -c, i) for i, (c, t, _) in enumerate(items))
        necks = sorted({max(r, key=lambda i: (items[i][1], -i)) for r in rounds})
        cands = [c for k in necks for c in _moves(pr, mbs, k, sizes, min_size, per_node)]
        trial = None
        for removed, added in cands + (_merges(pr, mbs, items, rounds, per_node) if len(rounds) > 1 else []):
            t = _shelf(_neighbour_keys(keys, removed, _items(pr, added)), pool)
            if t < best * (1 - 1e-12):
                best, trial = t, _neighbour(mbs, removed, added)
        if trial is None:
            break
        mbs = trial
    return mbs


def plan_dynamic_cp(lengths, pool: int, planners: Mapping[int, object], p: int, min_size: int = 1,
                    per_node: int | None = None, pack_tokens: int | None = None,
                    pricer: MicroBatchPricer | None = None) -> DCPSchedule:
    """The step's schedule (module docstring): ``lengths`` the documents' token counts,
    ``pool`` N nodes (a power of two), ``planners[c]`` a planner per CP size c in 1..N (its
    budget the memory rule), p the TP size, ``min_size`` ``--min-dynamic-context-parallel-size``,
    ``per_node`` ``--max-seqlen-per-dp-cp-rank`` (None: no cap), ``pack_tokens`` a pack's tokens
    per node at most (default ``per_node``, else the longest document). NoFitError for a
    document that fits no c."""
    pr = pricer or MicroBatchPricer(lengths, planners, p)
    sizes = power_sizes(pool)
    missing = [c for c in sizes if c >= min_size and c not in pr.planners]
    if missing:
        raise ValueError(f"no planner for CP sizes {missing} of the pool of {pool} nodes")
    by_size: dict = {}
    for i in range(len(pr.lengths)):
        c = smallest_size(pr, i, sizes, min_size, per_node)
        if c is None:
            raise _refuse(pr, i, sizes, min_size, per_node)
        by_size.setdefault(c, []).append(i)
    unit = pack_tokens or per_node or max(pr.lengths)
    mbs = [(pk, c) for c in sorted(by_size) for pk in pack_ffd(pr, by_size[c], c, c * unit)]
    mbs = local_search(pr, mbs, pool, min_size, per_node)
    ours = _schedule(pr, build_rounds(pr, mbs, pool, pr.choice), "paradyse")
    theirs = _megatron_with_plans(pr, pool, min_size, per_node)
    return theirs if theirs is not None and theirs.seconds < ours.seconds else ours


def _megatron_with_plans(pr: MicroBatchPricer, pool: int, min_size: int, per_node) -> DCPSchedule | None:
    """megatron's layout and workload-balanced rounds with the planner's plans (step 5); None
    where one of its micro-batches fits no plan."""
    try:
        mbs = megatron_layout(pr, pool, min_size, per_node)
    except NoFitError:
        return None
    if not all(pr.choice(d, c).fits for d, c in mbs):
        return None
    rounds = build_rounds(pr, mbs, pool, pr.choice, key=lambda it: workload(pr, it[2], it[0]))
    return _schedule(pr, rounds, "paradyse")


def cp_planners(kind: str, cost_model, memory_budget_bytes: float, pool: int, links, shape=None,
                **options) -> dict:
    """``{c: planner}`` for c in 1..``pool``: ``build_planner(kind, ...)`` on ``cost_model`` at
    c = 1 and on ``CPCostModel(cost_model, c, links, shape)`` above."""
    from ..costmodel.cp import CPCostModel
    from .build import build_planner

    return {c: build_planner(kind, cost_model if c == 1 else CPCostModel(cost_model, c, links, shape),
                             memory_budget_bytes, **options) for c in power_sizes(pool)}


def example(pool: int = 4, docs: int = 32, seed: int = 0) -> list:
    """docs/planner.md's numbers: ``docs`` log-uniform documents (32..2,896 tokens, ``seed``) on
    ``pool`` nodes of the demo's fitted model (p = 2, ``cpu_gloo`` links), three budgets and
    caps; one line each: planning time, rounds, CP sizes, predicted step time, megatron's."""
    import random
    import time

    from ..costmodel import build_cost_model, demo_shape
    from ..costmodel.cp import Links

    base = build_cost_model(demo_shape(2))
    rng = random.Random(seed)
    lengths = [int(2 ** rng.uniform(5, 11.5)) for _ in range(docs)]
    lines = []
    for mib, cap in ((40, None), (40, 1024), (20, 1024)):
        planners = cp_planners("optimal", base, mib * 2**20, pool, Links.from_config("cpu_gloo", "cpu_gloo"))
        pr = MicroBatchPricer(lengths, planners, 2)
        t0 = time.perf_counter()
        sched = plan_dynamic_cp(lengths, pool, planners, 2, per_node=cap, pricer=pr)
        t1 = time.perf_counter()
        plan_dynamic_cp(lengths, pool, planners, 2, per_node=cap, pricer=pr)
        again = time.perf_counter() - t1
        theirs = megatron_dcp(MicroBatchPricer(lengths, planners, 2), pool, per_node=cap)
        lines.append(f"budget {mib} MiB, cap {cap}: {docs} documents ({sum(lengths)} tokens, longest {max(lengths)}) "
                     f"on {pool} nodes: planned in {t1 - t0:.2f} s ({again:.2f} s cached); {len(sched.rounds)} "
                     f"rounds, sizes {dict(sorted(sched.sizes().items()))}, predicted {sched.seconds:.3f} s; "
                     f"megatron's policy {theirs.seconds:.3f} s ({len(theirs.rounds)} rounds)")
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    example()
