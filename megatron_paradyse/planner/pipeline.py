"""Pipeline stages: one step's micro-batches planned together under megatron's 1F1B schedule.

With pipeline parallelism (P stages, megatron-core's ``forward_backward_pipelining_without_
interleaving``) stage r holds layers ``[r*L/P, (r+1)*L/P)`` and runs

    min(P - r - 1, M) warm-up forwards, then one forward / one backward, then the cool-down backwards,

so it holds up to ``min(P - r, M)`` micro-batches' activations at once. With varying lengths a
stage's peak is the largest sum over the micro-batches in flight, not one micro-batch's peak.
This module has three parts:

* :func:`stage_cost_model`: a :class:`~megatron_paradyse.costmodel.base.CostModel` of one stage
  (its layers, its share of the static memory, the output layer and loss on the last stage,
  the pipeline tensors it keeps);
* :func:`simulate_1f1b`: the schedule (step time with its bubbles, and which micro-batches are
  in flight while each forward and backward runs);
* :class:`PipelinePlanner`: one stage planner per stage (``build_planner`` on the stage
  models); :meth:`PipelinePlanner.plan_step` starts every micro-batch at each stage's fastest
  plan that fits it alone, then, while some stage peaks over its limit, takes the op furthest
  over and switches, among the micro-batches in flight there, the one whose leaner plan saves
  the most bytes there per added second (the stage planner's fastest plan under a lower
  limit, ``Planner.choose_under``: 1/8 of the micro-batch's peak lower, else 1/4, 1/2, the
  leanest); when none lowers it, among those held there (not the one running), the one whose
  plan that keeps fewer bytes from its forward to its backward at no higher peak
  (``PipelinePlanner._less_held``) saves the most there per added second; it stops with
  ``fits=False`` when no switch lowers that op. It tries a few run orders of the step
  (:func:`candidate_orders`, among them one with the longest micro-batches P apart), keeps
  the fastest that fits, and gives its tightened pairs back the fastest plan that still fits
  where one does (one greedy pass).

The memory of one op on a stage (a micro-batch's forward or backward) is

    static + pool(in-flight) + act(running) + sum_{k in flight, k != running} held(k)

``act``: the running micro-batch's own peak above static and pool (the stage planner's,
forward or backward alike: a bound for the forward); ``held``: what a micro-batch keeps between
its forward and its backward (its layers' saved bytes, the stage's pipeline tensors and, on the
last stage, the non-layer saved bytes); ``pool``: each buffer name once at its largest size over
the micro-batches in flight (a bound: exact if the pool keeps its buffers across interleaved
micro-batches). The in-flight sets depend only on the run order, so memory is checked without
timing; the simulation gives the step time.
"""
from __future__ import annotations

import logging
import math
from typing import NamedTuple

from ..costmodel.analytic import param_counts
from ..costmodel.base import CostModel, LayerCost, union_bytes
from ..parallel.packing import PackShape, seq_tokens
from ..parallel.plans import describe, split_entry
from .core import NoFitError, PlanChoice, fmt_bytes, last_true, layers_of, plan_key

log = logging.getLogger(__name__)

FORWARD_SHARE = 1.0 / 3.0     # a layer's (and the non-layer part's) forward: 1 of 3 passes
RC_FORWARD_SHARE = 1.0 / 4.0  # a recomputed layer's: 1 of 4 (its backward runs the forward again)
BLOCK_FORWARD_SHARE = 0.3     # a layer with one block recomputed: 1 of 3 passes plus that block's


def forward_share(entry: str) -> float:
    """The share of a layer's forward + backward seconds spent in its forward, by plan entry."""
    kind = split_entry(entry)[1]
    return FORWARD_SHARE if kind is None else RC_FORWARD_SHARE if kind == "layer" else BLOCK_FORWARD_SHARE
MAX_TIGHTENINGS = 100000      # a guard: each switch lowers one (stage, micro-batch)'s (peak, held)
STEP = 1.0 / 8                # a leaner plan is sought 1/8 of the micro-batch's peak lower, then
LADDER = 4                    # 1/4, 1/2, all of it (down to the leanest uniform plan's peak)


# ------------------------------------------------------------------------------------------
# the stage view


