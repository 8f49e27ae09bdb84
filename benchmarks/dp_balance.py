"""Measured balance of the data-parallel replicas' step times: packed (balanced, greedy) and
one document per micro-batch (Megatron's order, the length-aware sampler).

    python -m benchmarks.dp_balance --dp 2 --p 2 --steps 12 --docs-per-step 16

One world of dp x p gloo ranks trains the demo's shape on the stdlib corpus with the planner
(the shipped cost model of the shape, ``--budget`` GiB) under each data mode in turn. A
replica's time in a step is from the moment its micro-batches are planned and checked (the
plan check is one all-reduce over the world, so every rank starts together) to the moment it
enters ``finalize_model_grads`` (the gradient all-reduce, where the faster replicas wait),
max over its TP ranks. Per step: each replica's deviation from the replicas' mean; printed:
the mean over steps of the largest deviation, per mode, and the steps' mean time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

MODES = {
    "pack balanced": ["--paradyse-pack", "balanced"],
    "pack greedy": ["--paradyse-pack", "greedy"],
    "length sampler": ["--paradyse-sampler", "length"],
    "megatron order": [],
}


def _argv(cfg, extra):
    from megatron_paradyse import data as pdata
    from megatron_paradyse.bench.__main__ import demo_argv

    argv = demo_argv(cfg["p"], 4096, 1234, ["--paradyse-memory-budget", str(cfg["budget"])])
    argv.remove("--mock-data")
    argv += ["--data-path", pdata.stdlib_corpus(), "--paradyse-long-docs", "skip",
             "--global-batch-size", str(cfg["docs_per_step"]), "--log-interval", "1000",
             "--train-iters", str(cfg["steps"] + cfg["warmup"]), "--paradyse-refine", "off"] + extra
    return argv


def _timed(trainer, marks):
    """Record when each step's micro-batches are ready and when finalize_model_grads starts."""
    it, cfg = trainer.data_iterator, trainer.config
    prefetch, finalize = it.prefetch, cfg.finalize_model_grads_func

    def timed_prefetch():
        out = prefetch()
        marks.setdefault("start", time.perf_counter())
        return out

    def timed_finalize(*a, **k):
        marks["steps"].append(time.perf_counter() - marks.pop("start"))
        return finalize(*a, **k)
    it.prefetch, cfg.finalize_model_grads_func = timed_prefetch, timed_finalize


def _rank(rank, world, cfg):
    import torch
    import torch.distributed as dist

    from megatron_paradyse.training import arguments, trainer as training

    out = {}
    for mode, extra in MODES.items():
        args = arguments.parse_args(_argv(cfg, extra), world_size=world)
        trainer = training.Trainer(args)
        marks = {"steps": []}
        _timed(trainer, marks)
        trainer.train()
        t = torch.tensor(marks["steps"][cfg["warmup"]:], dtype=torch.float64)
        got = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(got, t)
        p = cfg["p"]  # ranks r*p .. r*p+p-1 are replica r (megatron's rank order: TP fastest)
        per = [torch.stack(got[r * p:(r + 1) * p]).max(0).values.tolist() for r in range(world // p)]
        out[mode] = per
    return out if rank == 0 else None


def summarize(per_replica: list) -> dict:
    steps = list(zip(*per_replica))
    devs = [max(abs(x - statistics.mean(s)) for x in s) / statistics.mean(s) for s in steps]
    return {"mean_max_deviation": statistics.mean(devs), "worst_step_deviation": max(devs),
            "mean_step_seconds": statistics.mean(max(s) for s in steps)}


def main(argv=None) -> int:
    from megatron_paradyse.launch import run_ranks

    ap = argparse.ArgumentParser(prog="python -m benchmarks.dp_balance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--p", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--docs-per-step", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.05, help="memory budget, GiB per rank")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cfg = dict(p=a.p, steps=a.steps, warmup=a.warmup, docs_per_step=a.docs_per_step, budget=a.budget)
    t0 = time.perf_counter()
    got = run_ranks(_rank, a.dp * a.p, cfg, timeout=3600)[0]
    print(f"dp={a.dp} x p={a.p}, {a.steps} steps (+{a.warmup} warm-up) of {a.docs_per_step} documents, "
          f"budget {a.budget} GiB ({time.perf_counter() - t0:.0f} s)")
    print("| data | replicas' largest deviation from their mean (mean over steps) | worst step | mean step s |")
    print("|---|---|---|---|")
    res = {}
    for mode, per in got.items():
        s = res[mode] = summarize(per)
        print(f"| {mode} | {100 * s['mean_max_deviation']:.1f}% | {100 * s['worst_step_deviation']:.1f}% "
              f"| {s['mean_step_seconds']:.2f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"config": cfg, "per_replica_seconds": got, "summary": res}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
