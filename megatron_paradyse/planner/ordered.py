"""The exact fastest plan when the planner also chooses the order of the layers.

``CostModel.step`` on a per-layer tuple gives the ordered peak: the largest of the head's term
(every layer's saved bytes + the non-layer saved and transient bytes) and, for each layer i,
the saved bytes of layers 0..i + layer i's transient (the resident embedding output folded into
``x_i``, as in ``core.Costs``). For given counts the order with the lowest ordered peak puts the
largest transient first (``core.layers_of``, an exchange argument), so with the strategies of a
set ``S`` sorted by transient, largest first, a plan of ``k_j`` layers per strategy fits when

    sum_{i <= j} k_i m_i <= cap_j   for every j in S,
    cap_j = limit - static - pool(S) - max(x_j, ...) ,  capped by limit - static - pool(S) - x0,

a knapsack with nested capacities (``cap`` non-decreasing in j, since the transients fall).
Imposing the constraint of a strategy of ``S`` that a plan leaves at 0 layers is harmless: its
prefix is the previous strategy's, already within a smaller cap. So every plan found for ``S``
fits, and the optimum is found in the subproblem of the set it uses: the best over all sets is
the optimum over every per-layer tuple (``tests/test_planner.py`` checks it by brute force).

:func:`solve_nested` solves one subproblem: depth first over the strategies in transient order,
the last two in closed form, pruned by the linear-programming bound of the remaining
strategies under the last cap (``bounds.lp_bound``; convex in the layers given to the current
strategy, so the scan stops once past its minimum).
"""
from __future__ import annotations

import math

from .bounds import EPS, lower_hull, lp_bound

_TOL = 1e-9  # relative slack on a capacity: rounding only (the planner re-checks every plan)


def _within(used: float, cap: float) -> bool:
    return used <= cap + _TOL * max(1.0, abs(cap))


def _last_two(t, m, caps, a, z, r, used):
    """``(time, k on a)`` of the best split of ``r`` layers between strategies ``a`` and ``z``
    (the last) over ``used`` bytes already taken, or None. Both caps are linear in ``k``, so
    the feasible ``k`` form an interval and the best is one of its ends."""
    lo, hi = 0, r
    if m[a] > 0:
        hi = min(hi, math.floor((caps[a] - used) / m[a] * (1 + 1e-12) + 1e-9))
    elif not _within(used, caps[a]):
        return None
    room, dm = caps[z] - used - r * m[z], m[a] - m[z]
    if dm > 0:
        hi = min(hi, math.floor(room / dm + 1e-9))
    elif dm < 0:
        lo = max(lo, math.ceil(room / dm - 1e-9))
    elif not _within(used + r * m[z], caps[z]):
        return None
    for k in ((hi, hi - 1, lo, lo + 1) if t[a] <= t[z] else (lo, lo + 1, hi, hi - 1)):
        if lo <= k <= hi and _within(used + k * m[a], caps[a]) and _within(used + k * m[a] + (r - k) * m[z], caps[z]):
            return k * t[a] + (r - k) * t[z], k
    return None


def solve_nested(t, m, caps, L, upper=math.inf):
    """Exact ``min sum k_j t_j`` s.t. ``sum k_j = L``, ``sum_{i <= j} k_i m_i <= caps[j]`` for every
    j, ``k_j >= 0`` integers (``caps`` non-decreasing). Returns ``(time, counts)`` or
    ``(inf, None)``; only a plan faster than ``upper`` is of interest."""
    q = len(t)
    if q == 0 or caps[0] < -_TOL * max(1.0, abs(caps[0])):
        return math.inf, None
    hulls = [lower_hull(list(zip(m[j:], t[j:]))) for j in range(q)]
    best = [upper, None]
    ks = [0] * q

    def leaf(tot, assign):
        if tot < best[0] * (1 - EPS):
            out = list(ks)
            for j, k in assign:
                out[j] = k
            best[0], best[1] = tot, out

    def rec(j, r, used, acc):
        if j == q - 1:
            if _within(used + r * m[j], caps[j]):
                leaf(acc + r * t[j], [(j, r)])
            return
        if j == q - 2:
            got = _last_two(t, m, caps, j, q - 1, r, used)
            if got is not None:
                leaf(acc + got[0], [(j, got[1]), (q - 1, r - got[1])])
            return
        kmax = r if m[j] <= 0 else min(r, math.floor((caps[j] - used) / m[j] * (1 + 1e-12) + 1e-9))
        prev = None
        for k in range(kmax, -1, -1):
            if not _within(used + k * m[j], caps[j]):
                continue
            bound = acc + k * t[j] + lp_bound(hulls[j + 1], r - k, caps[-1] - used - k * m[j])
            if bound >= best[0] * (1 - EPS):
                if prev is not None and bound >= prev:
                    break  # convex in k: past its minimum it only grows
                prev = bound
                continue
            prev = bound
            ks[j] = k
            rec(j + 1, r - k, used + k * m[j], acc + k * t[j])
            ks[j] = 0

    if q == 1:
        rec(0, L, 0.0, 0.0)
    elif lp_bound(hulls[0], L, caps[-1]) < best[0] * (1 - EPS):
        rec(0, L, 0.0, 0.0)
    return (math.inf, None) if best[1] is None else (best[0], best[1])
