"""The exact fastest plan under the memory budget.

By default (``order="ordered"``) the plan is exact over every per-layer tuple with the ordered
peak; the search per set of strategies is ``ordered.solve_nested``, seeded by the order-free
optimum below. ``order="free"`` stops at the order-free optimum.

Order-free: layers of one model are alike, so a plan is a count ``k_i`` of layers per strategy:
its time ``t0 + sum k_i t_i`` and its bound on the peak ``base + sum k_i m_i + max(x0,
max_{k_i > 0} x_i) + pool({i: k_i > 0})`` (every order peaks at most there) do not depend on
the order of the layers. The last two terms depend only
on the set ``S`` of strategies used, so each set is a subproblem: only strategies in ``S`` are
allowed and the saved bytes must fit in ``limit - base - X(S) - pool(S)``. Every plan found in
the subproblem of ``S`` is feasible (it uses a subset of ``S``: its transient and pool are at
most those of ``S``), and the optimum is feasible in the subproblem of its own set, so the best
over all sets is the optimum (2^n - 1 sets, n <= 5 strategies).

Each subproblem (``min sum k_i t_i`` s.t. ``sum k_i = L``, ``sum k_i m_i <= C``, integers) is
solved by depth-first branch and bound over the strategies sorted fastest first (dominated ones
removed: a strategy at least as slow and as large as another is never needed), most layers on
the faster strategy first, pruned by the linear-programming bound (the lower convex hull of the
remaining strategies in (memory, time)). Exact; ``tests/test_planner.py`` checks it against
brute force over every composition.

Where "layers are alike" breaks (then this is a model, not the truth):

* pipeline parallelism: a stage holds activations of several micro-batches in flight, and the
  first stage holds more than the last (1F1B), so per-stage plans and per-stage budgets differ;
* the first and last layers differ from the others (embedding and output layer are handled as
  the non-layer term here; a model whose layers differ in width, MoE layers, or
  local/global attention alternation needs per-layer costs, i.e. a DP over layers);
* activation recomputation: a recomputed layer keeps only its input, and the peak moves to the
  recompute of the layer with the largest transient, which depends on where it sits;
* the peak is taken at the backward of the layer with the largest transient while every
  layer's activations are alive; with strongly different per-layer saved bytes the order in
  which backward frees them could make an earlier moment the peak (not for a stack of like layers).
"""
from __future__ import annotations

import math

from .bounds import EPS, lower_hull, lp_bound
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
    hulls = [lower_hull(list(zip(mm[s:], mt[s:]))) for s in range(len(front))]
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


def _sets(costs: Costs) -> list:
    """``(mask, X, pool)`` for the sets of strategies worth a subproblem (bit i: strategy i):
    the set's largest transient (at least the non-layer one) and its pool bytes (each buffer
    name once, with the non-layer part's). A set that could take one more strategy at no cost
    (same transient, same pool) is left out: the larger set has the same capacity and more
    choice (without pools this leaves one subproblem per transient value). Ordered by the
    set's fastest layer time (ties: larger sets first), so the search can stop at the first
    set that cannot beat the best plan."""
    n, full = len(costs.names), 1 << len(costs.names)
    names = sorted({k for d in (costs.pool0,) + tuple(costs.pool) for k in d})
    vec = [tuple(float(costs.pool[i].get(k, 0.0)) for k in names) if costs.pool else () for i in range(n)]
    maxes = [tuple(float(costs.pool0.get(k, 0.0)) for k in names)] + [None] * (full - 1)
    X, P, T = [costs.x0] + [0.0] * (full - 1), [sum(maxes[0])] + [0.0] * (full - 1), [0.0] * full
    for mask in range(1, full):
        low = (mask & -mask).bit_length() - 1
        rest = mask & (mask - 1)
        maxes[mask] = tuple(map(max, maxes[rest], vec[low])) if names else ()
        X[mask] = max(X[rest], costs.x[low])
        P[mask] = sum(maxes[mask])
        T[mask] = costs.t[low] if not rest else min(T[rest], costs.t[low])
    out = []
    for mask in range(1, full):
        x, pool = X[mask], P[mask]
        if any(not mask >> j & 1 and X[mask | 1 << j] == x and P[mask | 1 << j] == pool for j in range(n)):
            continue
        out.append((T[mask], -bin(mask).count("1"), mask, x, pool))
    out.sort()
    return [(mask, x, pool) for _, _, mask, x, pool in out]


def _undominated(costs: Costs, idx: list) -> list:
    """The strategies of ``idx`` that no other member matches or beats in time, saved and
    transient bytes: a dominated one's layers can move to its dominator, which sorts no earlier
    by transient, so no prefix of saved bytes grows (ties: the first index is kept)."""
    key = {i: (costs.t[i], costs.m[i], costs.x[i]) for i in idx}
    return [a for a in idx if not any(
        b != a and all(u <= v for u, v in zip(key[b], key[a])) and (key[a] != key[b] or b < a) for b in idx)]


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
        L, sets = self.num_layers, _sets(costs)
        best = self._order_free(costs, sets)
        if self.order == "ordered":
            if best is not None:
                best = (best[0], self.evaluate_ordered(costs, best[2])[1], best[2])
            best = self._ordered(costs, sets, best)
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
        L, n = self.num_layers, len(costs.names)
        best = None
        for mask, X, pool in sets:
            allowed = [i for i in range(n) if mask >> i & 1]
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

    def _ordered(self, costs: Costs, sets: list, best):
        """The fastest plan over every order (``ordered.solve_nested`` per set of strategies),
        starting from ``best`` (a fitting plan or None)."""
        L, n = self.num_layers, len(costs.names)
        for mask, _, pool in sets:
            allowed = sorted(_undominated(costs, [i for i in range(n) if mask >> i & 1]),
                             key=lambda i: (-costs.x[i], i))
            if best is not None and costs.t0 + L * min(costs.t[i] for i in allowed) >= best[0]:
                break
            room = self.limit - costs.base - pool
            caps = [min(room - costs.x[i], room - costs.x0) for i in allowed]
            upper = math.inf if best is None else (best[0] - costs.t0) * (1 + 1e-9)
            _, counts = solve_nested([costs.t[i] for i in allowed], [costs.m[i] for i in allowed], caps, L, upper)
            if counts is None:
                continue
            cdict = {costs.names[allowed[j]]: k for j, k in enumerate(counts) if k}
            sec, peak = self.evaluate_ordered(costs, cdict)
            if peak > self.limit:
                continue
            if best is None or sec < best[0] or (sec == best[0] and peak < best[1]):
                best = (sec, peak, cdict)
        return best