def stage_fraction(cost_model, stage: int, num_stages: int) -> float:
    """The share of the model's parameters on ``stage``: its layers, the embedding on the
    first, the final norm and output layer on the last (``analytic.param_counts``); without
    a ``shape`` on the cost model, an even split (1 / num_stages)."""
    shape = getattr(cost_model, "shape", None)
    if shape is None:
        return 1.0 / num_stages
    pc = param_counts(shape)
    total = pc["layers"] + pc["embedding"] + pc["output"] + pc["final_norm"]
    part = pc["per_layer"] * shape.num_layers / num_stages
    part += pc["embedding"] if stage == 0 else 0.0
    part += pc["output"] + pc["final_norm"] if stage == num_stages - 1 else 0.0
    return part / total


class StageCostModel(CostModel):
    """One pipeline stage of a whole-model cost model (see :func:`stage_cost_model`)."""

    def __init__(self, cost_model, stage: int, num_stages: int):
        L, P = int(cost_model.num_layers), int(num_stages)
        if P < 1 or not 0 <= stage < P:
            raise ValueError(f"stage {stage} of {P}: need 0 <= stage < num_stages and num_stages >= 1")
        if L < 1 or L % P:
            raise ValueError(f"{L} layers do not split evenly over {P} pipeline stages")
        self.model, self.stage, self.num_stages = cost_model, int(stage), P
        self.first, self.last = stage == 0, stage == P - 1
        self.num_layers = L // P
        self.strategies = tuple(cost_model.strategies)
        if getattr(cost_model, "shape", None) is not None:
            self.shape = cost_model.shape  # the whole model's (p, the layer geometry)
        self.fraction = stage_fraction(cost_model, stage, P)

    def layers(self) -> range:
        """The model's layer indices this stage runs."""
        return range(self.stage * self.num_layers, (self.stage + 1) * self.num_layers)

    def layer(self, strategy: str, s, b: int) -> LayerCost:
        return self.model.layer(strategy, s, b)

    def pool(self, strategy: str, s, b: int) -> dict:
        if strategy == "nonlayer" and not self.last:
            return {}  # the output layer's buffers: last stage only
        return self.model.pool(strategy, s, b)

    def recomputes(self) -> bool:
        return bool(self.model.recomputes())

    def recompute_kinds(self) -> tuple:
        return tuple(getattr(self.model, "recompute_kinds", lambda: ("layer",) if self.recomputes() else ())())

    def device_kind(self) -> str:
        return self.model.device_kind()

    def static_bytes(self) -> float:
        return float(self.model.static_bytes()) * self.fraction

    def update_seconds(self) -> float:
        """The model's update seconds times this stage's parameter share (the stages update at once)."""
        return float(self.model.update_seconds()) * self.fraction

    def nonlayer(self, s, b: int) -> LayerCost:
        """The whole non-layer part on the last stage (output layer and loss; the embedding's
        lookup, tiny, is counted there too), nothing elsewhere."""
        return self.model.nonlayer(s, b) if self.last else LayerCost(0.0, 0.0, 0.0)

    def resident_bytes(self, s, b: int) -> float:
        """The stage's input ``[s/p, b, h]`` (embedding output, or the received pipeline input),
        on every stage. A non-last stage's output sent on is kept until its backward (megatron
        frees its data only with ``deallocate_pipeline_outputs``, off here), but it is the last
        layer's output, already in that layer's saved bytes (``costmodel/measure.py``: a
        layer's saved bytes include its output), so it is not counted again. Measured (PP = 2 x
        p = 2, the demo shape, CPU live-bytes tracker, metp / metp:rc / tp_sp:rc / tp_sp on
        every layer): the live bytes a micro-batch leaves on stage 0 from its forward to its
        backward (pool aside) were the planner's held less exactly one ``[s/p, b, h]`` when
        this counted the output too (0.694 MiB at s = 2844, 0.440 at 1804)."""
        return float(self.model.resident_bytes(s, b))


def stage_cost_model(cost_model, stage: int, num_stages: int) -> StageCostModel:
    """A cost model of ``stage`` (0-based) of ``num_stages``: ``num_layers = L / P`` (megatron's
    even split; ValueError otherwise); ``layer``, ``pool``, ``recomputes`` and ``device_kind``
    delegate; ``static_bytes`` and ``update_seconds`` are the stage's parameter share
    (:func:`stage_fraction`: exact for the analytic and fitted models, whose static bytes are
    bytes per parameter times parameters; an even split for a cost model without ``shape``);
    ``nonlayer`` the whole non-layer part on the last stage, zero elsewhere; ``resident_bytes``
    the stage's input (:meth:`StageCostModel.resident_bytes`: the cost model's
    ``resident_bytes``, which for a model without ``shape`` is its non-layer saved bytes, an
    upper bound; the output sent on is the last layer's, in its saved bytes). One stage of one
    is the model itself."""
    return StageCostModel(cost_model, stage, num_stages)


