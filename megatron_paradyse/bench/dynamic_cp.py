"""The Dynamic CP benchmark (``python -m megatron_paradyse.bench --dynamic-cp-pool N``): every
system trains the same global batches of documents on a pool of N nodes of p gloo ranks
(world = N x p), each step a schedule of rounds over the pool (``planner/dynamic_cp.py``): in
every round the pool is cut into aligned power-of-two blocks, each running one micro-batch (a
pack of documents) at CP size c = its block's size (``parallel/dynamic_cp.py``).

The systems (:func:`system_names`), all priced by the same cost models (the in-node model at
c = 1, ``CPCostModel`` above) and judged by one per-rank memory budget:

* ``paradyse_dcp``: ParaDySe x Dynamic CP, ``plan_dynamic_cp``: each micro-batch's c and
  per-layer plan chosen together (the optimal planner at each c);
* ``paradyse_cp<C>``: ParaDySe at a fixed CP size C: every document at C, packed first-fit
  decreasing while the planner's plan fits (``pack_ffd``), rounds balanced by predicted time,
  the planner's plan per micro-batch; a step with a document that fits at C under no plan cannot
  run (refused, every rank alike);
* ``megatron_dcp``, ``megatron_dcp+rc``: megatron's Dynamic CP policy (``megatron_dcp``: each
  document at the smallest power-of-two c at which its plan fits, packs of one c first-fit
  decreasing, rounds balanced by ``s^2/c``) with ``tp_sp``, or ``tp_sp:rc``, on every layer;
* ``<strategy>_cp<C>``: one in-node strategy (plain or ``+rc``) on every layer at a fixed C,
  packed and arranged as ``paradyse_cp<C>`` with that plan's predicted peak as the packing's
  fit (a document over the budget alone still runs, alone: the measured peak judges it);
* the per-step oracle, afterwards (``report.oracle``): the fastest measured system whose
  measured peak fits the budget.

Per step and system: the step's wall time (max over ranks; the median of ``repeats`` timed
steps), the peak (max over ranks: a second, tracked forward and backward plus parameters,
gradients and optimizer state, as ``world._measure``), the schedule's predicted time and peak,
its rounds and CP sizes.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
import types

import torch
import torch.distributed as dist

from .. import cpu_compat
from .. import data as pdata
from ..costmodel.cp import Links
from ..costmodel.ranks import init_parallel
from ..memory import PeakMemory, static_bytes
from ..parallel import dynamic_cp
from ..parallel.dispatch import install
from ..parallel.dynamic_cp import mine
from ..parallel.plans import describe
from ..planner.core import NoFitError
from ..planner.dynamic_cp import (DCPSchedule, MicroBatchPricer, build_rounds, cp_planners, megatron_dcp,
                                  pack_ffd, plan_dynamic_cp, power_sizes)
from ..training.arguments import parse_args
from ..training.dims import dims_of
from ..training.dynamic_cp import DynamicCPLoader, padding_pack
from ..training.model_args import shape_from_args
from ..units import MiB
from .systems import _load_cost_model
from .world import System, _documents, _max_over_ranks

log = logging.getLogger(__name__)

STATIC_ENTRIES = ("tp_sp", "ulysses", "ring", "metp", "tp_sp:rc", "ulysses:rc", "ring:rc", "metp:rc")
MEGATRON = types.MappingProxyType({"megatron_dcp": ("tp_sp",), "megatron_dcp+rc": ("tp_sp:rc",)})
LINKS = ("cpu_gloo", "cpu_gloo")


def system_names(pool: int, statics=STATIC_ENTRIES) -> tuple:
    """Every system of a pool of ``pool`` nodes (the module's list), in run order."""
    sizes = power_sizes(pool)
    return (("paradyse_dcp",) + tuple(f"paradyse_cp{c}" for c in sizes) + tuple(MEGATRON)
            + tuple(f"{e.replace(':rc', '+rc')}_cp{c}" for e in statics for c in sizes))


@dataclasses.dataclass
class DCPSystem:
    """One system's schedule rule: ``kind`` ``dcp`` | ``fixed`` | ``megatron`` | ``static``,
    ``size`` its fixed C, ``entry`` its per-layer plan entry (static), ``entries`` megatron's."""

    name: str
    kind: str
    size: int | None = None
    entry: str | None = None
    entries: tuple = ()
    last: DCPSchedule | None = None

    @classmethod
    def parse(cls, name: str, pool: int) -> "DCPSystem":
        if name == "paradyse_dcp":
            return cls(name, "dcp")
        if name in MEGATRON:
            return cls(name, "megatron", entries=MEGATRON[name])
        base, _, c = name.rpartition("_cp")
        if not c.isdigit() or int(c) not in power_sizes(pool) or not base:
            raise ValueError(f"unknown Dynamic CP bench system {name!r}; choose from {', '.join(system_names(pool))}")
        if base == "paradyse":
            return cls(name, "fixed", size=int(c))
        entry = base.replace("+rc", ":rc")
        if entry not in STATIC_ENTRIES:
            raise ValueError(f"unknown strategy {base!r} in {name!r}; choose from {', '.join(system_names(pool))}")
        return cls(name, "static", size=int(c), entry=entry)

    def schedule(self, lengths, planners: dict, pool: int, p: int) -> DCPSchedule:
        """The step's schedule of documents ``lengths`` (NoFitError: the step cannot run)."""
        pr = MicroBatchPricer(lengths, planners, p)
        if self.kind == "dcp":
            got = plan_dynamic_cp(lengths, pool, planners, p, pricer=pr)
        elif self.kind == "megatron":
            got = megatron_dcp(pr, pool, entries=self.entries)
        elif self.kind == "fixed":
            got = fixed_schedule(pr, pool, self.size, pr.choice, refuse=True, policy=self.name)
        else:
            price = (lambda d, c: pr.uniform(d, c, (self.entry,)))
            got = fixed_schedule(pr, pool, self.size, price, refuse=False, policy=self.name)
        self.last = got
        return got


def fixed_schedule(pr: MicroBatchPricer, pool: int, c: int, price, refuse: bool, policy: str) -> DCPSchedule:
    """Every document at CP size ``c``: packed first-fit decreasing up to ``c`` x the longest
    document's tokens while ``price(pack, c).fits``, rounds by predicted seconds; with
    ``refuse`` a document that fits alone under no plan raises NoFitError."""
    n = len(pr.lengths)
    if refuse:
        bad = [i for i in range(n) if not price((i,), c).fits]
        if bad:
            raise NoFitError(f"{policy}: documents of {[pr.lengths[i] for i in bad]} tokens fit no plan at CP size {c}")
    packs = pack_ffd(pr, range(n), c, c * max(pr.lengths), fit=lambda d, k: price(d, k).fits)
    rounds = build_rounds(pr, [(pk, c) for pk in packs], pool, price)
    update = float(pr.planners[1].cm.update_seconds())
    return DCPSchedule(rounds, sum(max(a.seconds for a in r) for r in rounds) + update, update, policy)


def _planners(args, cfg, pool: int) -> dict:
    """``{c: optimal planner}`` over the pool under the budget (the Dynamic CP planner's)."""
    cm, note = _load_cost_model(args, cfg.cost_model)
    if cm is None:
        raise RuntimeError(note)
    kw = {} if cfg.margin_bytes is None else {"margin_bytes": cfg.margin_bytes}
    return cp_planners("optimal", cm, float(cfg.budget_bytes), pool, Links.from_config(*LINKS),
                       shape_from_args(args), **kw)


def _warm_up(sysm, docs, pool: int, p: int, layers: int) -> None:
    """One step of a short document at c = 1 and a padding pack over the whole pool: optimizer
    state, communication pools and the largest CP group's first use, before anything is timed."""
    short = dataclasses.replace(pdata.pack_documents([docs[0][:65]], multiple=p), plan=("tp_sp",) * layers)
    whole = dataclasses.replace(padding_pack(2 * pool * p), cp_block=(0, pool), plan=("tp_sp",) * layers)
    sysm.step([short, whole])
    sysm.static = static_bytes(sysm.model, sysm.optimizer)


def dcp_world(rank, world, cfg):
    """Run in every rank (world = pool x p): returns (on rank 0) the per-system, per-step records."""
    torch.set_num_threads(1)
    cpu_compat.apply()
    args = parse_args(cfg.argv, world_size=world)
    dims = dims_of(args)
    init_parallel(dims.tp, seed=args.seed)
    install()
    pool, node = dims.dp, rank // dims.tp
    dynamic_cp.enable(dynamic_cp.DynamicCPGroups(dims.tp))
    dataset = pdata.DocumentDataset(cfg.data_prefix, args.seq_length, seed=args.seed,
                                    long_docs=cfg.long_docs, vocab_size=args.vocab_size)
    docs = [dataset[g] for g in _documents(dataset, cfg)]
    planners = _planners(args, cfg, pool)
    specs = [DCPSystem.parse(n, pool) for n in cfg.systems]
    systems = []
    for spec in specs:
        sysm = System(spec.name, args, None)
        _warm_up(sysm, docs, pool, dims.tp, args.num_layers)
        fn = (lambda s: (lambda lengths: s.schedule(lengths, planners, pool, dims.tp).rounds))(spec)
        systems.append((spec, sysm, DynamicCPLoader(docs, cfg.global_batch, pool, node, dims.tp, fn)))
    records = {spec.name: [] for spec in specs}
    t_start = time.perf_counter()
    for k in range(cfg.steps):
        order = systems[k % len(systems):] + systems[:k % len(systems)]
        for spec, sysm, loader in order:
            records[spec.name].append(_record(spec, sysm, loader, k, node, cfg))
        if rank == 0 and cfg.verbose:
            line = "  ".join(f"{s.name}=" + ("refused" if records[s.name][-1]["seconds"] is None else
                                            f"{records[s.name][-1]['seconds']:.2f}s") for s, _, _ in systems)
            log.info(f"  step {k + 1:3d} | {line}")
    out = {"records": records, "static_bytes": {s.name: m.static for s, m, _ in systems},
           "seconds": time.perf_counter() - t_start, "notes": [],
           "systems": [dataclasses.asdict(dataclasses.replace(s, last=None)) for s in specs]}
    return out if rank == 0 else None


def _record(spec, sysm, loader, k: int, node: int, cfg) -> dict:
    """One step of ``spec``: its schedule (or the refusal), ``cfg.repeats`` timed steps (the
    median, max over ranks), the tracked peak, the predictions."""
    lengths = [len(d) - 1 for d in loader.documents(k)]
    base = dict(step=k, length=int(sum(lengths)), padded=None, documents=len(lengths), loss=None,
                predicted_seconds=None, predicted_peak_bytes=None, plan=None, rounds=None, sizes=None)
    t0 = time.perf_counter()
    try:
        rounds, docs = loader.schedule(k)
    except NoFitError as e:  # every rank alike: the step cannot run under this system
        return dict(base, seconds=None, peak_bytes=None, refused=str(e))
    plan_seconds = time.perf_counter() - t0
    mbs = [loader._micro_batch(mine(r, node), docs) for r in rounds]
    times = []
    for _ in range(cfg.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        loss = sysm.step(mbs)
        times.append(_max_over_ranks([time.perf_counter() - t0])[0])
    with PeakMemory() as m:
        sysm.step(mbs, optimizer_step=False)
    peak = _max_over_ranks([m.peak_bytes + sysm.static])[0]
    sched = spec.last
    blocks = [a for r in sched.rounds for a in r]
    plans = sorted({describe(a.plan) for a in blocks if a.documents and a.plan})
    return dict(base, seconds=statistics.median(times), times=times, peak_bytes=peak, loss=loss, refused=None,
                padded=sum(m.seq_length for m in mbs), plan="; ".join(plans), plan_seconds=plan_seconds,
                predicted_seconds=sched.seconds, predicted_peak_bytes=max(a.peak_bytes for a in blocks),
                rounds=[[(a.first, a.size, list(a.documents)) for a in r] for r in sched.rounds],
                sizes={str(c): n for c, n in sorted(sched.sizes().items())})


# ------------------------------------------------------------------------------ the command's side


def check_systems(names, pool: int) -> tuple:
    """``names`` checked (ValueError naming the bad one), as a tuple."""
    for n in names:
        DCPSystem.parse(n, pool)
    return tuple(names)


def aims(summary: dict) -> dict:
    """The issue's aims, measured: ParaDySe x Dynamic CP against megatron's Dynamic CP policy whose
    steps all fit, against ParaDySe at its best fixed C (the fastest whose steps all ran), against
    the oracle (time), and its steps over the budget."""
    me = summary.get("paradyse_dcp", {})
    tps = me.get("tokens_per_second")

    def best(names):
        ok = [n for n in names if summary.get(n, {}).get("tokens_per_second")]
        return max(ok, key=lambda n: summary[n]["tokens_per_second"]) if ok else None
    meg = best([n for n in MEGATRON if summary.get(n, {}).get("all_steps_fit")])
    fixed = best([n for n in summary if n.startswith("paradyse_cp")])
    static = best([n for n in summary if n not in MEGATRON and not n.startswith("paradyse")
                   and n != "oracle" and summary[n]["all_steps_fit"]])
    orc = summary.get("oracle", {}).get("total_seconds")
    h = dict(megatron_dcp_fitting=meg, best_fixed_c=fixed, fastest_fitting_static=static,
             vs_megatron_dcp=tps / summary[meg]["tokens_per_second"] if tps and meg else None,
             vs_best_fixed_c=tps / summary[fixed]["tokens_per_second"] if tps and fixed else None,
             vs_fastest_fitting_static=tps / summary[static]["tokens_per_second"] if tps and static else None,
             time_vs_oracle=me["total_seconds"] / orc if tps and orc else None,
             steps_over_budget=None if not me else me["steps_over_budget"] - me["steps_without_a_fitting_plan"],
             steps_refused=me.get("steps_without_a_fitting_plan"))
    return h


def aim_lines(h: dict) -> list:
    """One line per aim: the measured ratio, the aim, met or missed."""
    def r(x):
        return "n/a" if x is None else f"{x:.3f}"
    rows = [(f"ParaDySe x Dynamic CP vs megatron's Dynamic CP policy whose steps all fit ({h['megatron_dcp_fitting']})",
             h["vs_megatron_dcp"], ">= 1.25", lambda x: x >= 1.25),
            (f"ParaDySe x Dynamic CP vs ParaDySe x CP at its best fixed C ({h['best_fixed_c']})",
             h["vs_best_fixed_c"], ">= 1.3", lambda x: x >= 1.3),
            ("ParaDySe x Dynamic CP time / the oracle's", h["time_vs_oracle"], "<= 1.05", lambda x: x <= 1.05),
            ("ParaDySe x Dynamic CP steps over the budget", h["steps_over_budget"], "0", lambda x: x == 0),
            ("ParaDySe x Dynamic CP steps refused", h["steps_refused"], "0", lambda x: x == 0)]
    out = [f"  aim: {what}: {r(x) if not isinstance(x, int) else x} (aim {aim}: "
           f"{'n/a' if x is None else 'met' if ok(x) else 'MISSED'})" for what, x, aim, ok in rows]
    out.append(f"  beside: ParaDySe x Dynamic CP vs the fastest static strategy x fixed C whose steps all fit "
               f"({h['fastest_fitting_static']}): {r(h['vs_fastest_fitting_static'])}")
    return out


def table(summary: dict, records: dict, budget: float) -> str:
    """One row per system: tokens/s, steps over the budget, refused, time and peak predicted/measured."""
    lines = [f"{'system':<18}{'tok/s':>8}{'total s':>9}{'over':>6}{'refused':>9}{'time pred/meas s':>18}"
             f"{'max peak pred/meas MiB':>24}  CP sizes   (budget {budget / MiB:.1f} MiB)"]
    for name, s in summary.items():
        ran = [r for r in records[name] if r["seconds"] is not None]
        pred = sum(r.get("predicted_seconds") or 0 for r in ran)
        meas = sum(r["seconds"] for r in ran)
        pk = max((r.get("predicted_peak_bytes") or 0 for r in ran), default=0) / MiB
        sizes: dict = {}
        for r in ran:
            for c, n in (r.get("sizes") or {}).items():
                sizes[c] = sizes.get(c, 0) + n
        tps, refused = s["tokens_per_second"], s["steps_without_a_fitting_plan"]
        cells = ["-" if tps is None else f"{tps:.0f}", f"{meas:.1f}", str(s["steps_over_budget"] - refused),
                 str(refused), f"{pred:.1f}/{meas:.1f}" if pred else "-",
                 (f"{pk:.1f}/" if pk else "") + f"{s['max_peak_mib']:.1f}"]
        used = " ".join(f"c{c}x{n}" for c, n in sorted(sizes.items(), key=lambda kv: int(kv[0]))) or "-"
        lines.append(f"{name:<18}" + "".join(f"{x:>{w}}" for x, w in zip(cells, (8, 9, 6, 9, 18, 24))) + f"  {used}")
    return "\n".join(lines)


def main(a, argv, prefix, demo_argv) -> int:
    """``--dynamic-cp-pool N``: the run of the module's systems on N x p gloo ranks; bench.json,
    the table and the aims' lines."""
    import os
    import sys

    from ..errors import UserError
    from ..launch import run_ranks
    from ..paths import recorded, shown, shown_argv
    from . import report
    from .config import BenchConfig

    pool, p = a.dynamic_cp_pool, a.p
    if a.pp > 1 or a.cp > 1 or a.max_seq_len_search or a.memory_budget_mib is None:
        raise UserError("--dynamic-cp-pool runs without --pp, --cp and --max-seq-len-search, and needs "
                        "--memory-budget-mib")
    argv_ = demo_argv(p, a.seq_length, a.seed, ["--dynamic-context-parallel", "--global-batch-size",
                                                str(a.global_batch)])
    parse_args(argv_, world_size=pool * p)  # the layout, checked as the trainer's (one line if bad)
    budget = a.memory_budget_mib * MiB
    try:
        names = check_systems([s.strip() for s in a.systems.split(",") if s.strip()] if a.systems
                              else system_names(pool), pool)
        cfg = BenchConfig(argv=argv_, data_prefix=prefix, long_docs=a.long_docs, steps=a.steps, min_len=a.min_len,
                          budget_bytes=budget, systems=names, cost_model=a.cost_model, verbose=not a.quiet,
                          margin_bytes=None if a.margin_mib is None else a.margin_mib * MiB,
                          dcp_pool=pool, global_batch=a.global_batch, repeats=a.repeats)
    except ValueError as e:
        raise UserError(str(e)) from None
    print(f"> Dynamic CP benchmark: {len(names)} systems x {a.steps} steps of {a.global_batch} documents on "
          f"{pool * p} gloo ranks (a pool of {pool} nodes x p={p}), demo shape, data {shown(prefix)}, "
          f"budget {a.memory_budget_mib:.1f} MiB per rank, median of {a.repeats} timed step(s)", flush=True)
    t0 = time.perf_counter()
    out = run_ranks(dcp_world, pool * p, cfg, timeout=a.timeout)[0]
    wall = time.perf_counter() - t0
    records = out["records"]
    records["oracle"] = [dict(r, predicted_seconds=None, predicted_peak_bytes=None)
                         for r in report.oracle(records, budget, names)]
    summary = report.summarize(records, budget)
    h = aims(summary)
    result = dict(title=f"Dynamic CP: demo shape (L4 h128 a8 ffn512), a pool of {pool} nodes x p={p} CPU gloo "
                        f"ranks, {a.steps} steps of {a.global_batch} documents, stdlib corpus",
                  command="python -m megatron_paradyse.bench " + shown_argv(argv if argv is not None else sys.argv[1:]),
                  wall_seconds=wall, measured_seconds=out["seconds"], budget_bytes=budget, pool=pool, p=p,
                  steps=a.steps, global_batch=a.global_batch, repeats=a.repeats, seq_length=a.seq_length,
                  data=recorded(prefix), long_docs=a.long_docs, static_bytes=out["static_bytes"],
                  systems=out["systems"], summary=summary, aims=h, records=records,
                  notes=["oracle: per step the fastest measured system whose measured peak fits the budget",
                         "CPU peak = measured live tensor bytes of the step (PeakMemory) + parameters, "
                         "gradient buffers and optimizer state, max over ranks"])
    path = report.write_json(result, os.path.join(a.out, "bench.json"))
    print(table(summary, records, budget))
    print("\n".join(aim_lines(h)))
    print(f"> wrote {shown(path)} ({wall:.0f} s)")
    return 0
