"""The exact fastest plan under the memory budget.

A candidate per layer is a plan entry: a strategy, or (``recompute`` "auto" or "only", where
the cost model prices it) a strategy recomputed in backward, ``tp_sp:rc``: its own time,
saved bytes (the layer's input) and transient (the recompute and backward above it), and its
strategy's communication pool. Up to 10 candidates for 5 strategies; the sets below are sets
of strategies (a strategy's candidates share its pool), so there are at most 31 whatever
recompute adds.

By default (``order="ordered"``) the plan is exact over every per-layer tuple of the
candidates with the ordered peak: one subproblem per set of strategies (``_ordered_sets``,
every candidate of the set's strategies under the set's pool), each solved by
``ordered.solve_nested``, run in the order of their LP bounds and stopped at the first that
cannot beat the best plan. ``order="free"`` plans under the order-free bound instead:

Order-free: layers of one model are alike, so a plan is a count ``k_i`` of layers per candidate:
its time ``t0 + sum k_i t_i`` and its bound on the peak ``base + sum k_i m_i + max(x0,
max_{k_i > 0} x_i) + pool({i: k_i > 0})`` (every order peaks at most there) do not depend on
the order of the layers. The last two terms depend only on the candidates used, so per set of
strategies ``G`` and per largest transient ``X`` (``_free_sets``) a subproblem allows the
candidates of ``G`` with transient <= X, whose saved bytes must fit in ``limit - base - X -
pool(G)``. Every plan found there is feasible (its transient and pool are at most those), and
the optimum is feasible in the subproblem of its own set and transient, so the best over all
of them is the optimum.

Each order-free subproblem (``min sum k_i t_i`` s.t. ``sum k_i = L``, ``sum k_i m_i <= C``,
integers) is solved by depth-first branch and bound over the candidates sorted fastest first
(dominated ones removed: one at least as slow and as large as another is never needed), most
layers on the faster first, pruned by the linear-programming bound (the lower convex hull of the
remaining candidates in (memory, time)). Exact; ``tests/test_planner.py`` checks both searches
against brute force (every per-layer tuple; every composition under the bound).

Where "layers are alike" breaks (then this is a model, not the truth):

* pipeline parallelism: a stage holds activations of several micro-batches in flight, and the
  first stage holds more than the last (1F1B), so per-stage plans and per-stage budgets differ;
* the first and last layers differ from the others (embedding and output layer are handled as
  the non-layer term here; a model whose layers differ in width, MoE layers, or
  local/global attention alternation needs per-layer costs, i.e. a DP over layers);
* activation recomputation is per layer here (``:rc``: the layer's input kept, its recompute
  and backward its transient, placed by the same order); megatron's uniform recompute of N
  layers as one chunk is priced as a bound (``recompute_chunk``: N - 1 more layers' saved
  bytes in every recomputed transient), and its block method (the first N layers) is the
  trainer's to impose;
* the peak is taken at the backward of the layer with the largest transient while every
  layer's activations are alive; with strongly different per-layer saved bytes the order in
  which backward frees them could make an earlier moment the peak (not for a stack of like layers).
"""
from __future__ import annotations

import math

from .bounds import EPS, Hulls, lp_bound
from .core import Costs, PlanChoice, Planner, layers_of
from .ordered import solve_nested




def solve_counts(t, m, L, C, upper=math.inf):
    """Exact ``min sum k_i t_i`` s.t. ``sum k_i = L``, ``sum k_i m_i <= C``, ``k_i >= 0`` integers.

    Returns (time, counts list aligned with t) or (inf, None). ``t``/``m``: per-layer time and
    memory of the allowed strategies. ``upper``: only a plan faster than this is of interest
    (a bound from another subproblem; (inf, None) if none is).
    """
    front = _front(t, m)
    if not front:
        return math.inf, None
    mt = [t[i] for i in front]
    mm = [m[i] for i in front]
    if L * mm[0] <= C:  # the fastest fits alone
        if L * mt[0] >= upper:
            return math.inf, None
        return L * mt[0], _counts(len(t), front, [L] + [0] * (len(front) - 1))
    if L * mm[-1] > C:  # not even the leanest fits
        return math.inf, None
    hulls = Hulls(mm, mt)
    if lp_bound(hulls[0], L, C) >= upper * (1 - EPS):
        return math.inf, None
    best = _best_pair(mt, mm, L, C, upper)
    if len(front) >= 3 and lp_bound(hulls[0], L, C) < best[0] * (1 - EPS):
        _branch_and_bound(mt, mm, hulls, L, C, best)
    if best[1] is None:
        return math.inf, None
    return best[0], _counts(len(t), front, best[1])


