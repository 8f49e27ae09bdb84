"""A SIMULATION (no GPU ran): the 70B on every dimension, TP 8 x PP 4 x CP C x DP, 512 H100s, interleaved.

``python -m megatron_paradyse.bench.simulate_every_dim`` prints its assumptions and a table: for
the Llama-2-70B shape on N = 8 x 4 x C x DP GPUs (a TP group of 8 per node, 4 pipeline stages,
CP of size C in {1, 2, 4, 8, 16} across nodes, DP = N / (32 C) replicas) and megatron's
interleaved schedule with V model chunks per stage (V = 1 is 1F1B), each system's steps trained,
tokens/s and longest trainable document over the seeded long-tailed documents of the CP
simulation (log-normal, median 16K, to 2M tokens):

* megatron TP + PP + CP: stock ``tp_sp`` on every layer, and ``tp_sp+rc`` (full recompute),
  each at its best static layout: the (C, V) of the most tokens trained, then tokens/s;
* ParaDySe: per micro-batch per-layer plans (strategy and recompute, the optimal planner) from
  the pipeline step planner (``planner.PipelinePlanner`` with ``num_chunks`` V: its model of
  the interleaved schedule's in-flight chunks) over ``costmodel.cp.CPCostModel`` at C, with its
  run-order search; the same rule picks its (C, V).

One rule judges every system (:class:`InterleavedJudge`): a replica's step is trained when every
op of megatron's interleaved schedule (``costmodel.schedule.simulate_interleaved``; 1F1B at V =
1, ``simulate_pipeline.Judge``) on every stage stays within the budget, the op's bytes being the
stage's static bytes, the pool of the micro-batches in flight, the running micro-batch's own
peak on the stage less its other chunks' share of what it keeps and, for every other (chunk,
micro-batch) in flight, its chunk's input and 1/V of the rest it keeps (the formula of
``planner/stages.py``). A global step is the DP replicas'
steps (consecutive documents, one per micro-batch) plus the update; a step any replica cannot fit
is not trained. Every number is a model output, not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from ..costmodel.base import union_bytes
from ..costmodel.cp import CPCostModel
from ..costmodel.schedule import interleaved_group, interleaved_order, simulate_interleaved
from ..errors import ArgumentParser, UserError, command
from ..planner import PipelinePlanner
from .simulate import GB, run_and_report, Hardware, lengths_distribution
from .simulate_cp import links_for, state_bytes
from .simulate_cp import update_seconds as cp_update_seconds
from .simulate_pipeline import Judge, Judged, Model70B, PipelineRoofline

SYSTEMS = ("paradyse", "tp_sp", "tp_sp+rc")
STOCK_ENTRY = (("tp_sp", "tp_sp"), ("tp_sp+rc", "tp_sp:rc"))   # stock system -> its entry on every layer
NAMES = {"paradyse": "ParaDySe (step planner, per-layer plans per micro-batch)",
         "tp_sp": "megatron TP+PP+CP (`tp_sp`)", "tp_sp+rc": "megatron TP+PP+CP, full recompute (`tp_sp+rc`)"}
LONGEST_UNIT = 1024


@dataclasses.dataclass
class EveryDimSetup:
    """The grid, the data and the links of one run."""

    gpus: int = 512
    tp: int = 8                   # GPUs per node = the TP (switching) group
    stages: int = 4               # P
    cp_sizes: tuple = (1, 2, 4, 8, 16)
    chunks: tuple = (1, 2, 5)     # V: model chunks per stage (80 layers / 4 stages = 20 per stage)
    docs: int = 2048
    batch: int = 128              # documents per global step (batch / DP micro-batches per replica)
    seed: int = 0
    min_len: int = 1024
    max_len: int = 2 << 20
    inter: str = "ib_ndr"
    overlap: float = 0.0
    longest_cap: int = 1 << 26    # the longest trainable is searched up to this (64M tokens)


class EveryDimRoofline(PipelineRoofline):
    """:class:`PipelineRoofline` whose update is the CP simulation's (the bf16 gradient
    reduce-scatter and parameter all-gather over the DP x CP replicas on the inter-node link,
    then Adam over the rank's shard), for the whole model; a stage takes its parameter share."""

    def __init__(self, hw: Hardware, m: Model70B, update: float | None = None):
        super().__init__(hw, m)
        self.update = update

    def update_seconds(self):
        return super().update_seconds() if self.update is None else self.update