# ------------------------------------------------------------------------------------------
# the schedule


class StageOp(NamedTuple):
    """One forward (``"F"``) or backward (``"B"``) of a micro-batch on a stage."""

    kind: str
    mb: int             # position in the run order
    start: float
    end: float
    in_flight: tuple    # positions whose forward is done (or running) and backward not done


class Schedule(NamedTuple):
    makespan: float     # seconds from the first forward to the last backward (bubbles included)
    busy: tuple         # per stage: seconds of its forwards and backwards
    ends: tuple         # per stage: when its last backward ends
    ops: tuple          # per stage: its Ops in the order it runs them


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list:
    """``[(kind, position)]`` in the order megatron's 1F1B runs them on ``stage``: ``w =
    min(P - r - 1, M)`` warm-up forwards, then ``M - w`` pairs (forward of ``w + i``, backward
    of ``i``), then the ``w`` cool-down backwards."""
    M = int(num_microbatches)
    w = min(num_stages - stage - 1, M)
    ops = [("F", j) for j in range(w)]
    for i in range(M - w):
        ops += [("F", w + i), ("B", i)]
    return ops + [("B", j) for j in range(M - w, M)]


def in_flight_sets(ops) -> list:
    """Per op of a stage's order, the positions in flight while it runs (itself included)."""
    live, out = set(), []
    for kind, j in ops:
        live.add(j)
        out.append(tuple(sorted(live)))
        if kind == "B":
            live.discard(j)
    return out


def simulate_1f1b(fwd, bwd) -> Schedule:
    """The 1F1B step of ``fwd[r][j]`` / ``bwd[r][j]`` seconds (stage r, micro-batch j in run
    order): each stage runs its ops in :func:`one_f_one_b` order, an op starting when the stage
    is free and its input is there: F(r, j) after F(r-1, j); B(r, j) after B(r+1, j), on the
    last stage after F(P-1, j). Communication takes no time and a send does not wait for its
    receiver."""
    P, M = len(fwd), len(fwd[0]) if fwd else 0
    orders = [one_f_one_b(r, P, M) for r in range(P)]
    flights = [in_flight_sets(o) for o in orders]
    done = {}  # (kind, r, j) -> end
    clock, pos = [0.0] * P, [0] * P
    ops = [[] for _ in range(P)]
    moved = True
    while moved:
        moved = False
        for r in range(P):
            while pos[r] < len(orders[r]):
                kind, j = orders[r][pos[r]]
                dep = (("F", r - 1, j) if r > 0 else None) if kind == "F" else \
                    (("B", r + 1, j) if r < P - 1 else ("F", r, j))
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                end = start + (fwd[r][j] if kind == "F" else bwd[r][j])
                done[(kind, r, j)] = clock[r] = end
                ops[r].append(StageOp(kind, j, start, end, flights[r][pos[r]]))
                pos[r] += 1
                moved = True
    if any(pos[r] < len(orders[r]) for r in range(P)):
        raise RuntimeError("1F1B schedule deadlocked")  # cannot happen: 1F1B is deadlock-free
    busy = tuple(float(sum(fwd[r]) + sum(bwd[r])) for r in range(P))
    return Schedule(max(clock, default=0.0), busy, tuple(clock), tuple(tuple(o) for o in ops))


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
# the planner


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


def _length(shape) -> str:
    """A micro-batch's length as messages show it: ``4096``, ``4096x2`` (b = 2), ``1003 (pack)``."""
    s, b = shape
    if isinstance(s, PackShape):
        return f"{s.tokens} (pack)"
    return f"{int(s)}" + (f"x{b}" if b != 1 else "")


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


