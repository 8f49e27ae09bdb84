"""A SIMULATION (no GPU ran): a 70B-class model on PP x TP = 8 x 8 H100s, lengths to 1M tokens.

``python -m megatron_paradyse.bench.simulate_pipeline`` prints its assumptions and one table:
for seeded steps of M micro-batches (one document each, log-normal lengths clipped to [1K, 1M]),
each system's steps trained, tokens/s over those steps, bubble fraction and longest trainable
sequence. The systems: every strategy on every layer, plain and recomputed (``tp_sp`` is stock
megatron PP x TP+SP, ``tp_sp+rc`` the same with full recompute), run in the data order as
megatron runs them; ParaDySe's :class:`~megatron_paradyse.planner.PipelinePlanner` (optimal),
with and without its run-order search.

One rule judges every system (:func:`judge`): a step is trained when, on every pipeline stage,
every op of megatron's 1F1B schedule (``costmodel.schedule.simulate_1f1b``) stays within budget -
margin, the op's bytes being the stage's static bytes, the pool of the micro-batches in flight,
the running micro-batch's own peak and what each other in-flight micro-batch keeps (the stage
cost models of ``costmodel.stage.stage_cost_model``; the formula of ``planner/stages.py``).
The planner's plans are judged by this rule too, not by its own answer. A step a system cannot
fit is not trained by it: its tokens count for no one, its seconds are not added.

The costs are ``simulate.H100Roofline``'s (datasheet rates, memory from activation counts,
recompute assumed) on the Llama-2-70B shape with GQA (:class:`PipelineRoofline`). Every number
is a model output, not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import NamedTuple

import numpy as np

from ..costmodel.analytic import param_counts
from ..costmodel.base import union_bytes
from ..errors import ArgumentParser, UserError, command
from ..costmodel.schedule import simulate_1f1b
from ..costmodel.stage import FORWARD_SHARE, forward_share, stage_cost_model
from ..planner import PipelinePlanner
from .simulate import GB, run_and_report, H100Roofline, Hardware, Model7B, lengths_distribution, static_systems

ADAM_BYTES_PER_PARAM = 30  # fused Adam: reads master, grad, m, v (16), writes master, m, v (12), bf16 param (2)


@dataclasses.dataclass
class Model70B(Model7B):
    name: str = "70B-class (Llama-2-70B shape)"
    num_layers: int = 80
    hidden: int = 8192
    heads: int = 64
    query_groups: int = 8               # GQA: 8 K/V groups
    ffn: int = 28672
    vocab: int = 32000
    p: int = 8                          # the TP group = the switching group
    bytes_per_param_state: float = 18   # bf16 param + fp32 main grad, master, Adam m and v (DP = 1)


@dataclasses.dataclass
class PipelineSetup:
    """The pipeline and the data: P stages, steps of M micro-batches (one document each)."""

    stages: int = 8
    microbatches: int = 16
    steps: int = 64
    seed: int = 0
    min_len: int = 1024
    max_len: int = 1 << 20
    margin_fraction: float = 0.0
    dp: int = 1          # data-parallel replicas: megatron's distributed optimizer shards 12 of the 18 bytes over them


class PipelineRoofline(H100Roofline):
    """``H100Roofline`` on a GQA shape: K/V groups in the shape (time features, layer weights);
    static bytes = parameters on a rank x bytes of state each (``analytic.param_counts``, what
    the stage cost models split by stage; the hardware's reserve is taken off the budget
    instead); update = one fused Adam pass over the rank's parameters at HBM bandwidth.
    Layer costs are memoized."""

    def __init__(self, hw: Hardware | None = None, m: Model70B | None = None):
        super().__init__(hw or Hardware(), m or Model70B())
        self.shape = dataclasses.replace(self.shape, query_groups=self.m.query_groups)
        self.layer_params = self.shape.layer_params()
        self._memo: dict = {}

    def params_per_rank(self) -> float:
        """Parameters on one rank of the whole model (every stage)."""
        pc = param_counts(self.shape)
        return pc["layers"] + pc["embedding"] + pc["output"] + pc["final_norm"]

    def layer(self, entry, s, b):
        key = (entry, s, b)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = super().layer(entry, s, b)
        return got

    def static_bytes(self):
        return self.params_per_rank() * self.m.bytes_per_param_state

    def update_seconds(self):
        return self.params_per_rank() * ADAM_BYTES_PER_PARAM / self.hw.hbm_bytes_per_s


# ------------------------------------------------------------------------------------------
# the one rule


class Judged(NamedTuple):
    """One step of one system under the rule (:class:`Judge`)."""

    fits: bool
    stage_peaks: tuple   # per stage: the largest op's bytes over the schedule
    seconds: float       # makespan + the last stage's update
    makespan: float      # first forward to last backward, bubbles included
    busy: tuple          # per stage: seconds of its forwards and backwards


class Judge:
    """The rule every system is judged by, on the stage cost models of ``cm`` over P stages."""

    def __init__(self, cm, num_stages: int, limit: float):
        self.cm, self.P, self.limit = cm, int(num_stages), float(limit)
        self.stages = [stage_cost_model(cm, r, self.P) for r in range(self.P)]
        self.per = cm.num_layers // self.P
        self._memo: dict = {}

    def part(self, r: int, layers: tuple, s: int, b: int) -> tuple:
        """``(pool, held, act, fwd, bwd)`` of one micro-batch on stage r under ``layers``:
        its pool buffers, the bytes it keeps from forward to backward, its own peak above
        static and pool (``CostModel.step``), its forward and backward seconds."""
        role = min(r, 1) if r < self.P - 1 else 2
        key = (role, layers, s, b)
        if key not in self._memo:
            m = self.stages[r]
            pool: dict = {}
            for d in [m.pool(e, s, b) for e in dict.fromkeys(layers)] + [m.pool("nonlayer", s, b)]:
                for k, v in d.items():
                    pool[k] = max(pool.get(k, 0.0), float(v))
            st, extra = m.step(layers, s, b), m.nonlayer(s, b)
            costs = [m.layer(e, s, b) for e in layers]
            held = m.resident_bytes(s, b) + extra.saved_bytes + sum(c.saved_bytes for c in costs)
            act = st.peak_bytes - m.static_bytes() - union_bytes([pool])
            fwd = extra.seconds * FORWARD_SHARE + sum(
                c.seconds * forward_share(e) for e, c in zip(layers, costs))
            self._memo[key] = (pool, held, act, fwd, st.seconds - fwd)
        return self._memo[key]

    def __call__(self, shapes, plans, order) -> Judged:
        """The step of micro-batches ``shapes`` = [(s, b)] with per-micro-batch ``plans`` (L
        entries each, stage after stage), run in ``order``: 1F1B simulated, every op's bytes
        on every stage against the limit."""
        P, n = self.P, self.per
        parts = [[self.part(r, tuple(plans[j][r * n:(r + 1) * n]), *shapes[j]) for j in order] for r in range(P)]
        sched = simulate_1f1b([[x[3] for x in row] for row in parts], [[x[4] for x in row] for row in parts])
        peaks = []
        for r in range(P):
            static, row, peak = self.stages[r].static_bytes(), parts[r], 0.0
            for op in sched.ops[r]:
                held = sum(row[k][1] for k in op.in_flight if k != op.mb)
                pool = union_bytes([row[k][0] for k in op.in_flight])
                peak = max(peak, static + pool + row[op.mb][2] + held)
            peaks.append(peak)
        seconds = max(sched.ends[r] + self.stages[r].update_seconds() for r in range(P))
        return Judged(all(x <= self.limit for x in peaks), tuple(peaks), seconds, sched.makespan, sched.busy)


# ------------------------------------------------------------------------------------------
# the systems


def step_shapes(setup: PipelineSetup) -> list:
    """The steps' micro-batches ``[[(s, 1)] * M] * steps``: :func:`simulate.lengths_distribution`
    (log-normal, median 16K, sigma 1.5, clipped to [min_len, max_len], the longest set to
    max_len, multiples of 64), consecutive draws forming a step (the data order)."""
    M = setup.microbatches
    lens = lengths_distribution(setup.steps * M, setup.seed, setup.max_len, setup.min_len)
    return [[(int(s), 1) for s in lens[k * M:(k + 1) * M]] for k in range(setup.steps)]


def static_system(judge: Judge, plan: tuple):
    """A static system: ``plan`` for every micro-batch, in the data order."""
    def run(shapes):
        return judge(shapes, [plan] * len(shapes), range(len(shapes))), None
    return run


def planner_system(judge: Judge, pp: PipelinePlanner):
    """ParaDySe: the pipeline planner's step plan (plans and run order), judged by the rule;
    also returns the planner's StepPlan (its own verdict, its message)."""
    def run(shapes):
        sp = pp.plan_step(shapes)
        return judge(shapes, sp.plans, sp.order), sp
    return run


