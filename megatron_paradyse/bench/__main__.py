"""``python -m megatron_paradyse.bench``: every system on the same batches, one budget, one world.

    python -m megatron_paradyse.bench --p 4 --steps 24 --memory-budget-mib 64 --out runs/bench
    python -m megatron_paradyse.bench --max-seq-len-search ...
    python -m megatron_paradyse.bench --simulate            # analytic H100 x 8, 7B-like model
    python -m megatron_paradyse.bench --pp 2 --p 2 --steps 6 --memory-budget-mib 30   # pipeline stages
    python -m megatron_paradyse.bench --dynamic-cp-pool 4 --p 2 --steps 3 --global-batch 8 \
        --seq-length 2048 --memory-budget-mib 12.5                                    # Dynamic CP

See docs/benchmark.md for what is measured and how to read it.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from .. import data as pdata
from .. import logs
from ..errors import ArgumentParser, UserError, command
from ..launch import run_ranks
from ..paths import recorded, shown, shown_argv, writable_dir
from ..training.arguments import parse_args
from ..units import MiB
from . import report
from .config import ALL_SYSTEMS, CP_SYSTEMS, PIPELINE_SYSTEMS, BenchConfig
from .simulate import main as sim_main
from .systems import load_cost_model
from .world import bench_world


def demo_argv(p: int, seq_length: int, seed: int, extra=()) -> list:
    """pretrain_gpt_paradyse.py flags of the demo's shape (docs: RULES' shared decisions)."""
    return ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "8",
            "--ffn-hidden-size", "512", "--seq-length", str(seq_length), "--micro-batch-size", "1",
            "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
            "--vocab-size", "258", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--tensor-model-parallel-size", str(p), "--sequence-parallel", "--paradyse",
            "--train-iters", "1000", "--lr", "1e-3", "--seed", str(seed), "--mock-data", *extra]


def build_parser():
    ap = ArgumentParser(prog="python -m megatron_paradyse.bench", allow_abbrev=False,
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, default=4, help="gloo ranks = switching group size (TP)")
    ap.add_argument("--pp", type=int, default=1,
                    help="pipeline stages (world = pp x p ranks; megatron's 1F1B schedule)")
    ap.add_argument("--pp-microbatches", type=int, default=4,
                    help="with --pp > 1: documents per step, one micro-batch each, in flight together")
    ap.add_argument("--vpp", type=int, default=1,
                    help="with --pp > 1: model chunks per stage (megatron's interleaved schedule, "
                         "--virtual-pipeline-model-parallel-size; --pp-microbatches a multiple of --pp)")
    ap.add_argument("--cp", type=int, default=1,
                    help="context-parallel ranks (world = cp x p; each CP rank holds two chunks of a "
                         "sequence, every system runs its strategy inside p ranks and a K/V ring across CP)")
    ap.add_argument("--steps", type=int, default=24,
                    help="documents (one step each; the +pack systems pack them into fewer steps); "
                         "with --pp > 1 steps of --pp-microbatches documents")
    ap.add_argument("--pack-tokens", type=int, default=None,
                    help="token cap of the +pack systems' packs (default --seq-length)")
    ap.add_argument("--seq-length", type=int, default=4096, help="longest training sequence of the data")
    ap.add_argument("--min-len", type=int, default=1, help="leave out documents shorter than this")
    ap.add_argument("--data-path", default=None, help="IndexedDataset prefix (default: the stdlib corpus)")
    ap.add_argument("--long-docs", default="skip", choices=("split", "truncate", "skip"),
                    help="documents longer than --seq-length (default skip: natural lengths only)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--memory-budget-mib", type=float, default=None,
                    help="per-rank budget (MiB); default: the cost model's tp_sp peak at --budget-at-length")
    ap.add_argument("--budget-at-length", type=int, default=None,
                    help="default budget = predicted tp_sp peak at this length (default seq-length / 2)")
    ap.add_argument("--margin-mib", type=float, default=None, help="the planners' safety margin (MiB)")
    ap.add_argument("--cost-model", default=None, help="a fitted cost model file (default: shipped/analytic)")
    ap.add_argument("--systems", default=None,
                    help="comma list of " + ", ".join(ALL_SYSTEMS) + " (default: all; with --pp > 1: "
                         + ",".join(PIPELINE_SYSTEMS) + ")")
    ap.add_argument("--max-seq-len-search", action="store_true",
                    help="also find each system's longest sequence within the budget (measured)")
    ap.add_argument("--search-cap", type=int, default=16384)
    ap.add_argument("--search-probes", type=int, default=5)
    ap.add_argument("--search-resolution", type=int, default=256)
    ap.add_argument("--out", default="runs/bench", help="folder for bench.json and the PNGs")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before the world is killed")
    ap.add_argument("--simulate", action="store_true",
                    help="no training: the analytic H100 x 8 simulation of a 7B-like model")
    ap.add_argument("--memory-pass", choices=("separate", "same"), default="separate",
                    help="separate (default): time the step untracked, measure the peak on a second "
                         "tracked forward+backward; same: one tracked step (half the cost, the "
                         "tracker's overhead in the times)")
    ap.add_argument("--dynamic-cp-pool", type=int, default=0,
                    help="Dynamic CP (docs/benchmark.md): a pool of N nodes of --p ranks (world = N x p), each "
                         "step --global-batch documents scheduled over the pool by each system "
                         "(bench/dynamic_cp.py); needs --memory-budget-mib")
    ap.add_argument("--global-batch", type=int, default=8, help="with --dynamic-cp-pool: documents per step")
    ap.add_argument("--repeats", type=int, default=1,
                    help="with --dynamic-cp-pool: timed steps per step and system (their median)")
    ap.add_argument("--quiet", action="store_true")
    return ap


def pipeline_argv(pp: int, microbatches: int, cp: int = 1, vpp: int = 1) -> list:
    """The flags of ``pp`` pipeline stages (none for 1), a step of ``microbatches`` micro-batches,
    ``vpp`` model chunks per stage (the interleaved schedule, above 1); of ``cp`` context-parallel ranks."""
    out = ["--context-parallel-size", str(cp)] if cp > 1 else []
    if pp > 1:
        out += ["--pipeline-model-parallel-size", str(pp), "--global-batch-size", str(microbatches)]
    if vpp > 1:
        out += ["--virtual-pipeline-model-parallel-size", str(vpp)]
    return out


def default_systems(a) -> tuple:
    """The systems run without ``--systems``: with CP those that can run CP, with stages those
    that run with stages, with both those that run with both; else all."""
    allowed = (CP_SYSTEMS if a.cp > 1 else ALL_SYSTEMS, PIPELINE_SYSTEMS if a.pp > 1 else ALL_SYSTEMS)
    return tuple(s for s in ALL_SYSTEMS if s in allowed[0] and s in allowed[1])


def layout_name(a) -> str:
    """``PP=2 x V=2 x CP=2 x p=2``: the world's layout, the sizes above 1 (and p)."""
    vpp = getattr(a, "vpp", 1)
    return " x ".join([f"PP={a.pp}"] * (a.pp > 1) + [f"V={vpp}"] * (vpp > 1) + [f"CP={a.cp}"] * (a.cp > 1)
                      + [f"p={a.p}"])