class PipelinePlanner:
    """Plans a whole step's micro-batches over ``num_stages`` pipeline stages (module docstring).

    ``kind``, ``cost_model``, ``memory_budget_bytes`` (per rank, every stage alike) and the
    options (``margin_bytes``, ``gamma``, ``strategies``, ``refinement``: one shared by the
    stages, ``device_kind``, ``recompute``, ``recompute_chunk``, other keywords) are
    ``build_planner``'s, applied to each stage's cost model. ``reorder``: also try
    :func:`candidate_orders` and keep the fastest run order that fits. Deterministic, no state
    between steps (no hysteresis), no collectives.
    """

    def __init__(self, kind: str, cost_model, memory_budget_bytes: float, num_stages: int,
                 reorder: bool = True, refinement=None, strategies=None, **options):
        from . import Refinement, build_planner  # the package imports this module
        if refinement is True:
            refinement = Refinement(tuple(strategies) if strategies is not None else tuple(cost_model.strategies))
        P = self.num_stages = int(num_stages)
        # the middle stages (neither first nor last) are alike: one model and one planner (and
        # its cache) serve them all
        role = [r if r in (0, P - 1) else 1 for r in range(P)]
        models = {k: stage_cost_model(cost_model, k, P) for k in sorted(set(role))}
        planners = {k: build_planner(kind, m, memory_budget_bytes, refinement=refinement, strategies=strategies,
                                     **options) for k, m in models.items()}
        self.models = [models[k] for k in role]
        self.stages = [planners[k] for k in role]
        self.kind, self.cm, self.reorder = kind, cost_model, bool(reorder)
        self.num_layers = int(cost_model.num_layers)
        self._static = [m.static_bytes() for m in self.models]
        self._memo: dict = {}  # one step's answers under limits, parts, leanest peaks (plan_step)
        first = self.stages[0]
        self.budget, self.margin, self.limit, self.multiple = first.budget, first.margin, first.limit, first.multiple

    # -------------------------------------------------------------- one micro-batch on a stage
    def _part(self, r: int, shape, choice: PlanChoice) -> _Part:
        """``choice`` for the micro-batch ``shape`` on stage ``r`` as a :class:`_Part`
        (memoized for the step, with :meth:`_under`'s answers)."""
        key = ("part", id(self.stages[r]), shape, choice)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self._new_part(r, shape, choice)
        return got

    def _new_part(self, r: int, shape, choice: PlanChoice) -> _Part:
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
                     fwd, choice.seconds - fwd)

    def _under(self, r: int, shape, limit: float) -> PlanChoice:
        """Stage ``r``'s ``choose_under(s, b, limit)`` through this step's memo: the answer under
        a limit also answers every limit from its own peak up to that one (exact for the optimal
        planner: the fastest plan under the larger limit fits the smaller), and nothing fits
        under a limit at or below one where nothing did. The memo lives for one
        :meth:`plan_step`, so a step's plans never depend on the steps planned before."""
        pl = self.stages[r]
        limit = min(float(limit), pl.limit)
        known, none_at = self._memo.setdefault((id(pl),) + tuple(shape), ([], [-math.inf]))
        for lo, hi, c in known:
            if lo <= limit <= hi:
                return c
        if limit <= none_at[0]:
            return pl.choose_under(shape[0], shape[1], none_at[0])
        c = pl.choose_under(shape[0], shape[1], limit)
        if c.fits:
            known.append((c.peak_bytes, limit, c))
        else:
            none_at[0] = limit
        return c

    def _op_bytes(self, r: int, parts_r, order, op, swap=None) -> float:
        """Stage ``r``'s bytes while ``op`` = (kind, position, in-flight positions) runs;
        ``swap`` = (micro-batch, part) evaluates one micro-batch under another plan."""
        _, pos, flight = op
        held, pools = 0.0, []
        for k in flight:
            j = order[k]
            p = swap[1] if swap is not None and swap[0] == j else parts_r[j]
            pools.append(p.pool)
            if k == pos:
                act = p.act
            else:
                held += p.held
        return self._static[r] + _pool_bytes(pools) + act + held

    # -------------------------------------------------------------- one run order
    def _windows(self, order) -> list:
        """Per stage, its ops as (kind, position, in-flight positions) in 1F1B order."""
        out = []
        for r in range(self.num_stages):
            ops = one_f_one_b(r, self.num_stages, len(order))
            out.append([(k, j, f) for (k, j), f in zip(ops, in_flight_sets(ops))])
        return out

    def _worst(self, stage_bytes, windows):
        """(excess bytes, stage, op) of the op furthest over its stage's limit, or None
        (``stage_bytes[r][i]``: the bytes of stage r's op i)."""
        worst = None
        for r, ops in enumerate(windows):
            limit = self.stages[r].limit
            for op, x in zip(ops, stage_bytes[r]):
                if x - limit > 0 and (worst is None or x - limit > worst[0]):
                    worst = (x - limit, r, op)
        return worst

    def _leaner(self, r: int, j: int, shape, parts, order, op, excess: float):
        """(part, bytes saved at ``op``, seconds added) of micro-batch ``j``'s leaner plan on
        stage ``r`` that lowers ``op`` (``excess`` bytes over the limit), or None: the stage
        planner's fastest plan under its current peak less :data:`STEP` of it, then 2, 4, 8
        times that (never below the leanest uniform plan's peak): the first that lowers ``op``."""
        pl, cur = self.stages[r], parts[r][j]
        peak = cur.choice.peak_bytes
        floor = self._floor(r, shape)
        before = pl.limit + excess  # op's bytes now
        tried = set()
        for k in range(LADDER):
            limit = max(peak - peak * STEP * 2 ** k, floor)
            if limit >= peak or limit in tried:
                continue
            tried.add(limit)
            c = self._under(r, shape, limit)
            if not c.fits:
                continue
            part = self._part(r, shape, c)
            saved = before - self._op_bytes(r, parts[r], order, op, swap=(j, part))
            if saved > 0:
                return part, saved, c.seconds - cur.choice.seconds
        return None

    def _less_held(self, r: int, j: int, shape, parts, order, op, excess: float):
        """(part, bytes saved at ``op``, seconds added) of micro-batch ``j``'s plan on stage
        ``r`` that holds fewer bytes between its forward and backward, for an ``op`` at which
        ``j`` is held (another micro-batch runs), or None: of :meth:`_held_plans`'s plans whose
        peak alone is at most ``j``'s current one or the leanest uniform plan's (whichever is
        higher; within the limit), the fastest that lowers ``op``. So a switch never raises
        the larger of the pair's peak and that floor, and lowers its held bytes: with
        :meth:`_leaner`'s switches, which lower that larger one, no pair ever returns to a plan
        (tightening ends)."""
        pl, cur = self.stages[r], parts[r][j]
        bound = min(max(cur.choice.peak_bytes, self._floor(r, shape)), pl.limit)
        before = pl.limit + excess
        for c in self._held_plans(r, shape, cur.choice.layers):
            if c.peak_bytes > bound:
                continue
            part = self._part(r, shape, c)
            if part.held >= cur.held:
                continue
            saved = before - self._op_bytes(r, parts[r], order, op, swap=(j, part))
            if saved > 0:
                return part, saved, c.seconds - cur.choice.seconds
        return None

    def _floor(self, r: int, shape) -> float:
        """The peak of stage ``r``'s leanest uniform plan at ``shape`` (memoized for the step)."""
        key = ("floor", id(self.stages[r]), shape)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self.stages[r].leanest(*shape)[2]
        return got

    def _held_plans(self, r: int, shape, layers) -> list:
        """Plans of the micro-batch ``shape`` on stage ``r`` that hold fewer bytes than the plan
        ``layers`` between forward and backward, each within the stage's limit alone, fastest
        first (ties: the lower peak, then by name): for each candidate ``e`` (a plan entry)
        that saves less per layer than some layer of ``layers``, ``layers`` with its 1, 2, ...
        largest-saving layers moved to ``e`` (down to ``e``'s uniform plan if every layer saves
        more), laid out largest transient first and priced as the stage planner prices its
        plans (ordered peak, or the order-free bound). Points along the held bytes / seconds
        trade-off from the current plan to each leaner uniform one, at most ``E x L / P`` of
        them (E candidates); memoized for the step."""
        pl = self.stages[r]
        key = ("held", id(pl), shape, layers)
        got = self._memo.get(key)
        if got is not None:
            return got
        costs = pl.costs(*shape)
        index = {n: i for i, n in enumerate(costs.names)}
        evaluate = pl.evaluate_ordered if pl.order == "ordered" else pl.evaluate
        mine = sorted((index[e] for e in layers), key=lambda i: (-costs.m[i], i))  # largest saving first
        seen, out = set(), []
        for e, name in enumerate(costs.names):
            if costs.base + costs.m[e] + max(costs.x[e], costs.x0) > pl.limit:
                continue  # no plan with a layer of e fits the stage alone
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
        out.sort(key=lambda c: (c.seconds, c.peak_bytes, c.layers))
        self._memo[key] = out
        return out

    def _tighten(self, shapes, parts, order, windows):
        """Switch micro-batches to leaner plans until every stage fits; None, or the (stage, op)
        no switch of an in-flight micro-batch can lower. At the op furthest over, each
        micro-batch in flight offers its :meth:`_leaner` plan (a lower peak); the one saving
        the most bytes there per added second switches. When none lowers the op, the
        micro-batches held there (not the one running) offer their :meth:`_less_held` plans
        instead, chosen the same way."""
        stage_bytes = [[self._op_bytes(r, parts[r], order, op) for op in ops] for r, ops in enumerate(windows)]
        for _ in range(MAX_TIGHTENINGS):
            worst = self._worst(stage_bytes, windows)
            if worst is None:
                return None
            excess, r, op = worst
            best = self._best_switch(self._leaner, shapes, parts, order, r, op, excess, op[2])
            if best is None:
                held = [k for k in op[2] if k != op[1]]
                best = self._best_switch(self._less_held, shapes, parts, order, r, op, excess, held)
            if best is None:
                return r, op
            parts[r][best[0]] = best[1]
            stage_bytes[r] = [self._op_bytes(r, parts[r], order, o) for o in windows[r]]
        # each switch lowers a pair's (peak, held) (:meth:`_less_held`): cannot happen
        raise RuntimeError("pipeline tightening did not converge")

    @staticmethod
    def _best_switch(way, shapes, parts, order, r: int, op, excess: float, positions):
        """(micro-batch, part) of the positions' ``way`` plans (:meth:`_leaner` or
        :meth:`_less_held`) saving the most bytes at ``op`` per added second (one not slower
        first; ties: the lower index), or None when none lowers ``op``."""
        best = None
        for k in positions:
            j = order[k]
            got = way(r, j, shapes[j], parts, order, op, excess)
            if got is None:
                continue
            part, saved, added = got
            key = (added <= 0, saved / added if added > 0 else saved, -j)
            if best is None or key > best[0]:
                best = (key, j, part)
        return None if best is None else best[1:]

    def _relax(self, shapes, parts, order, windows) -> bool:
        """One pass over the tightened (stage, micro-batch) pairs, in stage and run order: the
        fastest plan under the pair's peak plus the room its ops have left, kept where every
        op of the stage still fits and it is faster (greedy tightening can overshoot).
        Whether a plan changed."""
        changed = False
        for r, ops in enumerate(windows):
            limit = self.stages[r].limit
            for k, j in enumerate(order):
                cur = parts[r][j]
                if cur.choice.layers == self.stages[r].choose(*shapes[j]).layers:
                    continue
                mine = [op for op in ops if k in op[2]]
                room = min(limit - self._op_bytes(r, parts[r], order, op) for op in mine)
                c = self._under(r, shapes[j], cur.choice.peak_bytes + room)
                if not c.fits or c.seconds >= cur.choice.seconds:
                    continue
                part = self._part(r, shapes[j], c)
                if all(self._op_bytes(r, parts[r], order, op, swap=(j, part)) <= limit for op in mine):
                    parts[r][j], changed = part, True
        return changed

    def _timed(self, parts, order) -> tuple:
        """(schedule, step seconds) of ``parts`` run in ``order``: the 1F1B simulation, then each
        stage's update after its last backward."""
        P = self.num_stages
        sched = simulate_1f1b([[parts[r][j].fwd for j in order] for r in range(P)],
                              [[parts[r][j].bwd for j in order] for r in range(P)])
        return sched, max(sched.ends[r] + self.stages[r].update_seconds() for r in range(P))

    def _plan_order(self, shapes, order, fastest) -> tuple:
        """(step plan, parts) of run ``order`` from each stage's ``fastest`` parts (its plans
        alone), tightened until the stages fit."""
        parts = [list(row) for row in fastest]
        alone = [(r, j) for r in range(self.num_stages) for j in range(len(shapes)) if not parts[r][j].choice.fits]
        failed = None if alone else self._tighten(shapes, parts, order, self._windows(order))
        return self._step_plan(shapes, order, parts, alone, failed), parts

    def _step_plan(self, shapes, order, parts, alone=(), failed=None) -> StepPlan:
        """The :class:`StepPlan` of ``parts`` run in ``order``; ``alone``: the (stage,
        micro-batch) pairs that fit no plan alone; ``failed``: the (stage, op) tightening could
        not bring under the limit."""
        P, windows = self.num_stages, self._windows(order)
        peaks = tuple(max(self._op_bytes(r, parts[r], order, op) for op in windows[r]) for r in range(P))
        sched, seconds = self._timed(parts, order)
        plans = tuple(tuple(e for r in range(P) for e in parts[r][j].choice.layers) for j in range(len(shapes)))
        message, offenders = "", ()
        if alone:
            r, j = alone[0]
            offenders = (j,)
            message = (f"stage {r} of {P}: micro-batch {j} (length {_length(shapes[j])}) alone: "
                       f"{parts[r][j].choice.reason}")
        elif failed is not None:
            offenders, message = self._no_fit(shapes, parts, order, *failed)
        return StepPlan(tuple(order), plans, tuple(tuple(p.choice for p in parts[r]) for r in range(P)),
                        peaks, tuple(pl.limit for pl in self.stages), sched.busy, sched.makespan, seconds,
                        not (alone or failed), message, offenders, sched)

    def _no_fit(self, shapes, parts, order, r: int, op) -> tuple:
        """(offenders, message) for stage ``r`` over its limit at ``op``."""
        js = [order[k] for k in op[2]]
        need = self._op_bytes(r, parts[r], order, op)
        pl = self.stages[r]
        plans = "; ".join(f"{j}: {describe(parts[r][j].choice.layers)}" for j in js)
        return tuple(js), (
            f"stage {r} of {self.num_stages}: micro-batches {', '.join(map(str, js))} (lengths "
            f"{', '.join(_length(shapes[j]) for j in js)}) in flight need {fmt_bytes(need)} > limit "
            f"{fmt_bytes(pl.limit)} (budget {fmt_bytes(pl.budget)} - margin {fmt_bytes(pl.margin)}); "
            f"the leanest plans tried ({plans}) leave no leaner one that lowers it: shorter micro-batches, "
            f"more memory or more stages")

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
        self._memo = {}  # this step's answers under limits (_under), parts (_part), leanest peaks, held plans
        reorder = self.reorder if reorder is None else reorder
        sizes = [seq_tokens(s) * b for s, b in shapes]
        orders = candidate_orders(sizes, self.num_stages) if reorder else [tuple(range(len(shapes)))]
        fastest = [[self._part(r, sh, pl.choose(*sh)) for sh in shapes] for r, pl in enumerate(self.stages)]
        first = best = None
        for order in orders:
            # tightening only slows plans down: an order whose fastest plans are not faster than
            # the best fitting step so far cannot win (exact for the optimal planner)
            if best is not None and self._timed(fastest, order)[1] >= best[0].seconds:
                continue
            sp, parts = self._plan_order(shapes, order, fastest)
            first = first or sp
            if sp.fits and (best is None or sp.seconds < best[0].seconds):
                best = (sp, parts)
        if best is None and len(orders) > 1:  # every order was planned (none pruned without a best)
            return first._replace(message=first.message + f" (and in {len(orders) - 1} other run orders)")
        if best is None:
            return first
        sp, parts = best
        if self._relax(shapes, parts, sp.order, self._windows(sp.order)):
            sp = self._step_plan(shapes, sp.order, parts)
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
            extra = " + embedding" * (r == 0) + " + output layer, loss" * (r == P - 1)
            over = "fits" if sp.stage_peaks[r] <= sp.stage_limits[r] else "OVER"
            out.append(f"== stage {r}: layers {r * per}-{(r + 1) * per - 1}{extra}: peak {fmt_bytes(sp.stage_peaks[r])}"
                       f" / limit {fmt_bytes(sp.stage_limits[r])} ({over}), busy {sp.stage_seconds[r]:.4f} s")
            w = max(len(describe(c.layers)) for c in sp.stage_plans[r]) + 2
            out.append(f"   {'mb':>3} {'length':>12}  {'plan':<{w}} {'seconds':>10} {'alone peak':>14}")
            for j in sp.order:
                c = sp.stage_plans[r][j]
                out.append(f"   {j:>3} {_length(shapes[j]):>12}  {describe(c.layers):<{w}} {c.seconds:10.4f} "
                           f"{fmt_bytes(c.peak_bytes):>14}")
        bubble = 1.0 - sum(sp.stage_seconds) / (P * sp.makespan) if sp.makespan > 0 else 0.0
        out.append(f"step: {sp.seconds:.4f} s = pipeline {sp.makespan:.4f} s + update {sp.seconds - sp.makespan:.4f} s;"
                   f" bubble fraction {100 * bubble:.1f}% (1 - busy / ({P} x pipeline))")
        out.append("fits" if sp.fits else f"does not fit: {sp.message}")
        return "\n".join(out)