def build_systems(cm, setup: PipelineSetup, budget: float, margin: float, judge: Judge) -> dict:
    """``{name: run(shapes) -> (Judged, StepPlan or None)}``: every static plan, then the planner
    with its run-order search (``paradyse``) and in the data order (``paradyse_data_order``)."""
    out = {name: static_system(judge, plan) for name, plan in static_systems(cm).items()}
    for name, reorder in (("paradyse", True), ("paradyse_data_order", False)):
        pp = PipelinePlanner("optimal", cm, budget, setup.stages, reorder=reorder, margin_bytes=margin)
        out[name] = planner_system(judge, pp)
    return out


def longest_trainable(run, M: int, filler: int, cap: int) -> int:
    """The longest multiple of 1024 (up to ``cap``) that ``run`` trains as the first
    micro-batch of a step whose other M - 1 are ``filler`` tokens long; 0 if none."""
    lo, hi = 0, cap // 1024
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if run([(mid * 1024, 1)] + [(filler, 1)] * (M - 1))[0].fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * 1024


def _entries(plans, used: dict) -> None:
    """Add each plan entry's layer count of ``plans`` to ``used``."""
    for plan in plans:
        for e in plan:
            used[e] = used.get(e, 0) + 1


def run_system(run, steps, P: int, M: int, filler: int, cap: int) -> dict:
    """One system over every step: what it trains, its seconds, bubbles, the plan entries it uses."""
    toks = secs = busy = span = 0.0
    trained, failed, disagree, used, seqs, per_step, messages = [], [], [], {}, 0, [], {}
    for k, shapes in enumerate(steps):
        j, sp = run(shapes)
        per_step.append(dict(fits=j.fits, seconds=j.seconds, stage_peaks=list(j.stage_peaks)))
        if sp is not None and sp.fits != j.fits:
            disagree.append(k)
        if not j.fits:
            failed.append(k)
            if sp is not None and sp.message:
                messages[k] = sp.message
            continue
        trained.append(k)
        toks += sum(s * b for s, b in shapes)
        seqs += len(shapes)
        secs, busy, span = secs + j.seconds, busy + sum(j.busy), span + j.makespan
        if sp is not None:
            _entries(sp.plans, used)
    longest = max((s for k in trained for s, _ in steps[k]), default=0)
    total = sum(used.values())
    return dict(steps_trained=len(trained), steps_failed=len(failed), failed_steps=failed,
                sequences_trained=seqs, tokens_trained=int(toks), seconds=secs,
                tokens_per_s=toks / secs if secs else 0.0, bubble_fraction=1 - busy / (P * span) if span else 0.0,
                longest_trained=longest, longest_trainable=longest_trainable(run, M, filler, cap),
                planner_disagrees_on_steps=disagree, planner_messages=messages,
                entries={e: round(n / total, 4) for e, n in sorted(used.items(), key=lambda kv: -kv[1])} if total else {},
                per_step=per_step)