def resolve_budget(a, args_argv, p):
    """``(budget bytes, why)``: ``--memory-budget-mib``, else the cost model's ``tp_sp`` peak
    at ``--budget-at-length`` (with stages: the highest stage peak of ``--pp-microbatches``
    such micro-batches in flight, evaluated as the static systems' predictions are)."""
    if a.memory_budget_mib is not None:
        return a.memory_budget_mib * MiB, "given"
    args = parse_args(args_argv, world_size=p)
    cm, note = load_cost_model(args, a.cost_model)
    if cm is None:
        raise UserError(f"give --memory-budget-mib ({note})")
    at = a.budget_at_length or a.seq_length // 2
    if a.pp > 1:
        from .systems import EVAL_BUDGET, PipelinePlanner

        ev = PipelinePlanner("optimal", cm, EVAL_BUDGET, a.pp, margin_bytes=0.0, reorder=False,
                             strategies=("tp_sp",), recompute="off", num_chunks=a.vpp)
        peak = max(ev.plan_step([(at, 1)] * a.pp_microbatches).stage_peaks)
        return float(peak), f"the cost model's tp_sp stage peak, {a.pp_microbatches} micro-batches of s={at}"
    peak = cm.step(("tp_sp",) * args.num_layers, at, 1).peak_bytes
    return float(peak), f"the cost model's tp_sp peak at s={at}"