# ------------------------------------------------------------------------------------------
# the trainer's hook


def _mb_shape(mb) -> tuple:
    """``(s, b)`` of a micro-batch: its pack (``plan_length``) or its tokens' length."""
    b, s = int(mb.tokens.shape[0]), int(mb.tokens.shape[1])
    pack = getattr(mb, "plan_length", None)
    return (pack, b) if isinstance(pack, PackShape) else (s, b)


def make_step_plan_fn(pipeline_planner: PipelinePlanner, on_no_fit: str = "error", multiple: int = 1):
    """The trainer's ``fn(mbs, step) -> (order, plans, step_plan)`` for one step's micro-batches
    (each with ``.tokens`` [b, s], optionally ``.plan_length`` a ``PackShape``, ``.lengths``).

    When nothing fits, ``on_no_fit``: ``error`` raises :class:`NoFitError` with the message;
    ``truncate`` cuts the longest micro-batch in flight at the failing point to the longest
    length (a multiple of ``multiple`` and p) at which the step fits, or to that multiple when
    none does, and plans again; ``skip`` cuts it to that multiple with an all-zero loss mask;
    each with a warning (rank 0), repeated until the step fits; a pack is never cut
    (``NoFitError`` when only packs are left to cut). The last StepPlan is ``fn.last``.
    """
    from . import ON_NO_FIT
    if on_no_fit not in ON_NO_FIT:
        raise ValueError(f"on_no_fit must be one of {ON_NO_FIT}, got {on_no_fit!r}")
    mult = max(1, int(multiple))
    mult = mult * pipeline_planner.multiple // math.gcd(mult, pipeline_planner.multiple)

    def fn(mbs, step):
        shapes = [_mb_shape(mb) for mb in mbs]
        sp = pipeline_planner.plan_step(shapes)
        if not sp.fits and on_no_fit != "error":
            sp = _cut_until_fits(pipeline_planner, mbs, shapes, sp, step, on_no_fit, mult)
        if not sp.fits:
            raise NoFitError(f"step {step}: {sp.message} (--paradyse-on-no-fit {on_no_fit})")
        fn.last = sp
        return sp.order, sp.plans, sp

    fn.last = None
    fn.planner = pipeline_planner
    return fn