def headline(rows: dict, statics: list) -> dict:
    """ParaDySe against each static system (and its data-order self): the steps both train,
    its time on them saved, and the steps only the other trains."""
    out = {}
    for pn, refs in (("paradyse", statics + ["paradyse_data_order"]), ("paradyse_data_order", statics)):
        mine = rows[pn]["per_step"]
        for ref in refs:
            theirs = rows[ref]["per_step"]
            both = [k for k in range(len(mine)) if mine[k]["fits"] and theirs[k]["fits"]]
            missed = [k for k in range(len(mine)) if theirs[k]["fits"] and not mine[k]["fits"]]
            t_ref = sum(theirs[k]["seconds"] for k in both)
            out[f"{pn} vs {ref}"] = dict(
                steps_both=len(both), steps_only_other=missed,
                time_saved_on_steps_both=1 - sum(mine[k]["seconds"] for k in both) / t_ref if t_ref else None)
    return out


def spread_order(shapes, P: int) -> list:
    """A run order with the longest micro-batches ``P`` positions apart (positions 0, P, 2P, ...,
    longest first), the others in data order between them: no two of those are in flight
    together on any stage."""
    M = len(shapes)
    slots = list(range(0, M, P))
    longest = sorted(range(M), key=lambda j: (-shapes[j][0], j))[:len(slots)]
    rest = iter(j for j in range(M) if j not in longest)
    at = dict(zip(slots, longest))
    return [at[k] if k in at else next(rest) for k in range(M)]


