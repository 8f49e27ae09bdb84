"""The pipeline step planner: one step's micro-batches planned together under megatron's 1F1B schedule.

With pipeline parallelism (P stages, megatron-core's ``forward_backward_pipelining_without_
interleaving``) stage r holds layers ``[r*L/P, (r+1)*L/P)`` and runs

    min(P - r - 1, M) warm-up forwards, then one forward / one backward, then the cool-down backwards,

so it holds up to ``min(P - r, M)`` micro-batches' activations at once. With varying lengths a
stage's peak is the largest sum over the micro-batches in flight, not one micro-batch's peak.
Each stage is priced by its cost model (``costmodel/stage.py``: ``stage_cost_model``) and the
step is timed by the 1F1B simulation (``costmodel/schedule.py``: ``simulate_1f1b``).

:class:`PipelinePlanner` holds one stage planner per stage (``build_planner`` on the stage
models); :meth:`PipelinePlanner.plan_step` starts every micro-batch at each stage's fastest
plan that fits it alone, then, while some stage peaks over its limit, takes the op furthest
over and switches, among the micro-batches in flight there, the one whose leaner plan saves
the most bytes there per added second (the stage planner's fastest plan under a lower
limit, ``Planner.choose_under``: 1/8 of the micro-batch's peak lower, else 1/4, 1/2, the
leanest); when none lowers it, among those held there (not the one running), the one whose
plan that keeps fewer bytes from its forward to its backward at no higher peak
(``_Trial.less_held``) saves the most there per added second; it stops with ``fits=False``
when no switch lowers that op. It tries a few run orders of the step (:func:`candidate_orders`,
among them one with the longest micro-batches P apart), keeps the fastest that fits, and gives
its tightened pairs back the fastest plan that still fits where one does (one greedy pass).
One run order being planned is a :class:`_Trial`; what a step computes once per stage and
micro-batch lives in its :class:`_StepMemo`, under typed keys.

The memory of one op on a stage (a micro-batch's forward or backward) is

    static + pool(in-flight) + act(running) + sum_{k in flight, k != running} held(k)

``act``: the running micro-batch's own peak above static and pool (the stage planner's,
forward or backward alike: a bound for the forward); ``held``: what a micro-batch keeps between
its forward and its backward (its layers' saved bytes, the stage's pipeline tensors and, on the
last stage, the non-layer saved bytes); ``pool``: each buffer name once at its largest size over
the micro-batches in flight (a bound: exact if the pool keeps its buffers across interleaved
micro-batches). The in-flight sets depend only on the run order, so memory is checked without
timing; the simulation gives the step time.

Under megatron's interleaved schedule (``num_chunks`` V > 1: each rank holds V model chunks,
its L/P layers laid out chunk after chunk) the ops are chunks of micro-batches in megatron's
interleaved order (``costmodel/schedule.py``: ``interleaved_order``, ``simulate_interleaved``,
a chunk taking 1/V of its micro-batch's stage seconds); each other (chunk, micro-batch) in
flight holds its chunk's input tensor and 1/V of the micro-batch's other saved bytes on the
stage (``_Part.chunk_held``), the running one its own chunk's peak (``_Part.chunk_act``: its
micro-batch's peak on the stage less the other V - 1 chunks' share of its saved bytes, which
are counted among the chunks in flight; before, they were counted twice: the interleaved
benchmark's stage peaks were over-predicted by up to 39%, docs/benchmark.md).

Online refinement: one :class:`~megatron_paradyse.planner.refine.Refinement` per stage planner,
fed by its own stage's ranks (:meth:`PipelinePlanner.contribution`, :meth:`PipelinePlanner.refine`:
every stage's slot in one all-reduce over the world).
"""
from __future__ import annotations

import math
from typing import NamedTuple

from ..costmodel.base import union_bytes
from ..costmodel.schedule import (StageOp, Schedule, interleaved_group, interleaved_order, one_f_one_b,
                                  simulate_1f1b, simulate_interleaved)
from ..costmodel.stage import FORWARD_SHARE, StageCostModel, forward_share, stage_cost_model
from ..parallel.packing import PackShape, seq_tokens
from ..parallel.plans import describe
from .build import build_planner
from .core import Costs, PlanChoice, fmt_bytes, layers_of, plan_key
from .refine import Refinement

MAX_TIGHTENINGS = 100000      # a guard: each switch lowers one (stage, micro-batch)'s (peak, held)
STEP = 1.0 / 8                # a leaner plan is sought 1/8 of the micro-batch's peak lower, then
LADDER = 4                    # 1/4, 1/2, all of it (down to the leanest uniform plan's peak)


