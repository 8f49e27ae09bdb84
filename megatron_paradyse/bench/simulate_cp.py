"""A SIMULATION (no GPU ran): ParaDySe x context parallelism (CP) across nodes, 64-512 H100s.

``python -m megatron_paradyse.bench.simulate_cp`` prints its assumptions and, per model (a
7B-class and a 70B-class shape) and GPU count N = 8 x C x DP (one TP group of 8 per node), a
table of systems training the same seeded long-tailed documents (log-normal, to 2M tokens):

* ``ParaDySe x CP``: CP of size C fixed for the run (the data path splits by C), the
  repository's optimal planner (strategy and recompute per layer, ``recompute="auto"``)
  choosing each micro-batch's in-node plan at that C; every power of two C <= N/8 is run and
  the best reported;
* ``megatron TP + CP``: stock ``tp_sp`` on every layer, and ``tp_sp+rc`` (full recompute),
  each at its best static C;
* ``Dynamic-CP-style`` (megatron's DCP, as this simulation models it): per micro-batch the CP
  size is the smallest power of two at which it fits (megatron's memory-derived size), then
  the step's longest job's C doubled while that lowers the step's makespan (megatron balances
  its groups by workload; ``--dcp-policy fit``: no widening; ``efficient``: the C of the
  fewest node-seconds, then widened), in-node ``tp_sp`` (or ``tp_sp+rc``); placed by predicted
  time, no synchronised rounds (idealised);
* ``ParaDySe x Dynamic CP``: the plugin's Dynamic CP planner as built
  (``planner.dynamic_cp.plan_dynamic_cp``) on the step's documents, its planners the optimal
  planner at each C on the same cost models (:class:`DocumentPacks`: this simulation's pack
  rule); its step is its schedule's synchronised rounds.

Every system trains THD packs (:func:`pack`); a micro-batch costs ``CPCostModel.step`` (``costmodel/cp.py``) on
its plan at its C, over the in-node roofline of the earlier simulations (``simulate.H100Roofline``
for the 7B, ``simulate_pipeline.PipelineRoofline`` for the 70B), and fits when it peaks at most
the budget. A step is ``docs_per_node x N/8`` documents spread over the node pool: each
pack a job of C nodes (an aligned block: a DP replica, or a DCP group), longest first onto
the block that frees earliest (ParaDySe x Dynamic CP: its rounds); step time = the last job's
end + the update. A step with a
document that fits no configuration of the system is not trained: its tokens count for no
one and its seconds are not added. The best C of a static system: the most tokens trained,
then tokens/s. Every number is a model output, not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from ..costmodel.analytic import load_config, param_counts
from ..costmodel.base import CostModel, LayerCost
from ..costmodel.cp import RING_FORMS, CPCostModel, Links
from ..errors import ArgumentParser, UserError, command
from ..parallel.packing import PackShape
from ..planner import build_planner
from ..planner.core import NoFitError, last_true
from ..planner.dynamic_cp import plan_dynamic_cp
from .simulate import GB, run_and_report, H100Roofline, Hardware, Model7B, lengths_distribution
from .simulate_pipeline import ADAM_BYTES_PER_PARAM, Model70B, PipelineRoofline

MODELS = {"7b": Model7B, "70b": Model70B}
STOCK = {"tp_sp": "tp_sp", "tp_sp+rc": "tp_sp:rc"}          # system -> its entry on every layer
STATIC = ("paradyse", "tp_sp", "tp_sp+rc")
LONGEST_UNIT = 1024                                           # longest trainable: a multiple of 1K
DCP_POLICIES = ("widen", "fit", "efficient")                 # dynamic_jobs
DCP_TEXT = {"fit": "per micro-batch the smallest power-of-two C at which it fits",
            "widen": "per micro-batch the smallest power-of-two C at which it fits, then the step's longest job's "
                     "C doubled while that lowers the step's makespan",
            "efficient": "per micro-batch the power-of-two C of the fewest node-seconds (C x seconds), then the "
                         "step's longest job's C doubled while that lowers the step's makespan"}
DYNAMIC = {"dcp_tp_sp": "tp_sp", "dcp_tp_sp+rc": "tp_sp+rc", "paradyse_dcp": "paradyse"}
NAMES = {"paradyse": "ParaDySe x CP", "tp_sp": "megatron TP+CP (`tp_sp`)",
         "tp_sp+rc": "megatron TP+CP, full recompute (`tp_sp+rc`)", "dcp_tp_sp": "Dynamic-CP-style, `tp_sp`",
         "dcp_tp_sp+rc": "Dynamic-CP-style, `tp_sp+rc`",
         "paradyse_dcp": "ParaDySe x Dynamic CP (the planner: plan_dynamic_cp)"}


@dataclasses.dataclass
class Setup:
    """The sizes, the data and the links of one run."""

    gpus: tuple = (64, 512)
    models: tuple = ("7b", "70b")
    docs: int = 2048               # documents, the same at every size
    docs_per_node: int = 4         # global batch: docs_per_node x N/8 documents per step
    seed: int = 0
    min_len: int = 1024
    max_len: int = 2 << 20
    overlap: float = 0.0           # fraction of the CP ring's time hidden behind compute
    inter: str = "ib_ndr"          # interconnects.json: the inter-node link, one NIC per GPU
    distributed_optimizer: bool = True
    dcp_policy: str = "widen"      # Dynamic-CP-style: DCP_POLICIES
    cp_ring: str = "two_level"     # the ring family's ring over C x p ranks: costmodel.cp.RING_FORMS
    per_node: int = 8              # GPUs per node = the TP (switching) group
    pack_tokens: int = 65536       # THD packs: at most this x C tokens per micro-batch (0: one document each)


# ------------------------------------------------------------------------------------------
# the costs


def links_for(hw: Hardware, inter: str) -> Links:
    """In-node: the roofline's own NVLink rate (bandwidth x efficiency, no fixed cost, as its
    ``datasheet_rates``); inter-node: ``interconnects.json``'s ``inter``."""
    net = load_config("interconnects.json")[inter]
    return Links(hw.nvlink_bytes_per_s * hw.comm_efficiency, 0.0, float(net["bandwidth"]), float(net["alpha"]),
                 "nvlink (roofline)", inter)


