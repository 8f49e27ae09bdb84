"""What every planner shares: the budget, per-(s, b) layer costs, plan evaluation, the cache,
the hysteresis, the no-fit message and the longest length that fits.

``s`` is a padded length (int) or a pack (``parallel.packing.PackShape``, b = 1): the cost
model prices a pack's layers on its documents (``costmodel/packs.py``) and everything below
(the exact search, the order, the pool) is the same; plans and costs are cached per pack.

A plan entry is a strategy, or a strategy recomputed in backward (``tp_sp:rc``,
``parallel.plans``): the planners' candidates per layer (:attr:`Planner.entries`) are the
strategies and, with ``recompute="auto"`` where the cost model prices them
(``CostModel.recomputes()``), each one's ``:rc`` entry; ``"off"`` the strategies,
``"only"`` the ``:rc`` entries. A recomputed layer is a candidate like any other, with its own
(seconds, saved bytes: its input, transient: the recompute and backward above it) and its
strategy's pool and refinement factors; everything below holds for candidates.

Memory model (that of :meth:`megatron_paradyse.costmodel.base.CostModel.step` for a plan given
as counts): a plan with ``k_i`` layers of candidate ``i`` at padded length ``s`` and micro-batch
size ``b`` peaks at

    static + sum_i k_i * saved_i + max(nonlayer.saved + nonlayer.transient,
                                       resident + max_{i: k_i > 0} transient_i)
           + pool({i: k_i > 0})

(``resident``: the non-layer bytes alive under the layers, the embedding output; ``pool``: the
communication pool of the strategies used and the non-layer part, each buffer name once at its
largest size, released between micro-batches). This bounds
every order of the layers; the per-layer plans returned put the layers with the largest
transient first, the order whose ordered peak (``CostModel.step`` on a tuple) is lowest, so the
plan run never peaks above the number reported.

and takes ``nonlayer.seconds + sum_i k_i * seconds_i`` (a training step adds the update once,
:meth:`Planner.update_seconds`). A plan *fits* when its peak is at most
``budget - margin``. The margin covers what the model does not see (the CUDA caching
allocator's fragmentation, NCCL and cuBLAS workspaces, the model's own error): default 10% of
the budget on GPU, 5% on CPU (where the measured peak is the live-tensor tracker's exact byte
count, so only the model's error is left to cover).
"""
from __future__ import annotations

import logging
import math
from typing import NamedTuple

from ..costmodel.base import plan_counts, union_bytes
from ..errors import UserError
from ..parallel.packing import PackShape
from ..parallel.plans import make_entry, split_entry, strategy_of
from ..units import GiB, MiB

log = logging.getLogger(__name__)

_WARNED: set = set()  # cost models already warned about (they cannot price :rc entries)
RECOMPUTE = ("auto", "off", "only")  # the candidates: strategies and their :rc entries, plain only, :rc only


def plan_key(s):
    """What plans and costs are cached by: a length (int) or a pack (``PackShape``, hashable;
    never equal to an int of its token count)."""
    return s if isinstance(s, PackShape) else int(s)


def describe_length(s) -> str:
    """``sequence length 4096`` or ``pack of 3 documents (72, 900, 31: 1003 tokens)``."""
    if isinstance(s, PackShape):
        shown = ", ".join(str(d) for d in s.lengths[:8]) + (", ..." if s.num_docs > 8 else "")
        return f"pack of {s.num_docs} documents ({shown}: {s.tokens} tokens)"
    return f"sequence length {int(s)}"


def fmt_bytes(x: float) -> str:
    """GiB with 3 decimals, or MiB below 1 GiB."""
    return f"{x / GiB:.3f} GiB" if abs(x) >= GiB else f"{x / MiB:.2f} MiB"


class PlanChoice(NamedTuple):
    """A planner's answer for one micro-batch."""

    layers: tuple          # one plan entry per layer: a strategy name, or one with ":rc" (recomputed)
    seconds: float         # predicted forward+backward seconds of the micro-batch
    peak_bytes: float      # predicted peak bytes on one rank
    fits: bool             # peak_bytes <= budget - margin
    reason: str            # why this plan (or, when nothing fits, the numbers)


class NoFitError(UserError, RuntimeError):
    """Nothing fits the memory budget (raised by the ``error`` policy; the message has the numbers)."""


def default_margin_fraction(device_kind: str) -> float:
    """10% of the budget on a GPU, 5% on a CPU (module docstring), by the device the plans are
    for (the cost model's or the training device), never by the machine that plans."""
    return 0.10 if device_kind == "cuda" else 0.05