def forward_seconds(costs, layers) -> float:
    """A micro-batch's forward seconds on a stage: a third of each plain layer's and of the
    non-layer part's, a quarter of a recomputed layer's (forward, then in backward the forward
    again and the backward: 4 passes of which 1 runs in the forward)."""
    index = {n: i for i, n in enumerate(costs.names)}
    sec = costs.t0 * FORWARD_SHARE
    for e in layers:
        sec += costs.t[index[e]] * forward_share(e)
    return sec


# ------------------------------------------------------------------------------------------
# a step's plans, run orders


class StepPlan(NamedTuple):
    """A pipelined step's plans (micro-batch indices are into the step's ``shapes``)."""

    order: tuple          # the run order
    plans: tuple          # per micro-batch: its full plan (L entries, stage after stage)
    stage_plans: tuple    # [stage][micro-batch]: the stage planner's PlanChoice (alone on its stage)
    stage_peaks: tuple    # per stage: predicted peak bytes over the schedule
    stage_limits: tuple   # per stage: budget - margin
    stage_seconds: tuple  # per stage: busy seconds (forwards and backwards)
    makespan: float       # the pipeline's seconds, bubbles included
    seconds: float        # the step: when the last stage's update ends (makespan + update)
    fits: bool
    message: str          # when nothing fits: the stage, the micro-batches in flight, the numbers
    offenders: tuple = ()  # when nothing fits: the micro-batches in flight at the failing point
    schedule: Schedule | None = None


class _Part(NamedTuple):
    """One micro-batch on one stage under one plan: what the op memory and the schedule need."""

    choice: PlanChoice
    pool: dict     # its communication pool's buffers
    held: float    # bytes kept from its forward to its backward
    act: float     # its own peak above static and pool
    fwd: float     # forward seconds
    bwd: float     # backward seconds
    resident: float = 0.0  # of ``held``: the stage's input tensor

    def chunk_held(self, num_chunks: int) -> float:
        """What one of its V model chunks keeps from forward to backward (interleaved): its
        own input tensor and 1/V of the rest (the layers' and non-layer saved bytes, split
        evenly: an approximation where the plan differs per chunk)."""
        return self.resident + (self.held - self.resident) / num_chunks

    def chunk_act(self, num_chunks: int) -> float:
        """One chunk's own peak above static and pool (interleaved): the micro-batch's peak on
        the stage less the other chunks' share of its saved bytes (each of those, while in
        flight, is counted by :meth:`chunk_held`)."""
        return self.act - (num_chunks - 1) * (self.held - self.resident) / num_chunks


def _length(shape) -> str:
    """A micro-batch's length as messages show it: ``4096``, ``4096x2`` (b = 2), ``1003 (pack)``."""
    s, b = shape
    if isinstance(s, PackShape):
        return f"{s.tokens} (pack)"
    return f"{int(s)}" + (f"x{b}" if b != 1 else "")


def _counts(pairs) -> dict:
    """Per position, how many of the ``(chunk, position)`` pairs are its."""
    out: dict = {}
    for _, k in pairs:
        out[k] = out.get(k, 0) + 1
    return out


def _pool_bytes(pools) -> float:
    """``union_bytes`` of the pools of the micro-batches in flight (each buffer name once)."""
    if len(pools) == 1:
        return sum(pools[0].values())
    out = dict(pools[0])
    for d in pools[1:]:
        for k, v in d.items():
            if v > out.get(k, 0.0):
                out[k] = v
    return sum(out.values())


def candidate_orders(sizes, num_stages: int = 1) -> list:
    """Run orders to try, the given one first: longest and shortest alternated, shortest and
    longest alternated, longest first, and the longest ``num_stages`` apart (:func:`_spread`;
    ties by index; duplicates dropped)."""
    M = len(sizes)
    desc = sorted(range(M), key=lambda j: (-sizes[j], j))
    asc = sorted(range(M), key=lambda j: (sizes[j], j))
    out = []
    for order in (tuple(range(M)), _alternate(desc), _alternate(asc), tuple(desc), _spread(desc, num_stages)):
        if order not in out:
            out.append(order)
    return out