def state_bytes(replicas: int, distributed: bool) -> float:
    """Bytes of state per parameter: bf16 param + fp32 main grad + Adam's fp32 master, m and v;
    megatron's distributed optimizer shards the last 12 over the DP x CP ``replicas``."""
    return 6 + 12 / replicas if distributed else 18.0


def base_model(key: str, hw: Hardware, replicas: int, distributed: bool):
    """``(in-node cost model, budget)``: the 7B on ``H100Roofline`` (its static bytes hold the
    reserve, so the budget is the whole memory), the 70B on ``PipelineRoofline`` (budget =
    memory - reserve); both with :func:`state_bytes`. The same limit for every system."""
    m = dataclasses.replace(MODELS[key](), bytes_per_param_state=state_bytes(replicas, distributed))
    if key == "7b":
        return H100Roofline(hw, m), hw.memory_bytes
    return PipelineRoofline(hw, m), hw.memory_bytes - hw.reserved_bytes


def params_per_rank(cm) -> float:
    """Parameters on one rank (``analytic.param_counts`` of the shape)."""
    pc = param_counts(cm.shape)
    return pc["layers"] + pc["embedding"] + pc["output"] + pc["final_norm"]


def update_seconds(cm, hw: Hardware, links: Links, replicas: int, distributed: bool) -> float:
    """A step's update, the same for every system at one size: the gradients' reduce-scatter
    and the parameters' all-gather in bf16 over the ``replicas`` (DP x CP) nodes on the
    inter-node link (ring collectives), then Adam over the rank's shard at HBM bandwidth."""
    P, G = params_per_rank(cm), replicas
    sync = 0.0 if G == 1 else 2 * ((G - 1) * links.inter_alpha + (G - 1) / G * 2 * P / links.inter_bandwidth)
    return sync + P / (G if distributed else 1) * ADAM_BYTES_PER_PARAM / hw.hbm_bytes_per_s