def _front(t, m) -> list:
    """The strategies worth using, fastest first, each leaner than every faster one (a strategy
    at least as slow and as large as another is never needed)."""
    front, best_m = [], math.inf
    for i in sorted(range(len(t)), key=lambda i: (t[i], m[i], i)):
        if m[i] < best_m:
            front.append(i)
            best_m = m[i]
    return front


def _counts(n: int, front: list, ks: list) -> list:
    """Counts over all ``n`` strategies from counts over the front."""
    counts = [0] * n
    for j, k in enumerate(ks):
        counts[front[j]] = k
    return counts


def _most_on(m_a, m_b, r, c) -> int:
    """The most of ``r`` layers on a strategy of memory ``m_a`` with the rest on a leaner one of
    ``m_b``, within ``c`` (negative: not even all on the leaner one fit)."""
    dm = m_a - m_b
    k = min(r, int(math.floor((c - r * m_b) / dm))) if dm > 0 else r
    while k > 0 and k * m_a + (r - k) * m_b > c:
        k -= 1  # float rounding
    return k


def _best_pair(mt, mm, L, C, upper) -> list:
    """The incumbent ``[time, counts over the front]``: the best plan of at most two strategies
    (closed form per pair), or ``[upper, None]``."""
    best = [upper, None]
    q = len(mt)
    for a in range(q - 1):
        for bb in range(a + 1, q):
            k = _most_on(mm[a], mm[bb], L, C)
            if k < 0 or (k == 0 and L * mm[bb] > C):
                continue
            tot = k * mt[a] + (L - k) * mt[bb]
            if tot < best[0] * (1 - EPS):
                ks = [0] * q
                ks[a], ks[bb] = k, L - k
                best = [tot, ks]
    return best


def _branch_and_bound(mt, mm, hulls, L, C, best) -> None:
    """Depth first over the front, most layers on the faster strategy first, pruned by the LP
    bound, the last two strategies in closed form; improves ``best`` in place."""
    q = len(mt)
    m_last, t_last = mm[-1], mt[-1]
    ks = [0] * q

    def rec(j, r, c, acc):
        if j == q - 2:  # two strategies left (j and the leanest): as many layers on j as fit
            k = _most_on(mm[j], m_last, r, c)
            if k < 0 or (k == 0 and r * m_last > c):
                return
            tot = acc + (k * mt[j] + (r - k) * t_last)
            if tot < best[0] * (1 - EPS):
                ks[j], ks[q - 1] = k, r - k
                best[0], best[1] = tot, list(ks)
                ks[j] = ks[q - 1] = 0
            return
        prev = None
        for k in range(_most_on(mm[j], m_last, r, c), -1, -1):
            rest_c = c - k * mm[j]
            bound = acc + k * mt[j] + lp_bound(hulls[j + 1], r - k, rest_c)
            if bound >= best[0] * (1 - EPS):
                if prev is not None and bound >= prev:
                    break  # the bound is convex in k: past its minimum it only grows
                prev = bound
                continue
            prev = bound
            ks[j] = k
            rec(j + 1, r - k, rest_c, acc + k * mt[j])
            ks[j] = 0

    rec(0, L, C, 0.0)


def _pools(costs: Costs) -> tuple:
    """``(members, P, same)`` over the sets of strategies (bit g: strategy g): ``members[g]``
    the candidates of strategy g (plain and ``:rc``, which share its pool), ``P[mask]`` the
    pool bytes of a plan using the strategies of ``mask`` (each buffer name once, with the
    non-layer part's), ``same[mask]`` the strategies outside ``mask`` that join it at no cost
    to the pool."""
    grp = costs.groups()
    n = max(grp) + 1 if grp else 0
    full = 1 << n
    members = [[] for _ in range(n)]
    for e, g in enumerate(grp):
        members[g].append(e)
    names = sorted({k for d in (costs.pool0,) + tuple(costs.pool) for k in d})
    vec = [tuple(float(costs.pool[members[g][0]].get(k, 0.0)) for k in names) if costs.pool else ()
           for g in range(n)]
    maxes = [tuple(float(costs.pool0.get(k, 0.0)) for k in names)] + [None] * (full - 1)
    P = [sum(maxes[0])] + [0.0] * (full - 1)
    for mask in range(1, full):
        low = (mask & -mask).bit_length() - 1
        maxes[mask] = tuple(map(max, maxes[mask & (mask - 1)], vec[low])) if names else ()
        P[mask] = sum(maxes[mask])
    same = [0] * full
    for mask in range(1, full):
        for g in range(n):
            bit = 1 << g
            if not mask & bit and P[mask | bit] == P[mask]:
                same[mask] |= bit
    return members, P, same