def _cut_until_fits(planner: PipelinePlanner, mbs, shapes, sp: StepPlan, step, policy: str, mult: int) -> StepPlan:
    """``truncate`` / ``skip`` (:func:`make_step_plan_fn`): cut offenders until the step fits;
    the failing StepPlan back when only packs (or micro-batches of ``mult`` tokens) are left."""
    from megatron.core.utils import log_single_rank

    from . import _cut
    while not sp.fits:
        cut = [j for j in sp.offenders if not isinstance(shapes[j][0], PackShape) and shapes[j][0] > mult]
        if not cut:
            return sp._replace(message=sp.message + "; nothing left to cut (a pack is never truncated or skipped)")
        j = max(cut, key=lambda k: (shapes[k][0], -k))
        s, b = shapes[j]
        new = mult
        if policy == "truncate":
            def fits(k, j=j, b=b):
                return planner.plan_step(shapes[:j] + [(k * mult, b)] + shapes[j + 1:]).fits
            new = max(mult, last_true(fits, (s - 1) // mult) * mult)
        what = (f"step {step} micro-batch {j} (documents of lengths "
                f"{', '.join(str(int(x)) for x in mbs[j].lengths)})")
        _cut(mbs[j], new, zero_loss=(policy == "skip"))
        log_single_rank(log, logging.WARNING, f"WARNING: {what}: {sp.message}; "
                        + (f"truncated to {new} tokens" if policy == "truncate" else "skipped (no loss, no gradient)"))
        shapes[j] = (new, b)
        sp = planner.plan_step(shapes)
    return sp