class Costs(NamedTuple):
    """Per-candidate layer costs at one (s, b), refinement factors applied. A candidate is a
    plan entry: a strategy, or a strategy recomputed in backward (``tp_sp:rc``: its saved bytes
    the layer's input, its transient the recompute and backward above it, its pool the
    strategy's)."""

    names: tuple    # the candidates (plan entries)
    t: tuple        # seconds per layer
    m: tuple        # saved bytes per layer
    x: tuple        # transient bytes per layer
    t0: float       # non-layer seconds
    base: float     # static + non-layer saved bytes
    x0: float       # non-layer transient bytes
    pool: tuple = ()    # per candidate: {buffer: bytes} of the communication pool (its strategy's)
    pool0: dict = {}    # the non-layer part's pool buffers
    group: tuple = ()   # per candidate: the index of its strategy (candidates of one strategy share
    #                     a pool); () = each candidate its own strategy

    def groups(self) -> tuple:
        """Per candidate, its strategy's index (:attr:`group`, or each its own)."""
        return self.group or tuple(range(len(self.names)))

    def pool_bytes(self, used) -> float:
        """The pool of a plan using the strategies at indices ``used``: each buffer name once."""
        if not self.pool:
            return 0.0
        return union_bytes([self.pool0] + [self.pool[i] for i in used])


def last_true(pred, hi: int | None = None) -> int:
    """The largest ``k >= 1`` (at most ``hi``) with ``pred(k)``, for a ``pred`` true up to some
    k and false beyond; 0 if ``pred(1)`` is false or ``hi < 1``. Bisection; without ``hi`` the
    upper end is found by doubling (and 2**40 and beyond taken as unbounded)."""
    if hi is not None and hi < 1:
        return 0
    if not pred(1):
        return 0
    if hi is not None:
        if pred(hi):
            return hi
    else:
        hi = 2
        while pred(hi):
            if hi > (1 << 40):
                return hi
            hi *= 2
    lo = 1  # pred(lo), not pred(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo


def layers_of(counts: dict, costs: "Costs") -> tuple:
    """A per-layer plan from counts: the largest transient first (exchange argument: for two
    adjacent layers, running the one with the larger transient first never raises the ordered
    peak max_i(saved of layers 0..i + transient_i)); ties in the strategies' order."""
    order = sorted(range(len(costs.names)), key=lambda i: (-costs.x[i], i))
    out = []
    for i in order:
        out += [costs.names[i]] * int(counts.get(costs.names[i], 0))
    return tuple(out)


def _ordered(costs: Costs, blocks) -> tuple:
    """(seconds, peak bytes) of consecutive blocks ``(strategy index, layers)`` in their order:
    each block's transient over the saved bytes up to its last layer, the head's over all."""
    sec, below, top, used = costs.t0, 0.0, 0.0, set()
    for i, k in blocks:
        if k:
            sec += k * costs.t[i]
            below += k * costs.m[i]
            top = max(top, below + costs.x[i])
            used.add(i)
    return sec, costs.base + max(top, below + costs.x0) + costs.pool_bytes(sorted(used))