def _ordered_sets(costs: Costs) -> list:
    """``(candidates, pool)`` of the ordered search's subproblems: per set ``G`` of strategies,
    every candidate of ``G``'s strategies under ``G``'s pool. A set that could take one more
    strategy at no cost (the same pool) is left out: the larger set has the same capacities
    (the ordered caps are per candidate, not per set) and more choice; without pools that
    leaves the set of all strategies. At most 31 sets for 5 strategies, whatever recompute
    adds (a strategy's candidates share its pool)."""
    members, P, same = _pools(costs)
    out = []
    for mask in range(1, len(P)):
        if not same[mask]:
            out.append(([e for g in range(len(members)) if mask >> g & 1 for e in members[g]], P[mask]))
    return out


def _free_sets(costs: Costs) -> list:
    """``(candidates, X, pool)`` of the order-free search's subproblems, by their fastest
    layer time (ties: more candidates first), so the search can stop at the first that cannot
    beat the best plan. The bound charges a plan the largest transient ``X`` of the candidates
    it uses (at least the non-layer one), so per set ``G`` of strategies and per value of
    ``X``: the candidates of ``G`` whose transient is at most ``X``; kept when they cover every
    strategy of ``G`` (else the smaller set, with no larger pool, has the same candidates) and
    no strategy outside ``G`` could join at no cost (the same pool, a candidate within ``X``:
    the larger set has the same capacity and more choice). Without recompute that is one
    subproblem per set of strategies, less those that could take another at no cost."""
    members, P, same = _pools(costs)
    grp, t = costs.groups(), costs.t
    xe = [max(costs.x0, x) for x in costs.x]
    gbit = [1 << g for g in grp]
    ties = []  # the candidates by transient, ascending, those of equal transient together
    for e in sorted(range(len(grp)), key=lambda e: xe[e]):
        if ties and xe[ties[-1][0]] == xe[e]:
            ties[-1].append(e)
        else:
            ties.append([e])
    out = []
    for mask in range(1, len(P)):
        allowed, covered, tmin = [], 0, math.inf
        for tie in ties:
            if any(same[mask] & gbit[e] for e in tie):
                break
            inside = [e for e in tie if mask & gbit[e]]
            if not inside:
                continue
            allowed += inside
            for e in inside:
                covered |= gbit[e]
                tmin = min(tmin, t[e])
            if covered == mask:
                out.append((tmin, -len(allowed), list(allowed), xe[tie[0]], P[mask]))
    out.sort(key=lambda r: r[:2])
    return [r[2:] for r in out]


def _dominators(costs: Costs) -> list:
    """Per candidate, the bit mask of the candidates that match or beat it in time, saved and
    transient bytes (ties: the first index dominates): within a subproblem a dominated
    candidate's layers can move to a dominator, which sorts no earlier by transient, so no
    prefix of saved bytes grows."""
    key = list(zip(costs.t, costs.m, costs.x))
    out = []
    for a, ka in enumerate(key):
        bits = 0
        for b, kb in enumerate(key):
            if b != a and kb[0] <= ka[0] and kb[1] <= ka[1] and kb[2] <= ka[2] and (ka != kb or b < a):
                bits |= 1 << b
        out.append(bits)
    return out


def _undominated(costs: Costs, idx: list, dom: list | None = None) -> list:
    """The candidates of ``idx`` that no other member matches or beats in time, saved and
    transient bytes (:func:`_dominators`)."""
    dom = _dominators(costs) if dom is None else dom
    mask = 0
    for i in idx:
        mask |= 1 << i
    return [a for a in idx if not dom[a] & mask]


