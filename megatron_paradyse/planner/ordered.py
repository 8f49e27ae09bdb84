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
prefix is the previous strategy's, already within a smaller cap (a strategy whose cap is
negative can hold no layer and is left out by the caller, so the first cap is >= 0). So every plan found for ``S``
fits, and the optimum is found in the subproblem of the set it uses: the best over all sets is
the optimum over every per-layer tuple (``tests/test_planner.py`` checks it by brute force).

The strategies here are the planner's candidates (a strategy, or one recomputed in backward,
``tp_sp:rc``, with its own time, saved bytes and transient): nothing below depends on which.

:func:`solve_nested` solves one subproblem: depth first over the candidates in transient
order, the last two in closed form, pruned by the linear-programming bound of the remaining
candidates under the last cap (``bounds.lp_bound``). That bound is convex in the layers ``k``
given to the current candidate, so the children are visited from its minimum outwards in
increasing bound (found by bisection; good plans come first, no seed needed) and each side
stops where the bound reaches the best plan. A symmetry prunes what recompute multiplies
(candidates of equal saved bytes, near-equal times): a later candidate holds no layer while
an earlier one that is faster and no larger has room for one more in every prefix between
them (moving the layer there is faster and fits).
"""
from __future__ import annotations

import math

from .bounds import EPS, Hulls, lp_bound

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


def _finite(bnd, kmax):
    """``(lo, hi)``: the ``k`` in ``0..kmax`` where ``bnd(k)`` is finite, or None. The rest fits
    where a linear inequality in ``k`` holds, so that is an interval holding 0 or ``kmax``
    (ends found by bisection); if neither end is finite (the interval is empty but for
    rounding), a scan."""
    f0, fk = bnd(0) < math.inf, bnd(kmax) < math.inf
    if f0 and fk:
        return 0, kmax
    if not f0 and not fk:
        inside = [k for k in range(1, kmax) if bnd(k) < math.inf]
        return (inside[0], inside[-1]) if inside else None
    a, b = 0, kmax  # bnd finite at exactly one of a, b
    while b - a > 1:
        mid = (a + b) // 2
        if (bnd(mid) < math.inf) == fk:
            b = mid
        else:
            a = mid
    return (b, kmax) if fk else (0, a)


def solve_nested(t, m, caps, L, upper=math.inf, hulls=None):
    """Exact ``min sum k_j t_j`` s.t. ``sum k_j = L``, ``sum_{i <= j} k_i m_i <= caps[j]`` for every
    j, ``k_j >= 0`` integers (``caps`` non-decreasing). Returns ``(time, counts)`` or
    ``(inf, None)``; only a plan faster than ``upper`` is of interest. ``hulls``: a
    ``bounds.Hulls`` of ``(m, t)`` the caller already made."""
    q = len(t)
    if q == 0 or caps[0] < -_TOL * max(1.0, abs(caps[0])):
        return math.inf, None
    search = _Nested(t, m, caps, upper, Hulls(m, t) if hulls is None else hulls)  # hulls[j]: of j..
    if q == 1 or lp_bound(search.hulls[0], L, caps[-1]) < search.best * (1 - EPS):
        search.rec(0, L, 0.0, 0.0)
    return (math.inf, None) if search.counts is None else (search.best, search.counts)


class _Nested:
    """:func:`solve_nested`'s depth-first search: ``best`` the fastest plan's time so far (at
    first the caller's ``upper``), ``counts`` its layers per strategy (None until one is
    found); ``ks`` the layers given on the current path, ``pref[p]`` the saved bytes of
    strategies ``0..p`` on it."""

    def __init__(self, t, m, caps, upper, hulls):
        q = self.q = len(t)
        self.t, self.m, self.caps, self.hulls = t, m, caps, hulls
        self.best, self.counts = upper, None
        self.ks = [0] * q
        self.pref = [0.0] * q
        # Symmetry: for an earlier strategy a (larger transient) that is faster and no larger
        # than a later j, a plan with a layer on j while every prefix from a to j - 1 has room
        # for one more layer of a is beaten by moving that layer to a (the prefixes from a to
        # j - 1 grow by m_a and stay within their caps, the later ones shrink by m_j - m_a >=
        # 0): j then holds no layer.
        self.leaner = [[a for a in range(j) if m[a] <= m[j] and t[a] < t[j]] for j in range(q)]

    def must_skip(self, j: int) -> bool:
        """Whether strategy j must hold no layer (the symmetry above) on the current path."""
        caps, pref, m = self.caps, self.pref, self.m
        for a in self.leaner[j]:
            if min(caps[p] - pref[p] for p in range(a, j)) >= m[a]:
                return True
        return False

    def leaf(self, tot: float, assign) -> None:
        """A complete plan of ``tot`` seconds: the path's counts with ``assign`` ``[(j, k)]``;
        kept when faster than the best."""
        if tot < self.best * (1 - EPS):
            out = list(self.ks)
            for j, k in assign:
                out[j] = k
            self.best, self.counts = tot, out

    def rec(self, j: int, r: int, used: float, acc: float) -> None:
        """Place ``r`` layers on strategies ``j..`` over ``used`` bytes and ``acc`` seconds taken."""
        q, m, caps = self.q, self.m, self.caps
        if j == q - 1:
            if _within(used + r * m[j], caps[j]):
                self.leaf(acc + r * self.t[j], [(j, r)])
            return
        skip = bool(self.leaner[j]) and self.must_skip(j)
        if j == q - 2:
            if skip:
                if _within(used + r * m[j + 1], caps[j + 1]):
                    self.leaf(acc + r * self.t[j + 1], [(j, 0), (j + 1, r)])
                return
            got = _last_two(self.t, m, caps, j, q - 1, r, used)
            if got is not None:
                self.leaf(acc + got[0], [(j, got[1]), (q - 1, r - got[1])])
            return
        mj = m[j]
        kmax = 0 if skip else r if mj <= 0 else min(r, math.floor((caps[j] - used) / mj * (1 + 1e-12) + 1e-9))
        if kmax >= 0:
            self.branch(j, r, used, acc, kmax)

    def branch(self, j: int, r: int, used: float, acc: float, kmax: int) -> None:
        """The children of strategy ``j`` (``0..kmax`` layers on it), visited from the LP
        bound's minimum outwards in increasing bound; each side ends where its bound reaches
        the best plan."""
        tj, mj = self.t[j], self.m[j]
        h, cl, memo = self.hulls[j + 1], self.caps[-1] - used, {}

        def bnd(k):  # the LP bound with k layers on j: convex in k (infinite where the rest cannot fit)
            v = memo.get(k)
            if v is None:
                v = memo[k] = acc + k * tj + lp_bound(h, r - k, cl - k * mj)
            return v

        span = _finite(bnd, kmax)
        if span is None:
            return
        lo, hi = span
        down = _argmin(bnd, lo, hi)
        up = down + 1  # the children in increasing bound from the minimum outwards: good plans early
        ks, pref = self.ks, self.pref
        while True:
            target = self.best * (1 - EPS)
            bd = bnd(down) if down >= lo else math.inf
            bu = bnd(up) if up <= hi else math.inf
            if bd <= bu:
                if not bd < target:
                    return
                k, down = down, down - 1
            else:
                if not bu < target:
                    return
                k, up = up, up + 1
            ks[j] = k
            pref[j] = used + k * mj
            self.rec(j + 1, r - k, pref[j], acc + k * tj)
            ks[j] = 0


def _argmin(bnd, lo: int, hi: int) -> int:
    """The smallest minimiser of the convex ``bnd`` on ``lo..hi``: an end when the bound rises
    from it (often: no bisection), else bisection on its slope."""
    a, b = lo, hi
    if a < b and bnd(b - 1) >= bnd(b):
        a = b
    elif a < b and bnd(a + 1) >= bnd(a):
        b = a
    while a < b:
        mid = (a + b) // 2
        if bnd(mid) <= bnd(mid + 1):
            b = mid
        else:
            a = mid + 1
    return a