@command("python -m megatron_paradyse.bench")
def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    logs.setup(logging.WARNING if a.quiet else logging.INFO)
    writable_dir(a.out, "--out")
    if a.simulate:
        return sim_main(a)
    prefix = a.data_path or pdata.stdlib_corpus()
    if a.dynamic_cp_pool:
        from .dynamic_cp import main as dcp_main

        return dcp_main(a, argv, prefix, demo_argv)
    if a.pp < 1 or a.cp < 1 or a.vpp < 1:
        raise UserError(f"--pp, --cp and --vpp must be >= 1, got {a.pp}, {a.cp} and {a.vpp}")
    if a.vpp > 1 and a.pp < 2:
        raise UserError(f"--vpp {a.vpp} needs --pp > 1 (the interleaved schedule's model chunks are pipeline stages)")
    world = a.pp * a.cp * a.p
    argv_ = demo_argv(a.p, a.seq_length, a.seed, pipeline_argv(a.pp, a.pp_microbatches, a.cp, a.vpp))
    parse_args(argv_, world_size=world)  # the ranks' layout, built and checked as the trainer's (one line if bad)
    budget, why = resolve_budget(a, argv_, world)
    listed = a.systems or ",".join(default_systems(a))
    systems = [s.strip() for s in listed.split(",") if s.strip()]
    try:
        cfg = BenchConfig(argv=argv_, data_prefix=prefix, long_docs=a.long_docs, steps=a.steps, min_len=a.min_len,
                          budget_bytes=budget, systems=systems, cost_model=a.cost_model,
                          margin_bytes=None if a.margin_mib is None else a.margin_mib * MiB,
                          search=a.max_seq_len_search, search_cap=a.search_cap, search_probes=a.search_probes,
                          search_resolution=a.search_resolution, verbose=not a.quiet, memory_pass=a.memory_pass,
                          pack_tokens=a.pack_tokens, pp=a.pp, pp_microbatches=a.pp_microbatches, cp=a.cp,
                          vpp=a.vpp)
    except ValueError as e:
        raise UserError(str(e)) from None
    layout = f"{a.p} gloo ranks" if world == a.p else f"{world} gloo ranks ({layout_name(a)})"
    unit = "steps" if a.pp == 1 else f"steps of {a.pp_microbatches} micro-batches"
    print(f"> benchmark: {len(systems)} systems x {a.steps} {unit} on {layout}, demo shape, "
          f"data {shown(prefix)}, budget {budget / MiB:.1f} MiB per rank ({why})", flush=True)
    t0 = time.perf_counter()
    out = run_ranks(bench_world, world, cfg, timeout=a.timeout)[0]
    wall = time.perf_counter() - t0
    result = _result(a, argv, prefix, budget, why, systems, out, wall)
    path = report.write_json(result, os.path.join(a.out, "bench.json"))
    pngs = report.plot(result, a.out)
    if a.pp == 1:
        print(report.table(result["summary"], budget))
        print(report.kinds_table(result["summary"]))
    else:
        print(report.pipeline_table(result["summary"], result["stage_summary"], budget))
    for k, v in result["headline"].items():
        print(f"  {k}: {v if not isinstance(v, float) else round(v, 3)}")
    for n in out["notes"]:
        print(f"  note: {n}")
    print(f"> wrote {path} {' '.join(pngs)} ({wall:.0f} s)")
    return 0


def _result(a, argv, prefix, budget, why, systems, out, wall) -> dict:
    """bench.json's content: the records with the oracle, the summaries, the headline."""
    records = out["records"]
    candidates = [s for s in systems if not s.startswith("stock") and not s.endswith("+pack")]
    if a.pp == 1:
        orc = report.oracle(records, budget, candidates)
        if orc:
            records["oracle"] = [dict(r, predicted_seconds=None, predicted_peak_bytes=None) for r in orc]
    else:
        orc = report.pipeline_oracle(records, budget, candidates)
        if orc:
            records["oracle"] = orc
    summary = report.summarize(records, budget)
    layout = layout_name(a)
    unit = "steps" if a.pp == 1 else f"steps of {a.pp_microbatches} micro-batches"
    result = dict(
        title=f"demo shape (L4 h128 a8 ffn512), {layout} CPU gloo ranks, {a.steps} {unit}, stdlib corpus"
        if a.data_path is None else f"{layout}, {a.steps} {unit}, {shown(prefix)}",
        command="python -m megatron_paradyse.bench " + shown_argv(argv if argv is not None else sys.argv[1:]),
        wall_seconds=wall, measured_seconds=out["seconds"], budget_bytes=budget, budget_source=why,
        memory_pass=a.memory_pass, p=a.p, cp=a.cp, steps=a.steps, seq_length=a.seq_length, data=recorded(prefix), long_docs=a.long_docs,
        notes=out["notes"] + ["stock = megatron-core's own TP+SP layer: on CPU its attention is the "
                              "unfused DotProductAttention (s x s scores); tp_sp is the same layer "
                              "with the plugin's memory-linear attention kernel",
                              "CPU peak = measured live tensor bytes of the step (PeakMemory) + "
                              "parameters, gradient buffers and optimizer state"],
        static_bytes=out["static_bytes"], summary=summary, records=records,
        search=out.get("search"))
    if a.pp == 1:
        result["headline"] = report.headline(summary, out.get("search"))
        return result
    stages = report.stage_summary(records, budget, a.pp)
    result.update(pp=a.pp, vpp=a.vpp, pp_microbatches=a.pp_microbatches, world=a.pp * a.p, stage_summary=stages,
                  stage_static_bytes=out["stage_static_bytes"], headline=report.pipeline_headline(summary, stages))
    result["notes"] += ["pipeline stages: a step's peak is each stage's peak, max over its ranks, with the "
                        "communication pool held at the step's start; a step is over the budget when any stage is",
                        "predicted stage peaks: the planners' StepPlan.stage_peaks; a static system's fixed plan "
                        "evaluated by a PipelinePlanner with that plan as its only candidate; none for stock"]
    return result


if __name__ == "__main__":
    sys.exit(main())