class Planner:
    """Base class: subclasses implement :meth:`_search` (the best plan at one (s, b), no hysteresis).

    ``plan(s, b)`` = the cached search result, then the hysteresis: the previous plan returned
    by ``plan`` is kept if it still fits at (s, b) and is at most ``gamma`` slower than the new
    choice. ``choose(s, b)`` is the same without hysteresis and without touching any state
    (explanations, predictions, tests). ``recompute_first``: megatron's block recompute of
    the first N layers, applied to every plan ``choose`` returns (and so ``plan``).
    """

    kind = "base"
    order = "free"  # how plans are evaluated: "free" (the order-free bound) or "ordered"

    def __init__(self, cost_model, memory_budget_bytes: float, gamma: float = 0.05,
                 margin_bytes: float | None = None, strategies=None, refinement=None,
                 cache_size: int = 4096, device_kind: str | None = None, recompute: str = "auto",
                 recompute_chunk: int = 1, recompute_first: int = 0):
        if memory_budget_bytes is None or not (float(memory_budget_bytes) > 0):
            raise ValueError(f"memory budget must be a positive number of bytes, got {memory_budget_bytes!r}")
        if gamma is None or gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma!r}")
        self.cm = cost_model
        self.num_layers = int(cost_model.num_layers)
        if self.num_layers < 1:
            raise ValueError("the cost model has no layers (num_layers < 1)")
        names = tuple(strategies) if strategies is not None else tuple(cost_model.strategies)
        unknown = [n for n in names if n not in tuple(cost_model.strategies)]
        if unknown or not names:
            raise ValueError(f"strategies {unknown or names} not predicted by the cost model "
                             f"(it knows {tuple(cost_model.strategies)})")
        self.strategies = names
        self._set_recompute(recompute, recompute_chunk)
        if isinstance(recompute_first, bool) or int(recompute_first) != recompute_first or recompute_first < 0:
            raise ValueError(f"recompute_first must be an integer >= 0, got {recompute_first!r}")
        self.recompute_first = int(recompute_first)  # megatron's block recompute (:meth:`choose`)
        self.budget = float(memory_budget_bytes)
        self.device_kind = device_kind or getattr(cost_model, "device_kind", lambda: "cpu")()
        self.margin = (default_margin_fraction(self.device_kind) * self.budget if margin_bytes is None
                       else float(margin_bytes))
        if self.margin < 0 or self.margin >= self.budget:
            raise ValueError(f"margin {self.margin / MiB:.1f} MiB must be >= 0 and below the budget "
                             f"{self.budget / MiB:.1f} MiB")
        self.limit = self.budget - self.margin
        # lengths the cost model accepts are multiples of p (the layout's divisor)
        self.multiple = int(getattr(getattr(cost_model, "shape", None), "p", 1) or 1)
        self.gamma = float(gamma)
        self.refinement = refinement
        self._cache: dict = {}
        self._costs: dict = {}
        self._cache_size = int(cache_size)
        self._cache_version = None
        self.prior = None        # the previous plan returned by plan() (hysteresis)
        self.hits = self.misses = 0

    def _set_recompute(self, recompute: str, chunk: int) -> None:
        """The candidates per layer (:attr:`entries`) from ``recompute``: ``auto`` the strategies
        and, when the cost model prices them (``CostModel.recomputes()``), each one's ``:rc``
        entry; ``off`` the strategies; ``only`` the ``:rc`` entries (every layer recomputed, as
        megatron's ``--recompute-granularity full --recompute-method uniform`` imposes).
        ``chunk`` (megatron's ``--recompute-num-layers`` with the uniform method): layers
        recomputed together, so an ``:rc`` entry's transient also holds ``chunk - 1`` more
        layers' saved activations (the largest of the strategies', a bound)."""
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
        if isinstance(chunk, bool) or int(chunk) != chunk or int(chunk) < 1:
            raise ValueError(f"recompute_chunk must be an integer >= 1, got {chunk!r}")
        can = bool(getattr(self.cm, "recomputes", lambda: False)())
        if recompute == "only" and not can:
            raise ValueError(f"recompute='only' needs a cost model that prices recomputed layers "
                             f"(':rc' plan entries): {type(self.cm).__name__}.recomputes() is False")
        if recompute == "auto" and not can:
            if type(self.cm).__name__ not in _WARNED:  # once per process and kind of cost model
                _WARNED.add(type(self.cm).__name__)
                log.warning(f"warning: the cost model ({type(self.cm).__name__}) does not price recomputed "
                            f"layers (':rc' plan entries): the planner plans without recompute")
            recompute = "off"
        self.recompute = recompute
        self.recompute_chunk = int(chunk)
        plain = () if recompute == "only" else self.strategies
        kinds = () if recompute == "off" else tuple(getattr(self.cm, "recompute_kinds", lambda: ("layer",))())
        if recompute == "only":  # every layer recomputed whole (megatron's uniform full recompute)
            kinds = ("layer",)
        # the whole layer, then its attention or its MLP block alone: every one the model prices
        rc = tuple(make_entry(n, kind) for kind in kinds for n in self.strategies)
        self.entries = plain + rc

    # ------------------------------------------------------------------ costs
    def update_seconds(self) -> float:
        """The cost model's seconds for a step's update (gradient reduction, optimizer step),
        once per step; a plan's ``seconds`` covers one micro-batch's forward and backward."""
        return float(self.cm.update_seconds())

    def costs(self, s: int, b: int) -> Costs:
        """Per-strategy costs at (s, b) with the refinement's factors (cached with the plans)."""
        self._check_version()
        key = (plan_key(s), int(b))
        got = self._costs.get(key)
        if got is None:
            if len(self._costs) >= self._cache_size:
                self._costs.pop(next(iter(self._costs)))
            got = self._costs[key] = self._compute_costs(*key)
        return got

    def _check_version(self):
        v = self._version()
        if v != self._cache_version:
            self._cache.clear()
            self._costs.clear()
            self._cache_version = v

    def layer_seconds(self, entry: str, s, b: int) -> float:
        """The planner's seconds of one layer of plan entry ``entry`` at (s, b) (refined)."""
        costs = self.costs(plan_key(s), int(b))
        return costs.t[costs.names.index(entry)]

    def _compute_costs(self, s: int, b: int) -> Costs:
        r = self.refinement
        t, m, x, group = [], [], [], []
        index = {n: i for i, n in enumerate(self.strategies)}
        plain_saved = {}  # the strategies' saved bytes (refined): a recompute chunk's bound
        for n in self.entries:
            name, rc = split_entry(n)
            c = self.cm.layer(n, s, b)
            ft, fm = r.factors(name, s) if r is not None else (1.0, 1.0)
            t.append(float(c.seconds) * ft)
            m.append(float(c.saved_bytes) * fm)
            x.append(float(c.transient_bytes) * fm)
            group.append(index[name])
            if not rc:
                plain_saved[name] = m[-1]
        if self.recompute_chunk > 1 and self.recompute != "off":
            for name in self.strategies:
                if name not in plain_saved:
                    fm = r.factors(name, s)[1] if r is not None else 1.0
                    plain_saved[name] = float(self.cm.layer(name, s, b).saved_bytes) * fm
            extra = (self.recompute_chunk - 1) * max(plain_saved.values())
            x = [xi + extra if split_entry(n)[1] == "layer" else xi for n, xi in zip(self.entries, x)]
        nl = self.cm.nonlayer(s, b)
        ft, fm = r.factors("nonlayer", s) if r is not None else (1.0, 1.0)
        # CostModel.step for a counts plan: the output layer and loss peak at
        # nonlayer.saved + nonlayer.transient over every layer's saved bytes; a layer peaks at its
        # transient over every layer's saved bytes plus the non-layer bytes resident under the
        # layers (the embedding output). Both are "saved sum + a max": fold them into (x0, x_i).
        res = getattr(self.cm, "resident_bytes", None)
        resident = float(res(s, b)) * fm if res is not None else float(nl.saved_bytes) * fm
        pool = getattr(self.cm, "pool", None)
        if pool:
            by = {n: dict(pool(n, s, b)) for n in self.strategies}  # an :rc entry: its strategy's pool
            pools = tuple(by[strategy_of(n)] for n in self.entries)
        else:
            pools = ()
        return Costs(self.entries, tuple(t), tuple(m), tuple(resident + xi for xi in x),
                     float(nl.seconds) * ft, float(self.cm.static_bytes()),
                     float(nl.saved_bytes + nl.transient_bytes) * fm,
                     pools, dict(pool("nonlayer", s, b)) if pool else {}, tuple(group))

    @staticmethod
    def evaluate(costs: Costs, counts: dict) -> tuple:
        """(seconds, peak bytes) of a plan given as ``{strategy: count}``."""
        sec, saved, trans, used = costs.t0, costs.base, costs.x0, []
        for i, n in enumerate(costs.names):
            k = counts.get(n, 0)
            if k:
                sec += k * costs.t[i]
                saved += k * costs.m[i]
                trans = max(trans, costs.x[i])
                used.append(i)
        return sec, saved + trans + costs.pool_bytes(used)

    @staticmethod
    def evaluate_ordered(costs: Costs, counts: dict) -> tuple:
        """(seconds, peak bytes) of ``layers_of(counts)``, the order with the lowest ordered peak
        (``CostModel.step`` on that tuple)."""
        order = sorted(range(len(costs.names)), key=lambda i: (-costs.x[i], i))
        return _ordered(costs, ((i, counts.get(costs.names[i], 0)) for i in order))

    @staticmethod
    def evaluate_layers(costs: Costs, layers) -> tuple:
        """(seconds, peak bytes) of a per-layer plan in its own order (``CostModel.step`` on the
        tuple)."""
        index = {n: i for i, n in enumerate(costs.names)}
        return _ordered(costs, ((index[n], 1) for n in layers))

    def uniform(self, costs: Costs) -> list:
        """[(name, seconds, peak)] of every uniform plan."""
        L = self.num_layers
        return [(n, costs.t0 + L * costs.t[i],
                 costs.base + L * costs.m[i] + max(costs.x0, costs.x[i]) + costs.pool_bytes([i]))
                for i, n in enumerate(costs.names)]

    # ------------------------------------------------------------------ planning
    def _search(self, costs: Costs, s: int, b: int) -> PlanChoice:
        raise NotImplementedError

    def _version(self):
        return None if self.refinement is None else self.refinement.version

    @staticmethod
    def _key(seq_len, micro_batch: int) -> tuple:
        """``(s, b)`` as plans are cached by; ValueError for a non-positive one or a pack with b != 1."""
        s, b = plan_key(seq_len), int(micro_batch)
        if int(s) < 1 or b < 1:
            raise ValueError(f"sequence length and micro-batch size must be positive, got s={s}, b={b}")
        if isinstance(s, PackShape) and b != 1:
            raise ValueError(f"a pack is one row of a micro-batch: b must be 1, got {b}")
        return s, b

    def choose(self, seq_len, micro_batch: int) -> PlanChoice:
        """The best plan at (s, b) without hysteresis; cached per (padded length, micro-batch
        size). ``seq_len``: a length, or a pack (``PackShape``, b = 1: planned on its documents)."""
        s, b = self._key(seq_len, micro_batch)
        choice = self._cached((s, b), lambda: self._search_or_say_why(s, b))
        return self._with_first_recomputed(choice, s, b) if self.recompute_first else choice

    def _with_first_recomputed(self, c: PlanChoice, s, b: int) -> PlanChoice:
        """``c`` with its first :attr:`recompute_first` layers recomputed (megatron's block
        recompute runs them so whatever the plan says: ``--recompute-method block``), priced as
        such and its peak re-checked against the budget (a plan that no longer fits is reported
        as not fitting); where the cost model cannot price ``:rc`` entries, ``c``'s numbers."""
        first = self.recompute_first
        layers = tuple(make_entry(strategy_of(e), True) if i < first else e for i, e in enumerate(c.layers))
        if layers == c.layers:
            return c
        costs = self.costs(s, b)
        if all(e in costs.names for e in layers):
            sec, peak = self.evaluate_layers(costs, layers)
        elif self.cm.recomputes():  # recompute="off": :rc entries are no candidates
            step = self.cm.step(layers, s, b)
            sec, peak = step.seconds, step.peak_bytes
        else:  # the cost model cannot price :rc entries: the planner's numbers
            return c._replace(layers=layers)
        fits = c.fits and peak <= self.limit
        why = c.reason if fits else (f"{c.reason}; with megatron's block recompute of the first {first} layers "
                                     f"it peaks above the budget")
        return c._replace(layers=layers, seconds=sec, peak_bytes=peak, fits=fits, reason=why)

    def _search_or_say_why(self, s, b: int) -> PlanChoice:
        choice = self._search(self.costs(s, b), s, b)
        if not choice.fits:
            choice = choice._replace(reason=self.no_fit_message(s, b, choice))
        return choice

    def _cached(self, key, compute) -> PlanChoice:
        """The cached answer for ``key``, else ``compute()``'s, stored (oldest entry evicted)."""
        self._check_version()
        hit = self._cache.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        self.misses += 1
        choice = compute()
        if len(self._cache) >= self._cache_size:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = choice
        return choice

    def choose_under(self, seq_len, micro_batch: int, limit: float) -> PlanChoice:
        """The best plan at (s, b) whose peak is at most ``limit`` bytes instead of budget - margin
        (a pipeline stage keeps room for the other micro-batches in flight); a limit above the
        planner's own is capped to it, so no plan is ever over budget. ``fits`` is against
        ``limit``. No hysteresis, no state; cached per (s, b, limit) beside :meth:`choose`'s
        (s, b) keys, cleared with them."""
        limit = min(float(limit), self.limit)
        if limit == self.limit:
            return self.choose(seq_len, micro_batch)
        s, b = self._key(seq_len, micro_batch)
        return self._cached((s, b, limit), lambda: self._search_under(s, b, limit))

    def _search_under(self, s, b: int, limit: float) -> PlanChoice:
        own, self.limit = self.limit, limit  # the searches read self.limit
        try:
            choice = self._search(self.costs(s, b), s, b)
        finally:
            self.limit = own
        if not choice.fits:
            choice = choice._replace(reason=f"nothing fits under {fmt_bytes(limit)} at {describe_length(s)}, "
                                            f"micro-batch size {b}")
        return choice

    def plan(self, seq_len: int, micro_batch: int) -> PlanChoice:
        """The plan for one micro-batch: :meth:`choose`, then the hysteresis on the previous plan."""
        new = self.choose(seq_len, micro_batch)
        prior = self.prior
        if (prior is not None and new.fits and self.gamma > 0 and prior != new.layers):
            costs = self.costs(plan_key(seq_len), int(micro_batch))
            sec, peak = (self.evaluate_layers(costs, prior) if self.order == "ordered"
                         else self.evaluate(costs, plan_counts(prior)))
            if peak <= self.limit and sec <= (1.0 + self.gamma) * new.seconds:
                new = PlanChoice(prior, sec, peak, True,
                                 f"kept the previous plan: it fits and is {100 * (sec / new.seconds - 1):.1f}% "
                                 f"slower than the new choice (<= gamma {100 * self.gamma:.0f}%)")
        self.prior = new.layers if new.fits else self.prior
        return new

    def reset(self) -> None:
        """Forget the previous plan (hysteresis) and the cache."""
        self.prior = None
        self._cache.clear()
        self._costs.clear()

    # ------------------------------------------------------------------ no fit
    def leanest(self, s: int, b: int):
        """(name, seconds, peak) of the leanest uniform plan at (s, b): under the order-free
        bound no plan peaks lower (any plan's peak >= (1/L) sum_i k_i (L saved_i + transient_i)
        >= min_i uniform peak_i); with ordered peaks a mix that runs a large-transient strategy
        first can (:meth:`fits_at`)."""
        return min(self.uniform(self.costs(s, b)), key=lambda u: (u[2], u[1]))

    def fits_at(self, s: int, b: int) -> bool:
        """Whether some plan fits at (s, b): the leanest uniform plan is the leanest under the
        order-free bound; with ordered peaks a mix can be leaner, so the search decides."""
        if self.order == "ordered":
            return self._search(self.costs(s, b), s, b).fits
        return self.leanest(s, b)[2] <= self.limit

    def longest_fit(self, micro_batch: int, multiple: int = 1, upper: int | None = None) -> int:
        """The longest padded length (a multiple of ``multiple``, at most ``upper``) at which some
        plan fits (:meth:`fits_at`); 0 if none. Bisection: the peaks grow with s."""
        b, mult = int(micro_batch), max(1, int(multiple))
        mult = mult * self.multiple // math.gcd(mult, self.multiple)

        def fits(k):
            return self.fits_at(k * mult, b)

        return last_true(fits, None if upper is None else int(upper) // mult) * mult

    def no_fit_message(self, s, b: int, choice: PlanChoice | None = None) -> str:
        name, sec, peak = self.leanest(s, b)
        longest = self.longest_fit(b, multiple=1, upper=int(s))
        return (f"nothing fits the memory budget at {describe_length(s)}, micro-batch size {b}: the "
                f"leanest uniform plan ({name} on all {self.num_layers} layers) needs {peak / GiB:.3f} GiB, the "
                f"budget is {self.budget / GiB:.3f} GiB minus a margin of {self.margin / GiB:.3f} GiB = "
                f"{self.limit / GiB:.3f} GiB per rank; the longest length that fits "
                f"is {longest} tokens" + ("" if longest else " (none)"))

    def describe(self) -> str:
        rc = {"off": "off", "auto": "auto (any layer may be recomputed)", "only": "every layer"}[self.recompute]
        chunk = f" in chunks of {self.recompute_chunk} layers" if self.recompute_chunk > 1 and self.recompute != "off" else ""
        return (f"{self.kind} planner, budget {fmt_bytes(self.budget)}, margin {fmt_bytes(self.margin)}, "
                f"gamma {self.gamma:g}, strategies {','.join(self.strategies)}, recompute {rc}{chunk}")


def pareto(items):
    """Strategies not dominated in (time, memory): ``items`` = [(key, time, memory)], result sorted
    by time ascending, memory strictly descending. A strategy is dropped when another is at most
    as slow and at most as large (ties: the earlier in ``items`` order is kept).

    The reference code's ``pop_useless`` compared only neighbours and stopped one pair short
    (``i < n - 2``), so the last pair was never compared; this compares every strategy with the
    leanest kept so far, after sorting, which is the whole frontier.
    """
    order = sorted(range(len(items)), key=lambda j: (items[j][1], items[j][2], j))
    out, best_mem = [], math.inf
    for j in order:
        if items[j][2] < best_mem:
            out.append(items[j])
            best_mem = items[j][2]
    return out