def spread_trains(judge: Judge, pp: PipelinePlanner, steps, ks) -> list:
    """Of steps ``ks``, those the planner trains (by the rule) when given :func:`spread_order`
    (no search of its own): a diagnostic of its candidate run orders, not a system."""
    out = []
    for k in ks:
        order = spread_order(steps[k], judge.P)
        shapes = [steps[k][j] for j in order]
        sp = pp.plan_step(shapes, reorder=False)
        if judge(shapes, sp.plans, sp.order).fits:
            out.append(k)
    return out


def simulate_pipeline(setup: PipelineSetup | None = None, model: Model70B | None = None, hw: Hardware | None = None) -> dict:
    """The simulation (module docstring): every system over every step, judged by one rule."""
    setup, model, hw = setup or PipelineSetup(), model or Model70B(), hw or Hardware()
    if model.num_layers % setup.stages:
        raise UserError(f"{model.num_layers} layers do not split over {setup.stages} stages")
    if setup.dp > 1:  # bf16 param and fp32 main grad on every replica, master and Adam sharded
        model = dataclasses.replace(model, bytes_per_param_state=6 + 12 / setup.dp)
    cm = PipelineRoofline(hw, model)
    budget = hw.memory_bytes - hw.reserved_bytes
    margin = setup.margin_fraction * budget
    judge = Judge(cm, setup.stages, budget - margin)
    steps = step_shapes(setup)
    lens = [s for st in steps for s, _ in st]
    filler = int(np.median(lens)) // 64 * 64
    systems = build_systems(cm, setup, budget, margin, judge)
    rows = {name: run_system(run, steps, setup.stages, setup.microbatches, filler, 2 * setup.max_len)
            for name, run in systems.items()}
    statics = list(static_systems(cm))
    nobody = [k for k in range(len(steps)) if not any(r["per_step"][k]["fits"] for r in rows.values())]
    pp = PipelinePlanner("optimal", cm, budget, setup.stages, reorder=False, margin_bytes=margin)
    stage_static = [m.static_bytes() for m in judge.stages]
    return dict(label="SIMULATION (analytic roofline, 1F1B pipeline, no GPU ran)",
                hardware=dataclasses.asdict(hw), model=dataclasses.asdict(model), setup=dataclasses.asdict(setup),
                budget_bytes=budget, margin_bytes=margin, limit_bytes=budget - margin,
                stage_static_bytes=stage_static, update_seconds=cm.update_seconds(),
                distribution=dict(n=len(lens), median=float(np.median(lens)), p90=float(np.percentile(lens, 90)),
                                  max=max(lens), filler=filler, step_tokens=[sum(s for s, _ in st) for st in steps],
                                  step_longest=[max(s for s, _ in st) for st in steps]),
                static_systems=statics, steps_no_system_trains=nobody,
                spread_order_trains=spread_trains(judge, pp, steps, nobody), systems=rows,
                headline=headline(rows, statics))