# ------------------------------------------------------------------------------------------
# the rule


class InterleavedJudge(Judge):
    """:class:`~megatron_paradyse.bench.simulate_pipeline.Judge` under megatron's interleaved
    schedule with ``num_chunks`` V: a micro-batch's full plan is chunk after chunk (virtual
    stage v = c P + r holds layers ``[v n, (v + 1) n)``, n = L / (P V)); stage r runs its V
    chunks' layers, a chunk taking 1/V of the stage's seconds; each other (chunk, micro-batch)
    in flight keeps its chunk's input and 1/V of the stage's other held bytes, the running chunk
    its micro-batch's peak on the stage less the other V - 1 chunks' share of those bytes."""

    def __init__(self, cm, num_stages: int, limit: float, num_chunks: int):
        super().__init__(cm, num_stages, limit)
        self.V = int(num_chunks)
        if cm.num_layers % (self.P * self.V):
            raise UserError(f"{cm.num_layers} layers do not split over {self.P} stages x {self.V} chunks")

    def stage_layers(self, plan, r: int) -> tuple:
        """Stage ``r``'s layers of the chunk-major ``plan``, chunk after chunk."""
        P, V = self.P, self.V
        n = len(plan) // (P * V)
        return tuple(e for c in range(V) for e in plan[(c * P + r) * n:(c * P + r + 1) * n])

    def __call__(self, shapes, plans, order) -> Judged:
        if self.V == 1:
            return super().__call__(shapes, plans, order)
        P, V, M = self.P, self.V, len(order)
        parts = [[self.part(r, self.stage_layers(plans[j], r), *shapes[j]) for j in order] for r in range(P)]
        group = interleaved_group(M, P)
        sched = simulate_interleaved([[[x[3] / V for x in row]] * V for row in parts],
                                     [[[x[4] / V for x in row]] * V for row in parts], group)
        peaks = []
        for r in range(P):
            static, row, peak = self.stages[r].static_bytes(), parts[r], 0.0
            resident = [self.stages[r].resident_bytes(*shapes[j]) for j in order]
            for op in interleaved_order(r, P, M, V, group):
                held = sum(resident[k] + (row[k][1] - resident[k]) / V for c, k in op.chunks
                           if (c, k) != (op.chunk, op.mb))
                pool = union_bytes([row[k][0] for k in op.in_flight])
                own = row[op.mb][2] - (V - 1) * (row[op.mb][1] - resident[op.mb]) / V
                peak = max(peak, static + pool + own + held)
            peaks.append(peak)
        seconds = max(sched.ends[r] + self.stages[r].update_seconds() for r in range(P))
        return Judged(all(x <= self.limit for x in peaks), tuple(peaks), seconds, sched.makespan, sched.busy)


# ------------------------------------------------------------------------------------------
# one layout


