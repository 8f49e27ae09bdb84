"""Measured step time and peak of each planner's choice beside every uniform strategy, per length.

    python -m benchmarks.planner_table --p 4 --lengths 1024,2048,4096,8192 [--budget-at 2048]

One world of p gloo ranks (the demo's shape, fp32, TP = p), one model; for each length, the
plans measured are every uniform strategy and the heuristic's and the optimal planner's choice
under the budget (default: the cost model's predicted tp_sp peak at ``--budget-at``, so the long
end needs lean plans). Each plan: one warm-up step, ``--reps`` timed training steps (the
fastest kept; max over ranks), then its peak on a tracked forward+backward (max over ranks)
plus the static bytes (megatron_paradyse.bench.world._measure). Prints a markdown table:
measured and predicted time and peak, whether it fits (predicted, measured), and per length
whether each planner's choice is within the budget and within 5% of the fastest measured plan
that fits. CPU timings of p ranks sharing 2 cores measure the CPU, not the strategies.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from megatron_paradyse.units import MiB


def _rank(rank, world, cfg):
    import torch
    import torch.distributed as dist

    from megatron_paradyse.bench.__main__ import demo_argv
    from megatron_paradyse.bench.world import System
    from megatron_paradyse.costmodel import build_cost_model
    from megatron_paradyse.training.model_args import shape_from_args
    from megatron_paradyse.planner import build_planner
    from megatron_paradyse.training.arguments import parse_args

    import megatron_paradyse as mp
    from megatron.core import parallel_state, tensor_parallel

    from megatron_paradyse import cpu_compat

    p = world
    args = parse_args(demo_argv(p, max(cfg["lengths"]), 1234), world_size=p)
    cpu_compat.apply()
    mp.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=p)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    note = ""
    shape = shape_from_args(args)
    try:
        cm = build_cost_model(shape)
    except Exception as e:  # noqa: BLE001 - a broken shipped model: say so, use the analytic one
        from megatron_paradyse.costmodel.analytic import AnalyticCostModel

        cm, note = AnalyticCostModel(shape), f"shipped model failed to load ({e}); analytic model used"
    budget = cfg["budget_bytes"] or cm.step({"tp_sp": shape.num_layers}, cfg["budget_at"], 1).peak_bytes
    planners = {k: build_planner(k, cm, budget) for k in ("heuristic", "optimal")}
    sysm = System("table", args, None)
    L = shape.num_layers
    rows = []
    for s in cfg["lengths"]:
        doc = (torch.arange(s + 1) * 7 % 256).numpy()
        plans = {f"uniform {n}": (n,) * L for n in args.paradyse_planner_strategies}
        chosen = {}
        for k, pl in planners.items():
            c = pl.choose(s, 1)
            chosen[k] = c
            plans.setdefault(f"{k} choice", c.layers)
        measured, failed = _measure_plans(sysm, plans, doc, p, cfg["reps"], s)
        note += failed
        seen = set()
        for label, plan in plans.items():
            if plan in seen:
                continue
            seen.add(plan)
            pred = cm.step(tuple(plan), s, 1)  # the ordered peak of the layers as run
            rows.append(dict(s=s, label=label, plan=mp.describe(plan),
                             seconds=measured[plan][0], peak=measured[plan][1], pred_seconds=pred.seconds + cm.update_seconds(),
                             pred_peak=pred.peak_bytes,
                             chosen_by=[k for k, c in chosen.items() if c.layers == plan and c.fits],
                             planner_fits={k: chosen[k].fits for k in chosen}))
        if rank == 0:
            print(f"  s={s} done ({time.strftime('%H:%M:%S')})", flush=True)
    dist.barrier()
    return dict(rows=rows, budget=budget, margin=planners["optimal"].margin, cost_model=type(cm).__name__,
                note=note) if rank == 0 else None


def _measure_plans(sysm, plans: dict, doc, p: int, reps: int, s: int) -> tuple:
    """Each distinct plan of ``plans`` run on ``doc`` (a warm-up, then ``reps`` timed runs; the
    fastest time and the largest peak over the ranks): ``({plan: (seconds, peak)}, note)``,
    a plan that fails measured as NaN and named in the note."""
    from megatron_paradyse import data as pdata
    from megatron_paradyse.bench.world import _max_over_ranks, _measure
    from megatron_paradyse.memory import static_bytes

    measured, note = {}, ""
    for label, plan in plans.items():
        if plan in measured:
            continue
        mb = pdata.pad_to_multiple([doc], p)
        mb.plan = plan
        if not sysm.static:
            sysm.step(mb)
            sysm.static = static_bytes(sysm.model, sysm.optimizer)
        best = None
        try:
            _measure(sysm, mb)  # warm-up
            for _ in range(reps):
                sec, peak, _ = _measure(sysm, mb)
                sec, peak = _max_over_ranks([sec, peak])
                best = (sec, peak) if best is None or sec < best[0] else (best[0], max(best[1], peak))
        except Exception as e:  # noqa: BLE001
            best = (float("nan"), float("nan"))
            note += f" {label} at {s} failed: {e};"
        measured[plan] = best
    return measured, note


def render(res, p) -> str:
    from megatron_paradyse.parallel.plans import describe  # noqa: F401

    b = res["budget"]
    out = [f"p = {p}, budget {b / MiB:.1f} MiB per rank (planners plan against budget - margin = "
           f"{(b - res['margin']) / MiB:.1f} MiB), cost model {res['cost_model']}"
           + (f"; {res['note']}" if res["note"] else ""), "",
           "| s | plan | measured s | measured peak MiB | fits (measured) | predicted s | predicted peak MiB | chosen by |",
           "|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for s in sorted({r["s"] for r in res["rows"]}):
        rows = [r for r in res["rows"] if r["s"] == s]
        for r in sorted(rows, key=lambda r: r["label"]):
            out.append(f"| {s} | {r['plan']} | {r['seconds']:.3f} | {r['peak'] / MiB:.1f} | "
                       f"{'yes' if r['peak'] <= b else 'no'} | {r['pred_seconds']:.3f} | {r['pred_peak'] / MiB:.1f} | "
                       f"{', '.join(r['chosen_by'])} |")
        lim = b - res["margin"]
        fastest = min((r["seconds"] for r in rows if r["peak"] <= b), default=float("nan"))
        fastest_lim = min((r["seconds"] for r in rows if r["peak"] <= lim), default=float("nan"))
        for k in ("heuristic", "optimal"):
            mine = [r for r in rows if k in r["chosen_by"]]
            if not mine:
                verdicts.append(f"s={s} {k}: nothing fits (predicted)")
                continue
            r = mine[0]
            verdicts.append(f"s={s} {k}: {r['plan']} measured {r['seconds']:.3f} s, peak {r['peak'] / MiB:.1f} MiB "
                            f"({'within' if r['peak'] <= b else 'OVER'} budget); vs the fastest measured plan "
                            f"within budget - margin {fastest_lim:.3f} s: {100 * (r['seconds'] / fastest_lim - 1):+.1f}%, "
                            f"within the budget {fastest:.3f} s: {100 * (r['seconds'] / fastest - 1):+.1f}%")
    return "\n".join(out + [""] + [f"- {v}" for v in verdicts])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--budget-at", type=int, default=2048)
    ap.add_argument("--budget-mib", type=float, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from megatron_paradyse.testing.spawn import run_world

    cfg = dict(lengths=[int(x) for x in a.lengths.split(",")], budget_at=a.budget_at, reps=a.reps,
               budget_bytes=None if a.budget_mib is None else a.budget_mib * MiB)
    t0 = time.time()
    res = run_world(_rank, a.p, cfg, timeout=a.timeout)[0]
    print(render(res, a.p))
    print(f"\n({time.time() - t0:.0f} s)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