# ------------------------------------------------------------------------------------------
# the report


NAMES = {"tp_sp": "`tp_sp` (stock megatron TP+SP)", "tp_sp+rc": "`tp_sp+rc` (stock, full recompute)",
         "paradyse": "ParaDySe (optimal, run-order search)", "paradyse_data_order": "ParaDySe (optimal, data order)"}


def _k(n: int) -> str:
    """A length as the table shows it: ``638,976``, or ``-`` for none."""
    return f"{n:,}" if n else "-"


def table(r: dict) -> str:
    """The systems as a Markdown table."""
    n = r["setup"]["steps"]
    out = ["| system | steps trained (of %d) | tokens trained | tokens/s, trained steps | bubble | "
           "longest trained | longest trainable | ParaDySe's time saved (steps both train) |" % n,
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in r["systems"].items():
        h = r["headline"].get(f"paradyse vs {name}")
        saved = f"{100 * h['time_saved_on_steps_both']:.1f}% ({h['steps_both']})" if h and h["steps_both"] else "-"
        out.append(f"| {NAMES.get(name, f'`{name}`')} | {s['steps_trained']} | {s['tokens_trained']:,} | "
                   f"{s['tokens_per_s']:,.0f} | {100 * s['bubble_fraction']:.1f}% | {_k(s['longest_trained'])} | "
                   f"{_k(s['longest_trainable'])} | {saved} |")
    return "\n".join(out)


def _dp(dp: int) -> str:
    """The optimizer assumption as the report states it."""
    if dp == 1:
        return "one replica, DP = 1: megatron's distributed optimizer would shard nothing"
    return f"DP = {dp} replicas, megatron's distributed optimizer: 6 + 12 / {dp}"


def assumptions(r: dict) -> list:
    """The lines stating what the numbers assume."""
    hw, m, st, d = r["hardware"], r["model"], r["setup"], r["distribution"]
    P, p = st["stages"], m["p"]
    return [
        f"  hardware: PP {P} x TP {p} = {P * p} x {hw['name']}: {hw['bf16_flops'] / 1e12:.0f} TFLOP/s bf16 "
        f"(x{hw['mfu_matmul']} GEMM, x{hw['mfu_attention']} attention), NVLink {hw['nvlink_bytes_per_s'] / GB:.0f} "
        f"GB/s per direction (x{hw['comm_efficiency']}) inside a TP group, no overlap of communication and compute; "
        f"pipeline sends take no time",
        f"  model: {m['name']}: {m['num_layers']} layers, h {m['hidden']}, {m['heads']} heads, {m['query_groups']} "
        f"K/V groups, SwiGLU ffn {m['ffn']}, vocab {m['vocab']}, bf16, {m['bytes_per_param_state']:g} bytes of state "
        f"per parameter ({_dp(st['dp'])}), micro-batch 1",
        f"  stages: {m['num_layers'] // P} layers each; static per stage (GB): "
        + ", ".join(f"{x / GB:.1f}" for x in r["stage_static_bytes"])
        + " (embedding on the first, output layer on the last); the last stage also holds the logits and loss; "
          "every stage keeps its input per micro-batch in flight (its sent output is the last layer's, counted in that layer's saved bytes)",
        f"  schedule: megatron's 1F1B, M = {st['microbatches']} micro-batches per step, stage r holds up to "
        f"min(P - r, M) micro-batches' activations; update {r['update_seconds'] * 1e3:.0f} ms after the last backward",
        f"  lengths: {st['steps']} steps x {st['microbatches']} = {d['n']} documents, log-normal (seed {st['seed']}), "
        f"median {d['median']:.0f}, p90 {d['p90']:.0f}, max {d['max']}; longest trainable: the first micro-batch "
        f"of a step whose {st['microbatches'] - 1} others are {d['filler']} tokens",
        f"  one rule for every system: every op of the 1F1B schedule on every stage within "
        f"{r['budget_bytes'] / GB:g} GB ({hw['memory_bytes'] / GB:g} GB - {hw['reserved_bytes'] / GB:g} GB reserved) - margin {r['margin_bytes'] / GB:g} GB",
    ]


def summary(r: dict) -> str:
    """The simulation's result as the command prints it."""
    out = ["=" * 100, r["label"], *assumptions(r), "", table(r), ""]
    P = r["setup"]["stages"]
    for name in ("paradyse", "paradyse_data_order"):
        s = r["systems"][name]
        out.append(f"  {name}: plan entries (share of layer x micro-batch): {s['entries']}")
        if s["planner_disagrees_on_steps"]:
            out.append(f"  {name}: the planner's own verdict differs from the rule on steps {s['planner_disagrees_on_steps']}")
    for k, msg in r["systems"]["paradyse"]["planner_messages"].items():
        out.append(f"  paradyse: step {k} not trained: {msg[:200]}...")
    out.append(f"  steps no system trains: {r['steps_no_system_trains']} (longest document of each: "
               f"{[r['distribution']['step_longest'][k] for k in r['steps_no_system_trains']]}); of them the "
               f"planner trains {r['spread_order_trains']} in a run order with the longest micro-batches {P} apart")
    for key, h in r["headline"].items():
        if h["steps_both"] and (key.startswith("paradyse vs") or key.endswith("vs paradyse")):
            out.append(f"  {key}: {h['steps_both']} steps both train, {100 * h['time_saved_on_steps_both']:.1f}% "
                       f"less time on them; steps only the other trains: {h['steps_only_other'] or 'none'}")
    out.append(f"  bubble: 1 - busy / ({P} x pipeline time), over the trained steps")
    out.append("=" * 100)
    return "\n".join(out)


def build_parser():
    ap = ArgumentParser(prog="python -m megatron_paradyse.bench.simulate_pipeline", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    d = PipelineSetup()
    ap.add_argument("--steps", type=int, default=d.steps, help="steps (of --microbatches documents each)")
    ap.add_argument("--microbatches", type=int, default=d.microbatches, help="M, micro-batches per step")
    ap.add_argument("--stages", type=int, default=d.stages, help="P, pipeline stages (80 layers split evenly)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--margin-fraction", type=float, default=d.margin_fraction,
                    help="one margin for every system, a fraction of the budget")
    ap.add_argument("--dp", type=int, default=d.dp,
                    help="data-parallel replicas (the distributed optimizer's shards; the simulation is one replica's)")
    ap.add_argument("--json", default=None, help="also write the result (per step, per system) here")
    return ap


@command("python -m megatron_paradyse.bench.simulate_pipeline")
def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if min(a.steps, a.microbatches, a.stages, a.dp) < 1 or not 0 <= a.margin_fraction < 1:
        raise UserError("--steps, --microbatches, --stages and --dp must be >= 1, --margin-fraction in [0, 1)")
    setup = PipelineSetup(stages=a.stages, microbatches=a.microbatches, steps=a.steps, seed=a.seed,
                          margin_fraction=a.margin_fraction, dp=a.dp)
    run_and_report(simulate_pipeline, setup, summary, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