class OptimalPlanner(Planner):
    """The fastest plan under the budget, exact. ``order="ordered"`` (default): over every
    per-layer tuple, with the ordered peak (``CostModel.step`` on a tuple; ``ordered.py``);
    ``order="free"``: under the order-free bound (every layer's transient on all layers' saved
    bytes), for cost models that cannot order; its answer seeds the ordered search."""

    kind = "optimal"

    def __init__(self, cost_model, memory_budget_bytes: float, order: str = "ordered", **kwargs):
        super().__init__(cost_model, memory_budget_bytes, **kwargs)
        if order not in ("ordered", "free"):
            raise ValueError(f"order must be 'ordered' or 'free', got {order!r}")
        self.order = order

    def _search(self, costs: Costs, s: int, b: int) -> PlanChoice:
        L = self.num_layers
        if self.order == "ordered":
            best = self._ordered(costs, _ordered_sets(costs))
        else:
            best = self._order_free(costs, _free_sets(costs))
        if best is None:
            name, sec, peak = min(self.uniform(costs), key=lambda u: (u[2], u[1]))
            return PlanChoice((name,) * L, sec, peak, False, "nothing fits")
        sec, peak, cdict = best
        layers = layers_of(cdict, costs)
        why = ("the fastest plan that fits (exact)" if len(cdict) > 1 or sec > min(
            costs.t0 + L * t for t in costs.t) else "the fastest uniform plan fits")
        return PlanChoice(layers, sec, peak, True, why)

    def _order_free(self, costs: Costs, sets: list):
        """``(seconds, peak, counts)`` of the fastest plan under the order-free bound, or None."""
        L = self.num_layers
        best = None
        for allowed, X, pool in sets:
            if best is not None and costs.t0 + L * min(costs.t[i] for i in allowed) >= best[0]:
                break  # sets come fastest-first: no later set can beat the best plan
            C = self.limit - costs.base - X - pool
            if L * min(costs.m[i] for i in allowed) > C:
                continue
            upper = math.inf if best is None else (best[0] - costs.t0) * (1 + 1e-9)
            tsum, counts = solve_counts([costs.t[i] for i in allowed], [costs.m[i] for i in allowed], L, C,
                                        upper=upper)
            if counts is None:
                continue
            cdict = {costs.names[allowed[j]]: k for j, k in enumerate(counts) if k}
            sec, peak = self.evaluate(costs, cdict)
            if peak > self.limit:  # float rounding at the boundary: never return an over-budget plan
                continue
            if best is None or sec < best[0] or (sec == best[0] and peak < best[1]):
                best = (sec, peak, cdict)
        return best

    def _ordered(self, costs: Costs, sets: list, best=None):
        """The fastest plan over every order (``ordered.solve_nested`` per set of strategies),
        starting from ``best`` (a fitting plan or None). The subproblems run in the order of
        their LP bound (the continuous optimum of the set's candidates under its last cap), and
        the search stops at the first whose bound cannot beat the best plan."""
        L = self.num_layers
        dom = _dominators(costs)
        subs = []
        for cands, pool in sets:
            room = self.limit - costs.base - pool
            # a candidate whose transient alone overflows can hold no layer: left out, so the
            # first cap is >= 0 and a cap of a candidate left at 0 layers is implied (ordered.py)
            fit = [i for i in cands if room - max(costs.x[i], costs.x0) >= 0]
            allowed = sorted(_undominated(costs, fit, dom), key=lambda i: (-costs.x[i], i))
            if not allowed:
                continue
            caps = [room - max(costs.x[i], costs.x0) for i in allowed]
            tm, mm = [costs.t[i] for i in allowed], [costs.m[i] for i in allowed]
            hulls = Hulls(mm, tm)
            bound = lp_bound(hulls[0], L, caps[-1])
            if bound < math.inf:
                subs.append((bound, len(subs), allowed, tm, mm, caps, hulls))
        subs.sort(key=lambda r: r[:2])
        for bound, _, allowed, tm, mm, caps, hulls in subs:
            if best is not None and costs.t0 + bound >= best[0] * (1 - EPS):
                break
            upper = math.inf if best is None else (best[0] - costs.t0) * (1 + 1e-9)
            _, counts = solve_nested(tm, mm, caps, L, upper, hulls=hulls)
            if counts is None:
                continue
            cdict = {costs.names[allowed[j]]: k for j, k in enumerate(counts) if k}
            sec, peak = self.evaluate_ordered(costs, cdict)
            if peak > self.limit:
                continue
            if best is None or sec < best[0] or (sec == best[0] and peak < best[1]):
                best = (sec, peak, cdict)
        return best