def _spread(desc, num_stages: int) -> tuple:
    """``desc`` (longest first) dealt into ``P = num_stages`` columns of ``R = ceil(M / P)``
    (column 0 the R longest, column 1 the next R, ...) and read row by row: the R longest at
    positions 0, P, 2P, ... (longest first), each other column shortest first. Under 1F1B
    stage r holds at most ``P - r`` consecutive positions at once, one of each column: no two
    of the R longest are in flight together on any stage, and the longest (position 0) is in
    flight on stage 0 with the shortest of each other column. M <= P: longest first."""
    M, P = len(desc), max(1, int(num_stages))
    R = -(-M // P)
    cols, k = [], 0
    for c in range(P):  # column c holds R cells while the last row reaches it, else R - 1
        n = R if c < M - (R - 1) * P else R - 1
        col = tuple(desc[k:k + n])
        cols.append(col if c == 0 else col[::-1])
        k += n
    return tuple(col[q] for q in range(R) for col in cols if q < len(col))


def _alternate(seq) -> tuple:
    """``a0, a-1, a1, a-2, ...``: the two ends of ``seq`` taken in turn."""
    out, i, k = [], 0, len(seq) - 1
    while i <= k:
        out.append(seq[i])
        if i != k:
            out.append(seq[k])
        i, k = i + 1, k - 1
    return tuple(out)




# ------------------------------------------------------------------------------------------
# a step's memo: what it computes once per stage and micro-batch, under typed keys


class ShapeKey(NamedTuple):
    """A micro-batch on a stage planner: ``stage`` the planner's index (the middle stages,
    alike, share one), ``shape`` its ``(s, b)``."""

    stage: int
    shape: tuple


class PartKey(NamedTuple):
    """A micro-batch on a stage planner under one of its plans (:meth:`PipelinePlanner.part`)."""

    stage: int
    shape: tuple
    choice: PlanChoice


class HeldKey(NamedTuple):
    """The plans holding fewer bytes than ``layers`` (:meth:`PipelinePlanner.held_plans`)."""

    stage: int
    shape: tuple
    layers: tuple


class _Limits:
    """A stage planner's answers under lower limits at one shape (:meth:`PipelinePlanner.under`):
    ``known`` ``[(lowest limit, highest limit, choice)]`` each answer covers; ``none_at`` the
    highest limit under which nothing fits."""

    __slots__ = ("known", "none_at")

    def __init__(self):
        self.known: list = []
        self.none_at = -math.inf


class _StepMemo:
    """One :meth:`PipelinePlanner.plan_step`'s answers (so a step's plans never depend on the
    steps planned before): per kind of answer, a dict under its own key type."""

    __slots__ = ("parts", "limits", "floors", "held")

    def __init__(self):
        self.parts: dict[PartKey, _Part] = {}
        self.limits: dict[ShapeKey, _Limits] = {}
        self.floors: dict[ShapeKey, float] = {}
        self.held: dict[HeldKey, list] = {}


# ------------------------------------------------------------------------------------------
# the planner


class PipelinePlanner:
    """Plans a whole step's micro-batches over ``num_stages`` pipeline stages (module docstring).

    ``kind``, ``cost_model``, ``memory_budget_bytes`` (per rank, every stage alike) and the
    options (``margin_bytes``, ``gamma``, ``strategies``, ``refinement``: one shared by the
    stages, ``device_kind``, ``recompute``, ``recompute_chunk``, ``recompute_first``: per
    stage, other keywords) are ``build_planner``'s, applied to each stage's cost model.
    ``reorder``: also try :func:`candidate_orders` and keep the fastest run order that fits.
    ``num_chunks`` V > 1: megatron's interleaved schedule (module docstring's last section).
    Deterministic, no state between steps (no hysteresis), no collectives.
    """

    def __init__(self, kind: str, cost_model, memory_budget_bytes: float, num_stages: int,
                 reorder: bool = True, refinement=None, strategies=None, num_chunks: int = 1, **options):
        P = self.num_stages = int(num_stages)
        self.num_chunks = int(num_chunks)
        if self.num_chunks > 1 and cost_model.num_layers % (P * self.num_chunks):
            raise ValueError(f"{cost_model.num_layers} layers do not split over {P} stages x {self.num_chunks} chunks")
        # the middle stages (neither first nor last) are alike: one model and one planner (and
        # its cache) serve them all
        role = [r if r in (0, P - 1) else 1 for r in range(P)]
        models = {k: stage_cost_model(cost_model, k, P) for k in sorted(set(role))}
        if refinement is True:  # one per stage planner: each stage's measurements refine its own
            names = tuple(strategies) if strategies is not None else tuple(cost_model.strategies)
            refinement = {k: Refinement(names) for k in models}
        refined = refinement if isinstance(refinement, dict) else {k: refinement for k in models}
        self.refinements = [refined[k] for k in sorted(models)]  # per stage planner (role)
        planners = {k: build_planner(kind, m, memory_budget_bytes, refinement=refined[k], strategies=strategies,
                                     **options) for k, m in models.items()}
        self.models: list[StageCostModel] = [models[k] for k in role]
        self.stages = [planners[k] for k in role]
        self._role = role  # per stage, its planner's index (the memo keys' ``stage``)
        self.kind, self.cm, self.reorder = kind, cost_model, bool(reorder)
        self.num_layers = int(cost_model.num_layers)
        self._static = [m.static_bytes() for m in self.models]
        self._memo = _StepMemo()  # one step's answers (plan_step)
        first = self.stages[0]
        self.budget, self.margin, self.limit, self.multiple = first.budget, first.margin, first.limit, first.multiple

    # -------------------------------------------------------------- online refinement
    def refines(self) -> bool:
        """Whether each stage planner has its own online refinement."""
        return all(r is not None for r in self.refinements) and len(set(map(id, self.refinements))) == len(self.refinements)

    def contribution(self, stage: int, micro, predicted_seconds: float, measured_seconds,
                     predicted_peak: float, measured_peak, micro_batch: int = 1) -> list:
        """One rank of stage ``stage``: its step as the refinement's vector, in its stage
        planner's slot of one vector for all of them (zeros elsewhere); ``micro``: [(the
        stage's plan entries, padded length)] of the step's micro-batches. Summed over the
        world (:meth:`refine`), each stage's factors come from its own ranks' measurements."""
        roles = sorted(set(self._role))
        size = self.refinements[0].size()
        out = [0.0] * (size * len(roles))
        slot = roles.index(self._role[stage])
        pl = self.stages[stage]
        vec = self.refinements[slot].contribution(
            micro, predicted_seconds, measured_seconds, predicted_peak, measured_peak,
            layer_seconds=lambda n, s: pl.layer_seconds(n, s, micro_batch))
        out[slot * size:(slot + 1) * size] = vec
        return out

    def refine(self, contribution, group=None) -> bool:
        """All-reduce (SUM) the ranks' :meth:`contribution` s over ``group`` (the world) in one
        collective and apply each stage planner's slot; whether some planner's view changed."""
        import torch
        import torch.distributed as dist

        from ..parallel.plan_check import collective_device

        t = torch.tensor(contribution, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            t = t.to(collective_device())
            dist.all_reduce(t, group=group)
            t = t.cpu()
        size, summed = self.refinements[0].size(), t.tolist()
        moved = [ref.apply(summed[i * size:(i + 1) * size]) for i, ref in enumerate(self.refinements)]
        return any(moved)

    def refinement_versions(self) -> tuple:
        return tuple(ref.version for ref in self.refinements)

    # -------------------------------------------------------------- one micro-batch on a stage
    def part(self, r: int, shape, choice: PlanChoice) -> _Part:
        """``choice`` for the micro-batch ``shape`` on stage ``r`` as a :class:`_Part`
        (memoized for the step)."""
        key = PartKey(self._role[r], shape, choice)
        got = self._memo.parts.get(key)
        if got is None:
            got = self._memo.parts[key] = self._new_part(r, shape, choice)
        return got

    def _new_part(self, r: int, shape, choice: PlanChoice) -> _Part:
        """:meth:`part`, computed: the plan's pool buffers, held bytes (its layers' saved
        bytes, the stage's input, the non-layer saved bytes), own peak and split seconds."""
        pl, (s, b) = self.stages[r], shape
        costs = pl.costs(s, b)
        index = {n: i for i, n in enumerate(costs.names)}
        used = sorted({index[e] for e in choice.layers})
        pool = {}
        if costs.pool:
            for d in [costs.pool0] + [costs.pool[i] for i in used]:
                for k, v in d.items():
                    pool[k] = max(pool.get(k, 0.0), float(v))
        fm = pl.refinement.factors("nonlayer", s)[1] if pl.refinement is not None else 1.0
        model = self.models[r]
        held = (model.resident_bytes(s, b) + model.nonlayer(s, b).saved_bytes) * fm \
            + sum(costs.m[index[e]] for e in choice.layers)
        fwd = forward_seconds(costs, choice.layers)
        return _Part(choice, pool, held, choice.peak_bytes - costs.base - union_bytes([pool]),
                     fwd, choice.seconds - fwd, model.resident_bytes(s, b) * fm)

    def under(self, r: int, shape, limit: float) -> PlanChoice:
        """Stage ``r``'s ``choose_under(s, b, limit)`` through this step's memo: the answer under
        a limit also answers every limit from its own peak up to that one (exact for the optimal
        planner: the fastest plan under the larger limit fits the smaller), and nothing fits
        under a limit at or below one where nothing did. The memo lives for one
        :meth:`plan_step`, so a step's plans never depend on the steps planned before."""
        pl = self.stages[r]
        limit = min(float(limit), pl.limit)
        key = ShapeKey(self._role[r], tuple(shape))
        got = self._memo.limits.get(key)
        if got is None:
            got = self._memo.limits[key] = _Limits()
        for lo, hi, c in got.known:
            if lo <= limit <= hi:
                return c
        if limit <= got.none_at:
            return pl.choose_under(shape[0], shape[1], got.none_at)
        c = pl.choose_under(shape[0], shape[1], limit)
        if c.fits:
            got.known.append((c.peak_bytes, limit, c))
        else:
            got.none_at = limit
        return c

    def floor(self, r: int, shape) -> float:
        """The peak of stage ``r``'s leanest uniform plan at ``shape`` (memoized for the step)."""
        key = ShapeKey(self._role[r], shape)
        got = self._memo.floors.get(key)
        if got is None:
            got = self._memo.floors[key] = self.stages[r].leanest(*shape)[2]
        return got

    def held_plans(self, r: int, shape, layers) -> list:
        """Plans of the micro-batch ``shape`` on stage ``r`` that hold fewer bytes than the plan
        ``layers`` between forward and backward, each within the stage's limit alone, fastest
        first (ties: the lower peak, then by name): for each candidate ``e`` (a plan entry)
        that saves less per layer than some layer of ``layers``, ``layers`` with its 1, 2, ...
        largest-saving layers moved to ``e`` (down to ``e``'s uniform plan if every layer saves
        more), laid out largest transient first and priced as the stage planner prices its
        plans (ordered peak, or the order-free bound). Points along the held bytes / seconds
        trade-off from the current plan to each leaner uniform one, at most ``E x L / P`` of
        them (E candidates); memoized for the step."""
        key = HeldKey(self._role[r], shape, layers)
        got = self._memo.held.get(key)
        if got is None:
            got = self._memo.held[key] = self._new_held_plans(r, shape, layers)
        return got

    def _new_held_plans(self, r: int, shape, layers) -> list:
        """:meth:`held_plans`, computed."""
        pl = self.stages[r]
        costs = pl.costs(*shape)
        index = {n: i for i, n in enumerate(costs.names)}
        mine = sorted((index[e] for e in layers), key=lambda i: (-costs.m[i], i))  # largest saving first
        seen, out = set(), []
        for e in range(len(costs.names)):
            if costs.base + costs.m[e] + max(costs.x[e], costs.x0) > pl.limit:
                continue  # no plan with a layer of e fits the stage alone
            out += self._moved_to(r, costs, mine, e, seen)
        out.sort(key=lambda c: (c.seconds, c.peak_bytes, c.layers))
        return out

    def _moved_to(self, r: int, costs: Costs, mine: list, e: int, seen: set) -> list:
        """The plans of :meth:`held_plans` for candidate ``e``: the layers ``mine`` (indices,
        largest saving first) with their 1, 2, ... largest-saving ones moved to ``e`` while
        they save more than ``e``; each new plan (not in ``seen``) that fits the stage alone."""
        pl, name, out = self.stages[r], costs.names[e], []
        evaluate = pl.evaluate_ordered if pl.order == "ordered" else pl.evaluate
        counts = {}
        for i in mine:
            counts[costs.names[i]] = counts.get(costs.names[i], 0) + 1
        for i in mine:
            if costs.m[i] <= costs.m[e]:
                break
            counts[costs.names[i]] -= 1
            counts[name] = counts.get(name, 0) + 1
            plan = tuple(sorted((n, k) for n, k in counts.items() if k))
            if plan in seen:
                continue
            seen.add(plan)
            sec, peak = evaluate(costs, dict(plan))
            if peak <= pl.limit:
                out.append(PlanChoice(layers_of(dict(plan), costs), sec, peak, True,
                                      "holds fewer bytes between forward and backward (pipeline)"))
        return out

    # -------------------------------------------------------------- one run order
    def windows(self, order) -> list:
        """Per stage, its :class:`~megatron_paradyse.costmodel.schedule.StageOp` s in 1F1B order
        or the interleaved one (untimed: the in-flight positions are all memory needs)."""
        P, M, V = self.num_stages, len(order), self.num_chunks
        if V > 1:
            return [interleaved_order(r, P, M, V, interleaved_group(M, P)) for r in range(P)]
        return [one_f_one_b(r, P, M) for r in range(P)]

    def timed(self, parts, order) -> tuple:
        """(schedule, step seconds) of ``parts`` run in ``order``: the 1F1B (interleaved)
        simulation, a chunk taking 1/V of its micro-batch's stage seconds, then each stage's
        update after its last backward."""
        P, V = self.num_stages, self.num_chunks
        if V > 1:
            group = interleaved_group(len(order), P)
            sched = simulate_interleaved([[[parts[r][j].fwd / V for j in order]] * V for r in range(P)],
                                         [[[parts[r][j].bwd / V for j in order]] * V for r in range(P)], group)
        else:
            sched = simulate_1f1b([[parts[r][j].fwd for j in order] for r in range(P)],
                                  [[parts[r][j].bwd for j in order] for r in range(P)])
        return sched, max(sched.ends[r] + self.stages[r].update_seconds() for r in range(P))

    def whole_plan(self, stage_layers) -> tuple:
        """A micro-batch's full plan from its stages' plans (``stage_layers[r]``): stage after
        stage; interleaved, chunk after chunk, each stage's plan split evenly over its chunks."""
        V = self.num_chunks
        n = len(stage_layers[0]) // V
        return tuple(e for c in range(V) for layers in stage_layers for e in layers[c * n:(c + 1) * n])

    # -------------------------------------------------------------- the API
    def _shapes(self, shapes) -> list:
        """``[(s, b)]`` as the stage planners key them; ValueError for an empty step."""
        out = [(plan_key(s), int(b)) for s, b in shapes]
        if not out:
            raise ValueError("a step needs at least one micro-batch")
        for s, b in out:
            self.stages[0]._key(s, b)
        return out

    def plan_step(self, shapes, reorder: bool | None = None) -> StepPlan:
        """The step's plans for micro-batches ``shapes`` = ``[(s, b)]`` (s a length or a
        ``PackShape``): the given run order first and, with ``reorder`` (default the
        planner's), :func:`candidate_orders`; the fastest that fits (ties: the earlier), else
        the given order's answer with ``fits=False``."""
        shapes = self._shapes(shapes)
        self._memo = _StepMemo()
        reorder = self.reorder if reorder is None else reorder
        sizes = [seq_tokens(s) * b for s, b in shapes]
        orders = candidate_orders(sizes, self.num_stages) if reorder else [tuple(range(len(shapes)))]
        fastest = [[self.part(r, sh, pl.choose(*sh)) for sh in shapes] for r, pl in enumerate(self.stages)]
        first = best = None
        for order in orders:
            # tightening only slows plans down: an order whose fastest plans are not faster than
            # the best fitting step so far cannot win (exact for the optimal planner)
            if best is not None and self.timed(fastest, order)[1] >= best[0].seconds:
                continue
            trial = _Trial(self, shapes, order, fastest)
            sp = trial.plan()
            first = first or sp
            if sp.fits and (best is None or sp.seconds < best[0].seconds):
                best = (sp, trial)
        if best is None and len(orders) > 1:  # every order was planned (none pruned without a best)
            return first._replace(message=first.message + f" (and in {len(orders) - 1} other run orders)")
        if best is None:
            return first
        sp, trial = best
        if trial.relax():
            sp = trial.step_plan()
        return sp

    def explain_step(self, shapes, reorder: bool | None = None) -> str:
        """A table per stage (layers, each micro-batch's plan, predicted peak against the limit,
        busy seconds), then the step time and its bubble fraction."""
        shapes = self._shapes(shapes)
        sp = self.plan_step(shapes, reorder)
        P, per = self.num_stages, self.num_layers // self.num_stages
        out = [f"pipeline: {P} stage{'s' * (P != 1)} x {per} layers, {len(shapes)} micro-batches, run order "
               f"{', '.join(map(str, sp.order))}; {self.stages[0].describe()}"]
        for r in range(P):
            out += self._explain_stage(shapes, sp, r, per)
        bubble = 1.0 - sum(sp.stage_seconds) / (P * sp.makespan) if sp.makespan > 0 else 0.0
        out.append(f"step: {sp.seconds:.4f} s = pipeline {sp.makespan:.4f} s + update {sp.seconds - sp.makespan:.4f} s;"
                   f" bubble fraction {100 * bubble:.1f}% (1 - busy / ({P} x pipeline))")
        out.append("fits" if sp.fits else f"does not fit: {sp.message}")
        return "\n".join(out)

    def _explain_stage(self, shapes, sp: StepPlan, r: int, per: int) -> list:
        """:meth:`explain_step`'s lines of stage ``r`` (``per`` layers a stage)."""
        P = self.num_stages
        extra = " + embedding" * (r == 0) + " + output layer, loss" * (r == P - 1)
        over = "fits" if sp.stage_peaks[r] <= sp.stage_limits[r] else "OVER"
        out = [f"== stage {r}: layers {r * per}-{(r + 1) * per - 1}{extra}: peak {fmt_bytes(sp.stage_peaks[r])}"
               f" / limit {fmt_bytes(sp.stage_limits[r])} ({over}), busy {sp.stage_seconds[r]:.4f} s"]
        w = max(len(describe(c.layers)) for c in sp.stage_plans[r]) + 2
        out.append(f"   {'mb':>3} {'length':>12}  {'plan':<{w}} {'seconds':>10} {'alone peak':>14}")
        for j in sp.order:
            c = sp.stage_plans[r][j]
            out.append(f"   {j:>3} {_length(shapes[j]):>12}  {describe(c.layers):<{w}} {c.seconds:10.4f} "
                       f"{fmt_bytes(c.peak_bytes):>14}")
        return out


# ------------------------------------------------------------------------------------------
# one run order


class _Trial:
    """One run order of one step being planned: the micro-batches' ``shapes``, the ``order``,
    each stage's ops in 1F1B order (``windows``) and each (stage, micro-batch)'s current
    :class:`_Part` (``parts[r][j]``, started from each stage's fastest plans alone), tightened
    until every stage fits (:meth:`plan`) and, for the step's best order, relaxed again
    (:meth:`relax`)."""

    def __init__(self, planner: PipelinePlanner, shapes: list, order: tuple, fastest):
        self.pp, self.shapes, self.order = planner, shapes, order
        self.parts = [list(row) for row in fastest]
        self.windows = planner.windows(order)

    def op_bytes(self, r: int, op: StageOp, swap=None) -> float:
        """Stage ``r``'s bytes while ``op`` runs; ``swap`` = (micro-batch, part) evaluates one
        micro-batch under another plan."""
        parts_r, order = self.parts[r], self.order
        held, pools = 0.0, []
        chunks = _counts(op.chunks) if op.chunks else None  # interleaved: chunks in flight per position
        for k in op.in_flight:
            j = order[k]
            p = swap[1] if swap is not None and swap[0] == j else parts_r[j]
            pools.append(p.pool)
            others = (0 if k == op.mb else 1) if chunks is None else chunks[k] - (k == op.mb)
            if k == op.mb:
                act = p.act if chunks is None else p.chunk_act(self.pp.num_chunks)
            held += others * (p.held if chunks is None else p.chunk_held(self.pp.num_chunks))
        return self.pp._static[r] + _pool_bytes(pools) + act + held

    def plan(self) -> StepPlan:
        """The step plan of this order: each stage's fastest plans, tightened until the stages
        fit (not tried when some micro-batch fits no plan alone on some stage)."""
        n = len(self.shapes)
        alone = [(r, j) for r in range(self.pp.num_stages) for j in range(n) if not self.parts[r][j].choice.fits]
        failed = None if alone else self.tighten()
        return self.step_plan(alone, failed)

    def worst(self, stage_bytes):
        """(excess bytes, stage, op) of the op furthest over its stage's limit, or None
        (``stage_bytes[r][i]``: the bytes of stage r's op i)."""
        worst = None
        for r, ops in enumerate(self.windows):
            limit = self.pp.stages[r].limit
            for op, x in zip(ops, stage_bytes[r]):
                if x - limit > 0 and (worst is None or x - limit > worst[0]):
                    worst = (x - limit, r, op)
        return worst

    def tighten(self):
        """Switch micro-batches to leaner plans until every stage fits; None, or the (stage, op)
        no switch of an in-flight micro-batch can lower. At the op furthest over, each
        micro-batch in flight offers its :meth:`leaner` plan (a lower peak); the one saving
        the most bytes there per added second switches. When none lowers the op, the
        micro-batches held there (not the one running) offer their :meth:`less_held` plans
        instead, chosen the same way."""
        stage_bytes = [[self.op_bytes(r, op) for op in ops] for r, ops in enumerate(self.windows)]
        for _ in range(MAX_TIGHTENINGS):
            worst = self.worst(stage_bytes)
            if worst is None:
                return None
            excess, r, op = worst
            best = self.best_switch(self.leaner, r, op, excess, op.in_flight)
            if best is None:
                held = [k for k in op.in_flight if k != op.mb]
                best = self.best_switch(self.less_held, r, op, excess, held)
            if best is None:
                return r, op
            self.parts[r][best[0]] = best[1]
            stage_bytes[r] = [self.op_bytes(r, o) for o in self.windows[r]]
        # each switch lowers a pair's (peak, held) (:meth:`less_held`): cannot happen
        raise RuntimeError("pipeline tightening did not converge")

    def best_switch(self, way, r: int, op: StageOp, excess: float, positions):
        """(micro-batch, part) of the positions' ``way`` plans (:meth:`leaner` or
        :meth:`less_held`) saving the most bytes at ``op`` per added second (one not slower
        first; ties: the lower index), or None when none lowers ``op``."""
        best = None
        for k in positions:
            j = self.order[k]
            got = way(r, j, op, excess)
            if got is None:
                continue
            part, saved, added = got
            key = (added <= 0, saved / added if added > 0 else saved, -j)
            if best is None or key > best[0]:
                best = (key, j, part)
        return None if best is None else best[1:]

    def leaner(self, r: int, j: int, op: StageOp, excess: float):
        """(part, bytes saved at ``op``, seconds added) of micro-batch ``j``'s leaner plan on
        stage ``r`` that lowers ``op`` (``excess`` bytes over the limit), or None: the stage
        planner's fastest plan under its current peak less :data:`STEP` of it, then 2, 4, 8
        times that (never below the leanest uniform plan's peak): the first that lowers ``op``."""
        pp, shape = self.pp, self.shapes[j]
        pl, cur = pp.stages[r], self.parts[r][j]
        peak = cur.choice.peak_bytes
        floor = pp.floor(r, shape)
        before = pl.limit + excess  # op's bytes now
        tried = set()
        for k in range(LADDER):
            limit = max(peak - peak * STEP * 2 ** k, floor)
            if limit >= peak or limit in tried:
                continue
            tried.add(limit)
            c = pp.under(r, shape, limit)
            if not c.fits:
                continue
            part = pp.part(r, shape, c)
            saved = before - self.op_bytes(r, op, swap=(j, part))
            if saved > 0:
                return part, saved, c.seconds - cur.choice.seconds
        return None

    def less_held(self, r: int, j: int, op: StageOp, excess: float):
        """(part, bytes saved at ``op``, seconds added) of micro-batch ``j``'s plan on stage
        ``r`` that holds fewer bytes between its forward and backward, for an ``op`` at which
        ``j`` is held (another micro-batch runs), or None: of
        :meth:`PipelinePlanner.held_plans`'s plans whose peak alone is at most ``j``'s current
        one or the leanest uniform plan's (whichever is higher; within the limit), the fastest
        that lowers ``op``. So a switch never raises the larger of the pair's peak and that
        floor, and lowers its held bytes: with :meth:`leaner`'s switches, which lower that
        larger one, no pair ever returns to a plan (tightening ends)."""
        pp, shape = self.pp, self.shapes[j]
        pl, cur = pp.stages[r], self.parts[r][j]
        bound = min(max(cur.choice.peak_bytes, pp.floor(r, shape)), pl.limit)
        before = pl.limit + excess
        for c in pp.held_plans(r, shape, cur.choice.layers):
            if c.peak_bytes > bound:
                continue
            part = pp.part(r, shape, c)
            if part.held >= cur.held:
                continue
            saved = before - self.op_bytes(r, op, swap=(j, part))
            if saved > 0:
                return part, saved, c.seconds - cur.choice.seconds
        return None

    def relax(self) -> bool:
        """One pass over the tightened (stage, micro-batch) pairs, in stage and run order: the
        fastest plan under the pair's peak plus the room its ops have left, kept where every
        op of the stage still fits and it is faster (greedy tightening can overshoot).
        Whether a plan changed."""
        changed = False
        for r, ops in enumerate(self.windows):
            for k, j in enumerate(self.order):
                changed = self._relax_one(r, ops, k, j) or changed
        return changed

    def _relax_one(self, r: int, ops, k: int, j: int) -> bool:
        """:meth:`relax` of micro-batch ``j`` (position ``k``) on stage ``r``: whether it changed."""
        pp, shape = self.pp, self.shapes[j]
        limit, cur = pp.stages[r].limit, self.parts[r][j]
        if cur.choice.layers == pp.stages[r].choose(*shape).layers:
            return False
        mine = [op for op in ops if k in op.in_flight]
        room = min(limit - self.op_bytes(r, op) for op in mine)
        c = pp.under(r, shape, cur.choice.peak_bytes + room)
        if not c.fits or c.seconds >= cur.choice.seconds:
            return False
        part = pp.part(r, shape, c)
        if all(self.op_bytes(r, op, swap=(j, part)) <= limit for op in mine):
            self.parts[r][j] = part
            return True
        return False

    def step_plan(self, alone=(), failed=None) -> StepPlan:
        """The :class:`StepPlan` of the current parts; ``alone``: the (stage, micro-batch) pairs
        that fit no plan alone; ``failed``: the (stage, op) tightening could not bring under
        the limit."""
        pp, parts, shapes = self.pp, self.parts, self.shapes
        P = pp.num_stages
        peaks = tuple(max(self.op_bytes(r, op) for op in self.windows[r]) for r in range(P))
        sched, seconds = pp.timed(parts, self.order)
        plans = tuple(pp.whole_plan([parts[r][j].choice.layers for r in range(P)]) for j in range(len(shapes)))
        message, offenders = "", ()
        if alone:
            r, j = alone[0]
            offenders = (j,)
            message = (f"stage {r} of {P}: micro-batch {j} (length {_length(shapes[j])}) alone: "
                       f"{parts[r][j].choice.reason}")
        elif failed is not None:
            offenders, message = self.no_fit(*failed)
        return StepPlan(tuple(self.order), plans, tuple(tuple(p.choice for p in parts[r]) for r in range(P)),
                        peaks, tuple(pl.limit for pl in pp.stages), sched.busy, sched.makespan, seconds,
                        not (alone or failed), message, offenders, sched)

    def no_fit(self, r: int, op: StageOp) -> tuple:
        """(offenders, message) for stage ``r`` over its limit at ``op``."""
        js = [self.order[k] for k in op.in_flight]
        need = self.op_bytes(r, op)
        pl, parts_r = self.pp.stages[r], self.parts[r]
        plans = "; ".join(f"{j}: {describe(parts_r[j].choice.layers)}" for j in js)
        return tuple(js), (
            f"stage {r} of {self.pp.num_stages}: micro-batches {', '.join(map(str, js))} (lengths "
            f"{', '.join(_length(self.shapes[j]) for j in js)}) in flight need {fmt_bytes(need)} > limit "
            f"{fmt_bytes(pl.limit)} (budget {fmt_bytes(pl.budget)} - margin {fmt_bytes(pl.margin)}); "
            f"the leanest plans tried ({plans}) leave no leaner one that lowers it: shorter micro-batches, "
            f"more memory or more stages")
