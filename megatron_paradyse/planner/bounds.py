"""The linear-programming bound both exact searches prune with: the fastest continuous split of
``r`` layers over strategies with at most ``c`` bytes of saved activations between them."""
from __future__ import annotations

import math


def lower_hull(points):
    """Lower convex hull of (m, t) points sorted by m ascending (for the LP bound)."""
    pts = sorted(set(points))
    hull = []
    for p in pts:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:
                hull.pop()
            else:
                break
        hull.append(p)
    # keep only the decreasing part (more memory than the fastest point never helps)
    best = min(range(len(hull)), key=lambda i: (hull[i][1], hull[i][0]))
    return hull[:best + 1]


class Hulls:
    """``hulls[j]``: the lower hull of points ``j..`` of (m, t), made when first asked for (a
    search often stops before it needs the deeper ones)."""

    __slots__ = ("m", "t", "got")

    def __init__(self, m, t):
        self.m, self.t, self.got = m, t, [None] * len(m)

    def __getitem__(self, j):
        h = self.got[j]
        if h is None:
            h = self.got[j] = lower_hull(list(zip(self.m[j:], self.t[j:])))
        return h


def lp_bound(hull, r, c):
    """min sum of times for r layers of average memory <= c / r over the hull (continuous)."""
    if r == 0:
        return 0.0 if c >= 0 else math.inf
    a = c / r
    if a < hull[0][0]:
        return math.inf
    if a >= hull[-1][0]:
        return r * hull[-1][1]
    for (m1, t1), (m2, t2) in zip(hull, hull[1:]):
        if a <= m2:
            return r * (t1 + (t2 - t1) * (a - m1) / (m2 - m1))
    return r * hull[-1][1]


EPS = 1e-12  # relative margin: a plan must beat the best so far by more than rounding