class Layout:
    """One (C, V) of the grid: its cost model, judge and systems (``run(shapes) -> Judged``)."""

    def __init__(self, setup: EveryDimSetup, hw: Hardware, c: int, v: int, model: Model70B | None = None):
        self.c, self.v = c, v
        self.dp = setup.gpus // (setup.tp * setup.stages * c)
        model = dataclasses.replace(model or Model70B(), bytes_per_param_state=state_bytes(self.dp * c, True))
        links = links_for(hw, setup.inter)
        probe = PipelineRoofline(hw, model)
        base = EveryDimRoofline(hw, model, cp_update_seconds(probe, hw, links, self.dp * c, True))
        self.cm = CPCostModel(base, c, links, overlap=setup.overlap)
        self.budget = hw.memory_bytes - hw.reserved_bytes
        self.judge = InterleavedJudge(self.cm, setup.stages, self.budget, v)
        self.unit = 2 * c * setup.tp if c > 1 else setup.tp
        self.planner = PipelinePlanner("optimal", self.cm, self.budget, setup.stages, reorder=True,
                                       num_chunks=v, margin_bytes=0.0)

    def pad(self, s: int) -> int:
        return -(-int(s) // self.unit) * self.unit

    def run(self, system: str, shapes) -> Judged:
        """``system``'s step of one replica's micro-batches ``shapes`` = [(s, 1)], judged."""
        shapes = [(self.pad(s), b) for s, b in shapes]
        if system == "paradyse":
            sp = self.planner.plan_step(shapes)
            return self.judge(shapes, sp.plans, sp.order)
        plan = (dict(STOCK_ENTRY)[system],) * self.cm.num_layers
        return self.judge(shapes, [plan] * len(shapes), range(len(shapes)))


def replica_steps(lens: list, batch: int, dp: int) -> list:
    """The global steps: ``batch`` consecutive documents each, dealt to the DP replicas in
    consecutive slices of ``batch / dp`` (megatron's data-parallel split of a global batch)."""
    m = batch // dp
    steps = [lens[i:i + batch] for i in range(0, len(lens) - batch + 1, batch)]
    return [[[(s, 1) for s in st[d * m:(d + 1) * m]] for d in range(dp)] for st in steps]


def longest_trainable(lay: Layout, system: str, m: int, filler: int, cap: int) -> int:
    """The longest multiple of 1024 (up to ``cap``) ``system`` trains as the first micro-batch
    of a replica's step whose other m - 1 are ``filler`` tokens long; 0 if none."""
    lo, hi = 0, cap // LONGEST_UNIT
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if lay.run(system, [(mid * LONGEST_UNIT, 1)] + [(filler, 1)] * (m - 1)).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * LONGEST_UNIT


def run_layout(lay: Layout, system: str, steps: list, m: int, filler: int, cap: int) -> dict:
    """One system at one layout over every global step."""
    toks = secs = busy = span = 0.0
    trained, per_step = [], []
    for k, replicas in enumerate(steps):
        got = [lay.run(system, shapes) for shapes in replicas]
        if not all(j.fits for j in got):
            per_step.append(None)
            continue
        t = max(j.seconds for j in got)
        per_step.append(t)
        trained.append(k)
        toks += sum(s for shapes in replicas for s, _ in shapes)
        secs += t
        busy += sum(sum(j.busy) for j in got)
        span += sum(j.makespan for j in got)
    P = lay.judge.P
    return dict(c=lay.c, v=lay.v, dp=lay.dp, microbatches=m, steps_trained=len(trained), steps=len(steps),
                tokens_trained=int(toks), seconds=secs, tokens_per_s=toks / secs if secs else 0.0,
                bubble_fraction=1 - busy / (P * span) if span else 0.0, per_step=per_step,
                longest_trainable=longest_trainable(lay, system, m, filler, cap))


def best_layout(rows: list) -> dict:
    """The best static layout: the most tokens trained, then tokens/s, then the longest trainable."""
    return max(rows, key=lambda r: (r["tokens_trained"], r["tokens_per_s"], r["longest_trainable"]))


def simulate_every_dim(setup: EveryDimSetup | None = None, hw: Hardware | None = None,
                       model: Model70B | None = None) -> dict:
    """The simulation (module docstring): every system at every (C, V), and each one's best."""
    model = model or Model70B()
    setup, hw = check(setup or EveryDimSetup(), model.num_layers), hw or Hardware()
    lens = [int(x) for x in lengths_distribution(setup.docs, setup.seed, setup.max_len, setup.min_len)]
    filler = int(np.median(lens)) // 64 * 64
    grid = {name: [] for name in SYSTEMS}
    for c in setup.cp_sizes:
        for v in setup.chunks:
            lay = Layout(setup, hw, c, v, model)
            steps = replica_steps(lens, setup.batch, lay.dp)
            for name in SYSTEMS:
                grid[name].append(run_layout(lay, name, steps, setup.batch // lay.dp, filler, setup.longest_cap))
    best = {name: best_layout(rows) for name, rows in grid.items()}
    return dict(label="SIMULATION (analytic roofline x CP x interleaved pipeline, no GPU ran)",
                hardware=dataclasses.asdict(hw), setup=dataclasses.asdict(setup), model=dataclasses.asdict(model),
                budget_bytes=hw.memory_bytes - hw.reserved_bytes,
                distribution=dict(n=len(lens), median=float(np.median(lens)), p90=float(np.percentile(lens, 90)),
                                  max=max(lens), filler=filler),
                grid=grid, best={k: {x: y for x, y in v.items() if x != "per_step"} for k, v in best.items()},
                aims=aims(grid, best))


def aims(grid: dict, best: dict) -> dict:
    """The issue's aims at the grid's size: ParaDySe's longest trainable (at any layout) against
    megatron's best static layout's (of ``tp_sp`` and ``tp_sp+rc``, at that layout and at
    any), and ParaDySe's tokens/s at its best layout against megatron's best."""
    mega = max(("tp_sp", "tp_sp+rc"), key=lambda n: (best[n]["tokens_trained"], best[n]["tokens_per_s"]))
    mb, pd = best[mega], best["paradyse"]
    mine_long = max(r["longest_trainable"] for r in grid["paradyse"])
    their_long = max(r["longest_trainable"] for n in ("tp_sp", "tp_sp+rc") for r in grid[n])
    return dict(megatron=f"{mega} at C = {mb['c']}, V = {mb['v']}", megatron_longest=mb["longest_trainable"],
                megatron_longest_any=their_long, paradyse_longest=mine_long,
                paradyse_layout=f"C = {pd['c']}, V = {pd['v']}",
                longest_ratio=mine_long / mb["longest_trainable"] if mb["longest_trainable"] else None,
                longest_ratio_any=mine_long / their_long if their_long else None,
                longest_met=bool(mb["longest_trainable"]) and mine_long >= 1.3 * mb["longest_trainable"],
                tokens_per_s=pd["tokens_per_s"], megatron_tokens_per_s=mb["tokens_per_s"],
                tokens_per_s_ratio=pd["tokens_per_s"] / mb["tokens_per_s"] if mb["tokens_per_s"] else None,
                tokens_per_s_met=pd["tokens_per_s"] > mb["tokens_per_s"],
                tokens_trained=pd["tokens_trained"], megatron_tokens_trained=mb["tokens_trained"])


# ------------------------------------------------------------------------------------------
# the report


def _k(n) -> str:
    return f"{n:,}" if n else "-"


def grid_table(r: dict) -> str:
    """Every layout: per system its steps trained, tokens/s and longest trainable."""
    out = ["| C | V | DP | micro-batches per replica | " + " | ".join(
        f"{NAMES[s]}: steps, tokens/s, bubble, longest" for s in SYSTEMS) + " |",
        "|---:|---:|---:|---:|" + "---|" * len(SYSTEMS)]
    for i, row in enumerate(r["grid"]["paradyse"]):
        cells = [f"{x['steps_trained']}/{x['steps']}, {x['tokens_per_s']:,.0f}, {100 * x['bubble_fraction']:.0f}%, "
                 f"{_k(x['longest_trainable'])}" for x in (r["grid"][s][i] for s in SYSTEMS)]
        out.append(f"| {row['c']} | {row['v']} | {row['dp']} | {row['microbatches']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def best_table(r: dict) -> str:
    """Each system at its best layout."""
    out = ["| system | best layout (C, V, DP) | steps trained | tokens trained | tokens/s | bubble | longest trainable (there) |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for s in SYSTEMS:
        b = r["best"][s]
        out.append(f"| {NAMES[s]} | C = {b['c']}, V = {b['v']}, DP = {b['dp']} | {b['steps_trained']} / {b['steps']} | "
                   f"{_k(b['tokens_trained'])} | {b['tokens_per_s']:,.0f} | {100 * b['bubble_fraction']:.1f}% | "
                   f"{_k(b['longest_trainable'])} |")
    return "\n".join(out)


def summary(r: dict) -> str:
    """The simulation's result as the command prints it."""
    st, hw, d, a = r["setup"], r["hardware"], r["distribution"], r["aims"]
    out = ["=" * 100, r["label"],
           f"  grid: {st['gpus']} x {hw['name']} = TP {st['tp']} x PP {st['stages']} x CP C x DP, C in "
           f"{list(st['cp_sizes'])}, V in {list(st['chunks'])} chunks per stage (V = 1: 1F1B); the CP simulation's "
           f"links ({st['inter']}), overlap {st['overlap']:g}; budget {r['budget_bytes'] / GB:g} GB per GPU",
           f"  state: 6 + 12 / (DP x C) bytes per parameter (distributed optimizer); update: bf16 reduce-scatter + "
           f"all-gather over DP x C, Adam over the shard",
           f"  data: {d['n']} documents (median {d['median']:.0f}, p90 {d['p90']:.0f}, longest {d['max']:,}), "
           f"{st['batch']} per global step, one per micro-batch, consecutive slices per replica; longest trainable: "
           f"the first micro-batch of a replica's step whose others are {d['filler']:,} tokens",
           "", best_table(r), "", grid_table(r), "",
           f"  aim, longest trainable: ParaDySe {a['paradyse_longest']:,} vs megatron's best static layout "
           f"({a['megatron']}) {a['megatron_longest']:,}: "
           + (f"{a['longest_ratio']:.2f}x" if a["longest_ratio"] else "-")
           + f" (aim 1.3x: {'met' if a['longest_met'] else 'MISSED'}); vs megatron's longest at any layout "
           f"{a['megatron_longest_any']:,}: " + (f"{a['longest_ratio_any']:.2f}x" if a["longest_ratio_any"] else "-"),
           f"  aim, tokens/s: ParaDySe ({a['paradyse_layout']}) {a['tokens_per_s']:,.0f} vs {a['megatron_tokens_per_s']:,.0f}: "
           + (f"{a['tokens_per_s_ratio']:.3f}x" if a["tokens_per_s_ratio"] else "-")
           + f" ({'met' if a['tokens_per_s_met'] else 'MISSED'}); tokens trained {a['tokens_trained']:,} vs "
           f"{a['megatron_tokens_trained']:,}", "=" * 100]
    return "\n".join(out)


def check(st: EveryDimSetup, num_layers: int = 80) -> EveryDimSetup:
    """``st``, or a UserError naming what cannot be simulated."""
    if not st.cp_sizes:
        raise UserError("--cp: give at least one CP size")
    for c in st.cp_sizes:
        n = st.tp * st.stages * c
        if c < 1 or st.gpus % n:
            raise UserError(f"--gpus {st.gpus} is not a multiple of TP {st.tp} x PP {st.stages} x C {c}")
        if st.batch % (st.gpus // n):
            raise UserError(f"--batch {st.batch} does not split over DP = {st.gpus // n} replicas at C = {c}")
    if not st.chunks or any(v < 1 or num_layers % (st.stages * v) for v in st.chunks):
        raise UserError(f"--chunks: {num_layers} layers must split over {st.stages} stages x V chunks, "
                        f"got {list(st.chunks)}")
    if st.docs < st.batch or st.batch < 1:
        raise UserError(f"--docs {st.docs} must hold at least one step of --batch {st.batch} >= 1")
    return st


def _ints(text: str, flag: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"{flag} takes integers separated by commas, got {text!r}") from None


def build_parser():
    ap = ArgumentParser(prog="python -m megatron_paradyse.bench.simulate_every_dim", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    d = EveryDimSetup()
    ap.add_argument("--gpus", type=int, default=d.gpus, help="N = 8 x 4 x C x DP")
    ap.add_argument("--cp", default=",".join(map(str, d.cp_sizes)), help="CP sizes C")
    ap.add_argument("--chunks", default=",".join(map(str, d.chunks)), help="V, model chunks per stage")
    ap.add_argument("--docs", type=int, default=d.docs)
    ap.add_argument("--batch", type=int, default=d.batch, help="documents per global step")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--overlap", type=float, default=d.overlap, help="fraction of the CP ring's time hidden")
    ap.add_argument("--json", default=None, help="also write the result here")
    return ap


@command("python -m megatron_paradyse.bench.simulate_every_dim")
def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if not 0 <= a.overlap <= 1:
        raise UserError("--overlap must be in [0, 1]")
    setup = EveryDimSetup(gpus=a.gpus, cp_sizes=_ints(a.cp, "--cp"), chunks=_ints(a.chunks, "--chunks"),
                          docs=a.docs, batch=a.batch, seed=a.seed, overlap=a.overlap)
    run_and_report(simulate_every_dim, setup, summary, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
