"""The paper's heuristic (reference code ``adaptive_policies/heuristic_policy.py``), with its bugs fixed.

1. Prune strategies dominated in (time, memory) (memory: the uniform plan's peak), every pair
   compared (the reference's ``pop_useless`` stopped one pair short).
2. The fastest uniform plan that fits.
3. Else the fastest "first e layers on a fast strategy S_i, the other L - e on a leaner S_k"
   (S_k's uniform plan fits) with the largest e that fits, over all such pairs; each candidate
   is a fresh tuple (the reference appended one list that it then mutated, so a stored
   candidate was the first e that did NOT fit: one layer over budget).
4. Else nothing fits: the leanest plan, ``fits=False`` (no plan peaks lower than the leanest
   uniform one; see :meth:`Planner.leanest`). Nothing is sticky: the reference set an
   out-of-memory flag that never reset, assuming lengths only grow.
5. Hysteresis (in :meth:`Planner.plan`): the previous plan is kept while it fits and is at most
   gamma slower than the new choice.
"""
from __future__ import annotations

from .core import Costs, PlanChoice, Planner, layers_of, pareto


class HeuristicPlanner(Planner):
    kind = "heuristic"

    def candidates(self, costs: Costs):
        """[(layers, seconds, peak, fits, note)] the heuristic considers, in its order."""
        L, lim = self.num_layers, self.limit
        uni = self.uniform(costs)
        front = pareto([(i, u[1], u[2]) for i, u in enumerate(uni)])
        idx = [f[0] for f in front]
        out = []
        for pos, i in enumerate(idx):
            name, sec, peak = uni[i]
            out.append(((name,) * L, sec, peak, peak <= lim, f"uniform {name}"))
        for pos, i in enumerate(idx):
            if uni[i][2] <= lim:
                continue
            for k in idx[pos + 1:]:
                if uni[k][2] > lim:
                    continue
                # e layers of S_i (fast), L - e of S_k (lean): peak grows with e (saved_i > saved_k on
                # the frontier, transient max(x_i, x_k) for 1 <= e <= L-1): take the largest e that fits
                # (the pool of both strategies counted with the transient).
                trans = max(costs.x0, costs.x[i], costs.x[k]) + costs.pool_bytes([i, k])
                room = lim - costs.base - trans - L * costs.m[k]
                dm = costs.m[i] - costs.m[k]
                e = min(L - 1, int(room // dm)) if dm > 0 else L - 1
                while e >= 1 and costs.base + e * costs.m[i] + (L - e) * costs.m[k] + trans > lim:
                    e -= 1  # float rounding of the division
                if e < 1:
                    continue
                cnt = {costs.names[i]: e, costs.names[k]: L - e}
                layers = layers_of(cnt, costs)  # a fresh tuple per candidate
                sec, peak = self.evaluate(costs, cnt)
                out.append((layers, sec, peak, peak <= lim,
                            f"{e} layers {costs.names[i]}, {L - e} {costs.names[k]} (largest transient first)"))
        return out

    def _search(self, costs: Costs, s: int, b: int) -> PlanChoice:
        cands = self.candidates(costs)
        fitting = [c for c in cands if c[3]]
        if fitting:
            first_uniform = [c for c in cands if c[4].startswith("uniform")][0]
            if first_uniform[3]:
                c = first_uniform
                why = "the fastest uniform plan fits"
            else:
                c = min(fitting, key=lambda c: (c[1], c[2]))
                why = ("fastest fitting candidate (" + c[4] + ")")
            return PlanChoice(c[0], c[1], c[2], True, why)
        name, sec, peak = min(self.uniform(costs), key=lambda u: (u[2], u[1]))
        return PlanChoice((name,) * self.num_layers, sec, peak, False, "nothing fits")