class Pricer:
    """One system's micro-batch cost at one C: ``(seconds, plan)`` at a padded global length,
    or None where it does not fit; memoized. ``system``: ``paradyse`` (the planner's plan,
    judged by ``CostModel.step`` against the limit) or a stock system of :data:`STOCK`."""

    def __init__(self, cm: CPCostModel, system: str, budget: float, cap: int):
        self.cm, self.system, self.limit = cm, system, float(budget)
        self.unit = 2 * cm.cp * cm.shape.p if cm.cp > 1 else cm.shape.p
        self.memo: dict = {}
        self.planner = None
        self.longest_plan = cap
        if system == "paradyse":
            self.planner = build_planner("optimal", cm, budget, margin_bytes=0.0)  # recompute="auto"
            self.longest_plan = self.planner.longest_fit(1, multiple=self.unit, upper=cap)
        step = max(LONGEST_UNIT, self.unit)  # a multiple of 2 C p for C <= 64
        self.longest = step * last_true(lambda k: self(k * step) is not None, cap // step)

    def pad(self, s: int) -> int:
        """``s`` padded to the layout's multiple (2 C p under CP, as megatron pads)."""
        return -(-int(s) // self.unit) * self.unit

    def __call__(self, s: int):
        """``(seconds, plan)`` at the padded global length ``s``, or None (memoized)."""
        got = self.memo.get(s, False)
        if got is False:
            got = self.memo[s] = self._price(s)
        return got

    def _price(self, s: int):
        """The plan at ``s`` (the stock one, or the planner's unless ``s`` is past the longest it
        fits), judged by ``CostModel.step`` against the limit."""
        if self.planner is None:
            layers = (STOCK[self.system],) * self.cm.num_layers
        elif s > self.longest_plan:
            return None
        else:
            choice = self.planner.choose(s, 1)
            if not choice.fits:
                return None
            layers = tuple(choice.layers)
        st = self.cm.step(layers, s, 1)
        return (st.seconds, layers) if st.peak_bytes <= self.limit else None


# ------------------------------------------------------------------------------------------
# the steps


def schedule(jobs, nodes: int) -> float:
    """Makespan of ``jobs`` = [(width, seconds)] on ``nodes`` nodes: longest first, each onto
    the aligned block of ``width`` nodes (megatron's groups: DP replicas, or DCP's power-of-two
    groups) that frees earliest."""
    free = [0.0] * nodes
    for w, t in sorted(jobs, key=lambda j: (-j[1], -j[0])):
        at = min(range(0, nodes, w), key=lambda i: (max(free[i:i + w]), i))
        end = max(free[at:at + w]) + t
        free[at:at + w] = [end] * w
    return max(free, default=0.0)


def run_system(jobs_of, steps, nodes: int, update: float) -> dict:
    """One system over every step. ``jobs_of(docs)`` -> the step's jobs ``[(C, seconds, plan)]``
    (placed by :func:`schedule`), or ``(jobs, makespan)`` (a schedule of its own: the planner's
    rounds), or None when a document fits nowhere (the step is not trained)."""
    toks = secs = work = span = 0.0
    trained, used, widths, per_step = [], {}, {}, []
    for k, docs in enumerate(steps):
        jobs = jobs_of(docs)
        if jobs is None:
            per_step.append(None)
            continue
        jobs, make = jobs if isinstance(jobs, tuple) else (jobs, schedule([(c, t) for c, t, _ in jobs], nodes))
        per_step.append(make + update)
        trained.append(k)
        toks, secs, span = toks + sum(docs), secs + make + update, span + make
        work += sum(c * t for c, t, _ in jobs)
        for c, _, plan in jobs:
            widths[c] = widths.get(c, 0) + 1
            for e in plan:
                used[e] = used.get(e, 0) + 1
    total = sum(used.values())
    return dict(steps_trained=len(trained), steps=len(steps), tokens_trained=int(toks), seconds=secs,
                tokens_per_s=toks / secs if secs else 0.0, idle=1 - work / (nodes * span) if span else 0.0,
                cp_used=dict(sorted(widths.items())), per_step=per_step,
                entries={e: round(n / total, 4) for e, n in sorted(used.items(), key=lambda kv: -kv[1])}
                if total else {})


def priced(pricer: Pricer, s: int):
    """``(C, seconds, plan)`` of document ``s`` at the pricer's C, or None."""
    got = pricer(pricer.pad(s))
    return None if got is None else (pricer.cm.cp, *got)


def pack_priced(pricer: Pricer, docs: list):
    """``(C, seconds, plan)`` of a THD pack of the documents ``docs`` at the pricer's C, or None.
    The pack runs one plan, one that fits its total padded length (activations grow with the
    tokens; attention stays inside each document): the system's own plan, or for the planner
    the fastest for the pack of its plans at the total length and at the longest document and
    the stock plans (``tp_sp``, ``tp_sp:rc`` everywhere), among those that fit; its seconds are
    its documents' under that plan
    (the roofline adds no cost per micro-batch, attention is each document's own s^2)."""
    if len(docs) == 1:
        return priced(pricer, docs[0])
    T = sum(pricer.pad(s) for s in docs)
    whole = pricer(T)
    if whole is None:
        return None
    cands = {whole[1]}
    if pricer.planner is not None:
        longest = pricer(pricer.pad(max(docs)))
        cands |= {longest[1]} if longest else set()
        cands |= {(e,) * pricer.cm.num_layers for e in STOCK.values()}
    best = None
    for plan in cands:
        if plan is not whole[1] and pricer.cm.step(plan, T, 1).peak_bytes > pricer.limit:
            continue
        t = sum(pricer.cm.step(plan, pricer.pad(s), 1).seconds for s in docs)
        best = (t, plan) if best is None or t < best[0] else best
    return pricer.cm.cp, best[0], best[1]


def pack(docs: list, cap: int) -> list:
    """The packing rule, as megatron's THD packs need: the documents longest first, each into
    the first pack it fits under ``cap`` tokens (first-fit decreasing); a document longer than
    the cap is a pack of its own. ``cap`` 0: one document per pack."""
    packs: list = []
    for s in sorted(docs, reverse=True):
        home = next((p for p in packs if cap and sum(p) + s <= cap), None) if cap else None
        if home is None:
            packs.append([s])
        else:
            home.append(s)
    return packs


def pack_cap(pricer: Pricer, pack_tokens: int) -> int:
    """A pack's token cap at the pricer's C: ``pack_tokens`` x C, at most the longest the system
    trains there (megatron's cap is a memory cap too: ``max_seqlen_per_dp_cp_rank`` x C)."""
    return min(pack_tokens * pricer.cm.cp, pricer.longest)


def packed_jobs(pricer: Pricer, docs: list, pack_tokens: int) -> list:
    """The jobs of ``docs`` at the pricer's C: packed (:func:`pack`, :func:`pack_cap`), a pack
    that does not fit split back into its documents, and so is a planner's pack whose one plan
    (memory-lean for its total) would take longer than its documents alone; a None where a
    document fits nowhere."""
    jobs, groups = [], []
    for p in pack(docs, pack_cap(pricer, pack_tokens) if pack_tokens else 0):
        got = pack_priced(pricer, p)
        alone = [(pack_priced(pricer, [s]), [s]) for s in p] if len(p) > 1 and (
            got is None or pricer.planner is not None) else []
        if got and alone and (any(j is None for j, _ in alone) or sum(j[1] for j, _ in alone) >= got[1]):
            alone = []      # the planner keeps a pack unless its documents alone take less time
        parts = alone or [(got, p)]
        jobs += [j for j, _ in parts]
        groups += [g for _, g in parts]
    return jobs, groups


def static_jobs(pricer: Pricer, pack_tokens: int = 0):
    """A static system's ``jobs_of``: the step's documents packed (:func:`packed_jobs`), every
    pack at the pricer's C."""
    def jobs_of(docs):
        jobs = packed_jobs(pricer, docs, pack_tokens)[0]
        return None if any(j is None for j in jobs) else jobs
    return jobs_of


def dynamic_jobs(pricers: dict, nodes: int, policy: str = "widen", pack_tokens: int = 0):
    """Dynamic-CP-style ``jobs_of`` (``pricers``: C -> Pricer; :data:`DCP_POLICIES`): each
    document at the smallest C at which it fits (``fit``, ``widen``) or at the C of the
    fewest node-seconds, C x seconds (``efficient``); the documents of one C packed
    (:func:`packed_jobs`); then (``widen``, ``efficient``) the step's longest job's C doubled while
    that lowers the step's makespan (:func:`schedule`)."""
    cs = sorted(pricers)

    def first(s):
        fits = [j for j in (priced(pricers[c], s) for c in cs) if j is not None]
        if not fits:
            return None
        return fits[0] if policy != "efficient" else min(fits, key=lambda j: (j[0] * j[1], j[0]))

    def jobs_of(docs):
        own = [first(s) for s in docs]
        if any(j is None for j in own):
            return None
        jobs, groups = [], []
        for c in cs:
            got = packed_jobs(pricers[c], [s for s, j in zip(docs, own) if j[0] == c], pack_tokens)
            jobs, groups = jobs + got[0], groups + got[1]
        return widen(jobs, groups, pricers, nodes) if policy != "fit" else jobs
    return jobs_of


def widen(jobs: list, groups: list, pricers: dict, nodes: int) -> list:
    """The step's longest job's C doubled while that lowers the makespan (:func:`schedule`)."""
    while True:
        k = max(range(len(jobs)), key=lambda i: jobs[i][1])
        c = 2 * jobs[k][0]
        wider = pack_priced(pricers[c], groups[k]) if c in pricers else None
        trial = jobs[:k] + [wider] + jobs[k + 1:] if wider else None
        if trial is None or schedule([j[:2] for j in trial], nodes) >= schedule([j[:2] for j in jobs], nodes):
            return jobs
        jobs = trial


class DocumentPacks(CPCostModel):
    """``CPCostModel`` whose packs are priced by this simulation's pack rule (:func:`pack_priced`),
    so that the plugin's Dynamic CP planner plans under the same costs the other systems are
    judged by: a ``PackShape`` of documents takes the sum of its documents' seconds, each at its
    own padded length (the roofline has no cost per micro-batch, each document's attention is
    its own s^2, each its own CP ring), and peaks as one sequence of their total padded length.
    A length (int) is priced exactly as ``CPCostModel``."""

    def pad(self, d: int) -> int:
        unit = 2 * self.cp * self.shape.p if self.cp > 1 else self.shape.p
        return -(-int(d) // unit) * unit

    def _total(self, s, b: int) -> tuple:
        return (sum(self.pad(d) for d in s.lengths), 1) if isinstance(s, PackShape) else (s, b)

    def layer(self, strategy: str, s, b: int) -> LayerCost:
        """A length: ``CPCostModel.layer`` (memoized at every C, C = 1 too); a pack: the class docstring."""
        pack = isinstance(s, PackShape)
        key = ("documents", strategy, s) if pack else (strategy, s, b)
        got = self._memo.get(key)
        if got is None and not pack:
            got = self._memo[key] = super().layer(strategy, s, b)
        elif got is None:
            whole = self.layer(strategy, *self._total(s, b))
            secs = sum(self.layer(strategy, self.pad(d), 1).seconds for d in s.lengths)
            got = self._memo[key] = LayerCost(secs, whole.saved_bytes, whole.transient_bytes)
        return got

    def nonlayer(self, s, b: int) -> LayerCost:
        if not isinstance(s, PackShape):
            return super().nonlayer(s, b)
        whole = super().nonlayer(*self._total(s, b))
        secs = sum(super(DocumentPacks, self).nonlayer(self.pad(d), 1).seconds for d in s.lengths)
        return LayerCost(secs, whole.saved_bytes, whole.transient_bytes)

    def resident_bytes(self, s, b: int) -> float:
        return super().resident_bytes(*self._total(s, b))

    def pool(self, strategy: str, s, b: int) -> dict:
        return super().pool(strategy, *self._total(s, b))

    def step(self, plan, s, b: int):
        """A pack: ``CostModel.step`` on the methods above (at every C); a length: ``CPCostModel.step``."""
        return CostModel.step(self, plan, s, b) if isinstance(s, PackShape) else super().step(plan, s, b)


def dcp_planners(base, cs, links: Links, budget: float, setup: "Setup") -> dict:
    """``{C: the optimal planner}`` (``recompute="auto"``, no margin: the budget is the rule's
    limit) on :class:`DocumentPacks` at each C: what ``planner.dynamic_cp.cp_planners`` builds,
    with this simulation's pack rule."""
    return {c: build_planner("optimal", DocumentPacks(base, c, links, overlap=setup.overlap, ring=setup.cp_ring),
                             budget, margin_bytes=0.0) for c in cs}


def planner_dcp_step(planners: dict, nodes: int, pack_tokens: int, p: int):
    """ParaDySe x Dynamic CP as the plugin builds it: ``planner.dynamic_cp.plan_dynamic_cp`` on
    the step's documents over the pool of ``nodes`` nodes (``planners``: :func:`dcp_planners`;
    no ``--max-seqlen-per-dp-cp-rank`` cap: the memory rule sizes C; packs of at most
    ``pack_tokens`` x C tokens, 0: one document each before its local search). ``jobs_of``
    returns ``(jobs, makespan)``: its micro-batches (fillers aside) and its rounds' seconds
    (synchronised rounds, each as long as its slowest block), or None where a document fits no
    C (``NoFitError``)."""
    def jobs_of(docs):
        try:
            sched = plan_dynamic_cp(docs, nodes, planners, p, pack_tokens=pack_tokens or 1)
        except NoFitError:
            return None
        jobs = [(a.size, a.seconds, a.plan) for a in sched.micro_batches()]
        return jobs, sched.seconds - sched.update_seconds
    return jobs_of


# ------------------------------------------------------------------------------------------
# one model at one size


def dcp_jobs(name: str, pricers: dict, nodes: int, setup: Setup, planners: dict):
    """A dynamic system's ``jobs_of``: ParaDySe x Dynamic CP's :func:`planner_dcp_step` (the
    plugin's planner), or Dynamic-CP-style's policy (``setup.dcp_policy``)."""
    if name == "paradyse_dcp":
        return planner_dcp_step(planners, nodes, setup.pack_tokens, setup.per_node)
    return dynamic_jobs(pricers, nodes, setup.dcp_policy, setup.pack_tokens)


def best_c(rows: dict) -> int:
    """The best static C: the most tokens trained, then the most tokens/s."""
    return max(rows, key=lambda c: (rows[c]["tokens_trained"], rows[c]["tokens_per_s"]))


def time_saved(mine: list, theirs: list) -> dict:
    """On the steps both train: how many, and the fraction of ``theirs``' time ``mine`` saves."""
    both = [k for k in range(len(mine)) if mine[k] is not None and theirs[k] is not None]
    t = sum(theirs[k] for k in both)
    return dict(steps_both=len(both), saved=1 - sum(mine[k] for k in both) / t if t else None)


def simulate_size(key: str, gpus: int, setup: Setup, hw: Hardware, lens: list) -> dict:
    """Every system for model ``key`` on ``gpus`` GPUs over the documents ``lens``."""
    nodes = gpus // setup.per_node
    cs = [1 << i for i in range(nodes.bit_length())]
    base, budget = base_model(key, hw, nodes, setup.distributed_optimizer)
    links = links_for(hw, setup.inter)
    update = update_seconds(base, hw, links, nodes, setup.distributed_optimizer)
    batch = setup.docs_per_node * nodes
    steps = [lens[i:i + batch] for i in range(0, len(lens) - batch + 1, batch)]
    pricers = {name: {c: Pricer(CPCostModel(base, c, links, overlap=setup.overlap, ring=setup.cp_ring), name,
                                budget, c * 4 * setup.max_len) for c in cs} for name in STATIC}
    static = {name: {c: dict(run_system(static_jobs(pricers[name][c], setup.pack_tokens), steps, nodes, update),
                            longest_trainable=pricers[name][c].longest) for c in cs} for name in STATIC}
    planners = dcp_planners(base, cs, links, budget, setup)
    dyn = {name: dict(run_system(dcp_jobs(name, pricers[of], nodes, setup, planners), steps, nodes, update),
                      longest_trainable=pricers[of][cs[-1]].longest) for name, of in DYNAMIC.items()}
    state = params_per_rank(base) * state_bytes(nodes, setup.distributed_optimizer)
    return dict(gpus=gpus, nodes=nodes, cp_sizes=cs, batch_documents=batch, steps=len(steps), update_seconds=update,
                state_bytes=state, budget_bytes=budget, static=static, dynamic=dyn, **compare(static, dyn))


def compare(static: dict, dyn: dict) -> dict:
    """Each static system's best C, megatron TP + CP's best (``tp_sp`` or ``tp_sp+rc``), and
    ParaDySe x CP's time saved at its best C on the steps it and each other system train."""
    best = {name: best_c(rows) for name, rows in static.items()}
    mega = max(STOCK, key=lambda n: (static[n][best[n]]["tokens_trained"], static[n][best[n]]["tokens_per_s"]))
    mine = static["paradyse"][best["paradyse"]]["per_step"]
    saved = {n: time_saved(mine, static[n][best[n]]["per_step"]) for n in STOCK}
    saved.update({n: time_saved(mine, dyn[n]["per_step"]) for n in DYNAMIC})
    ours = dyn["paradyse_dcp"]["per_step"]
    dcp = {n: dict(time_saved(ours, dyn[n]["per_step"]),
                   trains_theirs=all(a is not None for a, b in zip(ours, dyn[n]["per_step"]) if b is not None))
           for n in DYNAMIC if n != "paradyse_dcp"}
    return dict(best_c=best, megatron_best=dict(system=mega, cp=best[mega]), paradyse_time_saved=saved,
                paradyse_dcp_vs_dcp=dcp)


def one_node_longest(key: str, setup: Setup, hw: Hardware) -> int:
    """ParaDySe's longest trainable document on one node (8 GPUs, C = 1, DP = 1: 18 bytes of
    state per parameter, nothing to shard over)."""
    base, budget = base_model(key, hw, 1, setup.distributed_optimizer)
    links = links_for(hw, setup.inter)
    return Pricer(CPCostModel(base, 1, links), "paradyse", budget, 4 * setup.max_len).longest


def aims(sizes: list, one_node: int) -> dict:
    """The issue's aims at each size: the longest trainable against 4x one node's (at the
    largest C, and at ParaDySe's best C), and ParaDySe x CP's tokens/s against megatron TP +
    CP's best static C."""
    out = {}
    for r in sizes:
        pd = r["static"]["paradyse"]
        top, at_best = pd[r["cp_sizes"][-1]]["longest_trainable"], pd[r["best_c"]["paradyse"]]["longest_trainable"]
        mb = r["megatron_best"]
        theirs = r["static"][mb["system"]][mb["cp"]]
        mine = pd[r["best_c"]["paradyse"]]
        out[r["gpus"]] = dict(
            longest=top, longest_at_best_c=at_best, one_node=one_node,
            longest_ratio=top / one_node if one_node else None, longest_met=bool(one_node) and top >= 4 * one_node,
            tokens_per_s=mine["tokens_per_s"], megatron_tokens_per_s=theirs["tokens_per_s"],
            megatron=f"{mb['system']} at C = {mb['cp']}",
            tokens_per_s_ratio=mine["tokens_per_s"] / theirs["tokens_per_s"] if theirs["tokens_per_s"] else None,
            tokens_per_s_met=mine["tokens_per_s"] > theirs["tokens_per_s"],
            tokens_trained=mine["tokens_trained"], megatron_tokens_trained=theirs["tokens_trained"],
            dcp={n: dict(v, speedup=1 / (1 - v["saved"]) if v["saved"] is not None and v["saved"] < 1 else None)
                 for n, v in r["paradyse_dcp_vs_dcp"].items()})
    return out


def simulate_cp(setup: Setup | None = None, hw: Hardware | None = None) -> dict:
    """The simulation (module docstring) for every model and size of ``setup``."""
    setup, hw = check(setup or Setup()), hw or Hardware()
    lens = [int(x) for x in lengths_distribution(setup.docs, setup.seed, setup.max_len, setup.min_len)]
    models = {}
    for key in setup.models:
        one = one_node_longest(key, setup, hw)
        sizes = [simulate_size(key, g, setup, hw, lens) for g in setup.gpus]
        models[key] = dict(model=dataclasses.asdict(MODELS[key]()), one_node_longest=one, sizes=sizes,
                           aims=aims(sizes, one))
    return dict(label="SIMULATION (analytic roofline x context parallelism, no GPU ran)",
                hardware=dataclasses.asdict(hw), setup=dataclasses.asdict(setup),
                links=dataclasses.asdict(links_for(hw, setup.inter)),
                distribution=dict(n=len(lens), median=float(np.median(lens)), p90=float(np.percentile(lens, 90)),
                                  p99=float(np.percentile(lens, 99)), max=max(lens),
                                  over_1m=sum(s > 1 << 20 for s in lens), tokens=sum(lens)),
                models=models)


# ------------------------------------------------------------------------------------------
# the report


def _k(n) -> str:
    """A length or count as the tables show it: ``1,048,576``, or ``-`` for none."""
    return f"{n:,}" if n else "-"


def _row(name: str, c, s: dict, saved: dict | None) -> str:
    """One Markdown row of the main table."""
    sv = f"{100 * saved['saved']:.1f}% ({saved['steps_both']})" if saved and saved["steps_both"] else "-"
    return (f"| {NAMES[name]} | {c} | {s['steps_trained']} / {s['steps']} | {_k(s['tokens_trained'])} | "
            f"{s['tokens_per_s']:,.0f} | {100 * s['idle']:.1f}% | {_k(s['longest_trainable'])} | {sv} |")


def table(r: dict) -> str:
    """The systems at one size as a Markdown table."""
    out = [f"**{r['gpus']} GPUs** ({r['nodes']} nodes; {r['batch_documents']} documents per step, "
           f"{r['steps']} steps; weights and optimizer state {r['state_bytes'] / GB:.1f} GB per GPU; "
           f"update {r['update_seconds']:.2f} s)",
           "", "| system | C | steps trained | tokens trained | tokens/s, trained steps | idle | "
               "longest trainable | ParaDySe x CP's time saved (steps both train) |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name in STATIC:
        c = r["best_c"][name]
        s = r["static"][name][c]
        out.append(_row(name, c if s["steps_trained"] else "-", s,
                        None if name == "paradyse" else r["paradyse_time_saved"][name]))
    for name, s in r["dynamic"].items():
        used = ", ".join(f"{c}: {n}" for c, n in s["cp_used"].items()) or "-"
        out.append(_row(name, f"per micro-batch ({used})", s, r["paradyse_time_saved"][name]))
    return "\n".join(out)


def per_c_table(r: dict) -> str:
    """Every static C at one size: steps trained and tokens/s per system, longest trainable."""
    out = ["| GPUs | C (DP) | " + " | ".join(f"{NAMES[s]}: steps, tokens/s, longest" for s in STATIC) + " |",
           "|---|---|" + "---:|" * len(STATIC)]
    for c in r["cp_sizes"]:
        cells = [f"{x['steps_trained']}, {x['tokens_per_s']:,.0f}, {_k(x['longest_trainable'])}"
                 for x in (r["static"][s][c] for s in STATIC)]
        out.append(f"| {r['gpus']} | {c} ({r['nodes'] // c}) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def assumptions(res: dict) -> list:
    """The lines stating what the numbers assume."""
    hw, st, ln, d = res["hardware"], res["setup"], res["links"], res["distribution"]
    return [
        f"  hardware: {hw['name']}: {hw['bf16_flops'] / 1e12:.0f} TFLOP/s bf16 (x{hw['mfu_matmul']} GEMM, "
        f"x{hw['mfu_attention']} attention), {hw['memory_bytes'] / GB:.0f} GB ({hw['reserved_bytes'] / GB:.0f} GB "
        f"reserved), {st['per_node']} per node = one TP group (p = {st['per_node']})",
        f"  links: in-node {ln['intra_bandwidth'] / GB:.0f} GB/s per direction (NVLink x{hw['comm_efficiency']}, "
        f"no fixed cost); inter-node {ln['inter_bandwidth'] / GB:.0f} GB/s per GPU, alpha "
        f"{ln['inter_alpha'] * 1e6:.0f} us ({ln['inter_name']}: 50 GB/s NDR x0.9); communication added to compute, "
        f"CP ring overlap {st['overlap']:g}",
        "  CP: costmodel.cp.CPCostModel over the in-node roofline; tp_sp / ulysses ring K/V over C nodes, "
        + ("the ring family one flat ring of C x p ranks" if st["cp_ring"] == "flat" else
           "the ring family an outer ring over the C nodes running the in-node ring at every step")
        + "; C a power of two <= N/8, DP = N / (8 C)",
        f"  memory: state {'6 + 12 / (DP x CP) (distributed optimizer)' if st['distributed_optimizer'] else '18'} "
        f"bytes per parameter; activations of the local s/C tokens plus the CP ring's blocks",
        f"  data: {d['n']} documents, log-normal (median 16K, sigma 1.5, seed {st['seed']}) clipped to "
        f"[{st['min_len']}, {st['max_len']}]; sample median {d['median']:.0f}, p90 {d['p90']:.0f}, p99 "
        f"{d['p99']:.0f}, {d['over_1m']} over 1M, longest {d['max']:,}; each padded to 2 C p; "
        + (f"THD packs of at most {st['pack_tokens']:,} x C tokens, first-fit decreasing, one plan per pack (the "
           f"system's at the pack's length)" if st["pack_tokens"] else "one document per micro-batch"),
        f"  steps: {st['docs_per_node']} documents per node; jobs (packs) of C nodes, longest first onto the aligned block "
        f"that frees earliest; step = makespan + update (bf16 gradient reduce-scatter and parameter all-gather "
        f"over DP x CP on the inter-node link, Adam at HBM bandwidth); a step with a document that fits nowhere "
        f"is not trained",
        f"  best static C: the most tokens trained, then tokens/s. Dynamic-CP-style ({st['dcp_policy']}): "
        + DCP_TEXT[st["dcp_policy"]] + " (groups placed by predicted time, no rounds: idealised)",
    ]


def aim_lines(key: str, m: dict) -> list:
    """The aims, one line each per size."""
    out = []
    for g, a in m["aims"].items():
        if a["one_node"]:
            out.append(f"  {key}, {g} GPUs: longest trainable {a['longest']:,} (at C = {g // 8}) = "
                       f"{a['longest_ratio']:.2f}x one node's {a['one_node']:,} (aim 4x: "
                       f"{'met' if a['longest_met'] else 'MISSED'}); at ParaDySe's best C: {a['longest_at_best_c']:,}")
        else:
            out.append(f"  {key}, {g} GPUs: longest trainable {a['longest']:,}; one node (C = 1) trains nothing "
                       f"(the model's state does not fit 8 GPUs): aim not defined")
        out.append(f"  {key}, {g} GPUs: ParaDySe x CP {a['tokens_per_s']:,.0f} tokens/s vs megatron TP+CP's best "
                   f"static ({a['megatron']}) {a['megatron_tokens_per_s']:,.0f}: "
                   + (f"{a['tokens_per_s_ratio']:.3f}x" if a["tokens_per_s_ratio"] else "-")
                   + f" ({'met' if a['tokens_per_s_met'] else 'MISSED'}); tokens trained {a['tokens_trained']:,} vs "
                   f"{a['megatron_tokens_trained']:,}")
        for n, v in a["dcp"].items():
            out.append(f"  {key}, {g} GPUs: ParaDySe x Dynamic CP against {NAMES[n]}: trains every step it trains: "
                       f"{'yes' if v['trains_theirs'] else 'NO'}; on the {v['steps_both']} steps both train "
                       + (f"{v['speedup']:.3f}x its tokens/s" if v["speedup"] else "-"))
    return out


def summary(res: dict) -> str:
    """The simulation's result as the command prints it."""
    out = ["=" * 100, res["label"], *assumptions(res)]
    for key, m in res["models"].items():
        md = m["model"]
        out += ["", f"## {md['name']}: {md['num_layers']} layers, h {md['hidden']}, {md['heads']} heads, "
                    f"{md.get('query_groups', md['heads'])} K/V groups, ffn {md['ffn']}", ""]
        for r in m["sizes"]:
            out += [table(r), ""]
            pd = r["static"]["paradyse"][r["best_c"]["paradyse"]]
            out.append(f"  ParaDySe x CP at C = {r['best_c']['paradyse']}: plan entries {pd['entries']}")
            out.append("  ParaDySe x Dynamic CP (plan_dynamic_cp): plan entries "
                       f"{r['dynamic']['paradyse_dcp']['entries']}")
            out.append("")
        out += [per_c_table_all(m), ""] + aim_lines(key, m)
    out.append("=" * 100)
    return "\n".join(out)


def per_c_table_all(m: dict) -> str:
    """:func:`per_c_table` of every size, one table."""
    parts = [per_c_table(r).splitlines() for r in m["sizes"]]
    return "\n".join(parts[0] + [ln for p in parts[1:] for ln in p[2:]])


def build_parser():
    ap = ArgumentParser(prog="python -m megatron_paradyse.bench.simulate_cp", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    d = Setup()
    ap.add_argument("--gpus", default=",".join(map(str, d.gpus)), help="GPU counts, multiples of 8 (N = 8 x C x DP)")
    ap.add_argument("--models", default=",".join(d.models), help="of " + ", ".join(MODELS))
    ap.add_argument("--docs", type=int, default=d.docs, help="documents (the same at every size)")
    ap.add_argument("--docs-per-node", type=int, default=d.docs_per_node, help="a step's documents per node")
    ap.add_argument("--max-len", type=int, default=d.max_len, help="the longest document (tokens)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--overlap", type=float, default=d.overlap, help="fraction of the CP ring's time hidden, [0, 1]")
    ap.add_argument("--no-distributed-optimizer", action="store_true",
                    help="18 bytes of state per parameter everywhere")
    ap.add_argument("--dcp-policy", choices=DCP_POLICIES, default=d.dcp_policy,
                    help="Dynamic-CP-style: the smallest C that fits, then the step's longest job widened while "
                         "its makespan falls (widen); the smallest C, no widening (fit); the C of the fewest "
                         "node-seconds, then widened (efficient)")
    ap.add_argument("--cp-ring", choices=RING_FORMS, default=d.cp_ring,
                    help="the ring family's ring over C x p ranks: an outer ring over the nodes whose every "
                         "step runs the in-node ring (two_level, the plugin's), or one flat ring (flat)")
    ap.add_argument("--pack-tokens", type=int, default=d.pack_tokens,
                    help="THD packs of at most this x C tokens per micro-batch, first-fit decreasing (0: one "
                         "document per micro-batch)")
    ap.add_argument("--json", default=None, help="also write the result (per step, per system) here")
    return ap


def setup_from(a) -> Setup:
    """The :class:`Setup` of the parsed flags, checked (:func:`check`)."""
    try:
        gpus = tuple(int(x) for x in a.gpus.split(","))
    except ValueError:
        raise UserError(f"--gpus takes integers separated by commas, got {a.gpus!r}") from None
    return check(Setup(gpus=gpus, models=tuple(x.strip() for x in a.models.split(",")), docs=a.docs,
                       docs_per_node=a.docs_per_node, seed=a.seed, max_len=a.max_len, overlap=a.overlap,
                       distributed_optimizer=not a.no_distributed_optimizer, dcp_policy=a.dcp_policy,
                       cp_ring=a.cp_ring, pack_tokens=a.pack_tokens))


def check(st: Setup) -> Setup:
    """``st``, or a UserError naming what cannot be simulated."""
    n = st.per_node
    if not st.gpus or any(g < n or g % n or (g // n) & (g // n - 1) for g in st.gpus):
        raise UserError(f"--gpus must each be {n} x a power of two, got {','.join(map(str, st.gpus))}")
    if not st.models or set(st.models) - set(MODELS):
        raise UserError(f"--models: of {', '.join(MODELS)}, got {','.join(st.models)}")
    if st.dcp_policy not in DCP_POLICIES or st.cp_ring not in RING_FORMS:
        raise UserError(f"--dcp-policy: of {', '.join(DCP_POLICIES)}, --cp-ring: of {', '.join(RING_FORMS)}; "
                        f"got {st.dcp_policy}, {st.cp_ring}")
    if min(st.docs, st.docs_per_node) < 1 or st.max_len < st.min_len or not 0 <= st.overlap <= 1 \
            or st.pack_tokens < 0:
        raise UserError(f"--docs and --docs-per-node must be >= 1, --max-len >= {st.min_len}, --overlap in [0, 1], "
                        f"--pack-tokens >= 0")
    if st.docs < st.docs_per_node * max(st.gpus) // n:
        raise UserError(f"--docs {st.docs} is less than one step at {max(st.gpus)} GPUs "
                        f"({st.docs_per_node * max(st.gpus) // n} documents)")
    return st


@command("python -m megatron_paradyse.bench.simulate_cp")
def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    setup = setup_from(a)
    run_and_report(simulate_cp, setup, summary, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
