"""A run's report (``--paradyse-run-report DIR``): per-step peak memory and predictions, a summary, a plot.

With the flag, the trainer measures each step's peak memory (on CPU the live-tensor tracker
of :mod:`megatron_paradyse.memory`, on GPU ``max_memory_allocated``; max over ranks)
plus the static bytes (parameters, gradient buffers, optimizer state) and the communication
pool held at the step's start (stock Megatron's persistent ``mpu`` buffer; ParaDySe releases
its pool between micro-batches, so its steps count the pool they allocate), takes the
planner's predictions for the step (if there is a planner; those it made when it planned the
micro-batches, the ones its refinement compares), and appends to each iteration line
``pred/meas`` time and peak against the budget. At the end it prints a summary (steps,
tokens, plans used and how often, time, peak against budget) and writes ``DIR/run_report.json``
and ``DIR/run_report.png`` (length and plan of each step, measured against predicted).
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from ..parallel.buffers import pool_sizes
from ..parallel.plan_check import collective_device
from ..parallel.plans import describe
from ..units import MiB


def pool_bytes() -> int:
    """Bytes megatron's global memory buffer holds now (the communication pool): counted in a
    step's peak, since the step's tracker sees only what the step allocates. Zero between
    ParaDySe steps (the pool is released); stock Megatron keeps its ``mpu`` gather buffer."""
    return sum(pool_sizes().values())


class RunReport:
    def __init__(self, budget_bytes=None, calibration: dict | None = None, planner=None):
        self.budget = budget_bytes
        self.calibration = calibration  # the cost model's calibration to this host, if any
        self.planner = planner  # with a planner: the statics it beat, predicted (summary)
        self.steps: list = []

    def record(self, stats, peak_bytes: float | None, static: float, micro, predicted=None,
               tracked: bool | None = None, stage_peaks=None, stage_predicted=None) -> str:
        """Store one step; returns the text appended to the iteration line. ``predicted``: the
        planner's ``(seconds, peak bytes)`` of the step, made when it planned the step's
        micro-batches (None: no planner). ``peak_bytes`` None: not measured this step
        (``--paradyse-memory-every``); ``tracked``: whether the step ran under the memory
        tracker, where some steps did not (None: every step did). With pipeline stages:
        ``stage_peaks`` each stage's measured peak (max over its ranks, static included) and
        ``stage_predicted`` the step planner's, per stage."""
        pred_s, pred_m = predicted if predicted is not None else (None, None)
        peak = None if peak_bytes is None else peak_bytes + static
        self.steps.append(dict(
            shapes=[_shape(mb) for mb in micro],
            iteration=stats.iteration, seconds=stats.seconds, tokens=stats.tokens,
            lengths=[int(x) for mb in micro for x in mb.lengths], padded=list(stats.seq_lengths),
            plans=[None if p is None else list(p) for p in stats.plans], loss=stats.loss,
            peak_bytes=peak, predicted_seconds=pred_s, predicted_peak_bytes=pred_m, tracked=tracked,
            stage_peak_bytes=stage_peaks, stage_predicted_peak_bytes=stage_predicted))
        out = []
        if pred_s is not None:
            out.append(f"time pred/meas: {pred_s:.2f}/{stats.seconds:.2f} s" + (" (tracker)" if tracked else ""))
        if peak is not None:
            out.append(f"peak {'pred/meas' if pred_m is not None else 'meas'}: "
                       + (f"{pred_m / MiB:.1f}/" if pred_m is not None else "") + f"{peak / MiB:.1f} MiB"
                       + (f" (budget {self.budget / MiB:.1f})" if self.budget else ""))
        if stage_peaks is not None:
            pred = stage_predicted or [None] * len(stage_peaks)
            out.append("stage peaks " + ("pred/meas" if stage_predicted else "meas") + ": " + ", ".join(
                (f"{p / MiB:.1f}/" if p is not None else "") + f"{m / MiB:.1f}" for p, m in zip(pred, stage_peaks))
                + " MiB")
        return " | ".join(out)

    # ------------------------------------------------------------------ end of run
    def summary(self) -> str:
        st = self.steps
        if not st:
            return "> run report: no steps"
        secs = sum(s["seconds"] for s in st)
        toks = sum(s["tokens"] for s in st)
        plans: dict = {}
        for s in st:
            for p in s["plans"]:
                k = "stock" if p is None else describe(tuple(p))
                plans[k] = plans.get(k, 0) + 1
        peaks = [s for s in st if s["peak_bytes"] is not None]
        peak = max((s["peak_bytes"] for s in peaks), default=0.0)
        over = [s for s in peaks if self.budget and s["peak_bytes"] > self.budget]
        lens = [x for s in st for x in s["lengths"]]
        lines = [f"> run summary: {len(st)} steps, {toks:,} tokens in {secs:.1f} s ({toks / max(secs, 1e-9):.0f} tokens/s); "
                 f"lengths {min(lens)} .. {max(lens)}",
                 f"  peak memory {peak / MiB:.1f} MiB per rank"
                 + (f" (measured on {len(peaks)} of {len(st)} steps)" if len(peaks) < len(st) else "")
                 + (f" against a budget of {self.budget / MiB:.1f} MiB: {len(over)} step(s) over" if self.budget else "")]
        lines += self._errors() + self._stage_lines()
        if self.calibration:
            lines.append(self._calibration_line())
        lines.append("  plans used (micro-batches): " + ", ".join(
            f"{k} x{v}" for k, v in sorted(plans.items(), key=lambda kv: -kv[1])))
        return "\n".join(lines + self._static_lines())

    def _calibration_line(self) -> str:
        """The cost model's calibration to this host: its factors' range, lengths, and its own
        wall time (max over ranks; before the run's first step, not in the steps' time)."""
        cal = self.calibration
        pts = [x[3] for v in cal["strategies"].values() for x in v]
        took = f" in {cal['seconds']:.1f} s" if cal.get("seconds") is not None else ""
        return (f"  cost model calibrated to this host{took}: times x{min(pts):.2f} .. x{max(pts):.2f} "
                f"(at s = {'/'.join(map(str, cal['lengths']))}; run_report.json)")

    def _static_lines(self) -> list:
        """With a planner: every uniform plan, plain and recomputed, on the run's own micro-batches,
        predicted by the same cost model, against the planner's predicted time: the fastest of each
        kind whose steps all fit the budget, and the fastest fitting or not with its misses."""
        pl = self.planner
        if pl is None or not all(s["predicted_seconds"] for s in self.steps):
            return []
        mine = sum(s["predicted_seconds"] for s in self.steps)
        kinds = static_predictions(pl, [s["shapes"] for s in self.steps])
        out = ["  the same micro-batches under each uniform plan, predicted by the same cost model "
               f"(ParaDySe predicted {mine:.1f} s):"]
        for kind, (fit, top) in kinds.items():
            fit_t = f"`{fit[0]}` {fit[1]:.1f} s ({fit[1] / mine:.2f}x ParaDySe's time)" if fit else "none fits every step"
            miss = f", {top[2]} of {len(self.steps)} steps over, worst +{top[3] / MiB:.1f} MiB" if top[2] else ""
            out.append(f"    {kind:6s} fastest fitting: {fit_t}; fastest: `{top[0]}` {top[1]:.1f} s{miss}")
        return out

    def _errors(self) -> list:
        """The summary's prediction errors: time over the steps without the tracker where there
        are any (the tracker's own cost is not in the prediction), peak over the measured ones."""
        st = self.steps
        untracked = [s for s in st if s.get("tracked") is False]
        pe = [abs(s["predicted_seconds"] - s["seconds"]) / s["seconds"] for s in (untracked or st)
              if s["predicted_seconds"]]
        me = [abs(s["predicted_peak_bytes"] - s["peak_bytes"]) / s["peak_bytes"] for s in st
              if s["predicted_peak_bytes"] and s["peak_bytes"]]
        if not pe:
            return []
        how = f" (the {len(untracked)} steps without the memory tracker)" if untracked else ""
        return [f"  prediction error (mean |pred - meas| / meas): time {100 * sum(pe) / len(pe):.0f}%{how}, "
                + (f"peak {100 * sum(me) / len(me):.0f}%" if me else "peak not measured")]

    def _stage_lines(self) -> list:
        """With pipeline stages: per stage, the worst measured peak, the steps over the budget and
        the prediction error of the peak."""
        st = [s for s in self.steps if s.get("stage_peak_bytes")]
        if not st:
            return []
        out = []
        for r in range(len(st[0]["stage_peak_bytes"])):
            meas = [s["stage_peak_bytes"][r] for s in st]
            over = sum(1 for m in meas if self.budget and m > self.budget)
            errs = [abs(s["stage_predicted_peak_bytes"][r] - s["stage_peak_bytes"][r]) / s["stage_peak_bytes"][r]
                    for s in st if s.get("stage_predicted_peak_bytes")]
            out.append(f"  stage {r}: peak {max(meas) / MiB:.1f} MiB"
                       + (f", {over} step(s) over the budget" if self.budget else "")
                       + (f", peak prediction error {100 * sum(errs) / len(errs):.1f}% mean, "
                          f"{100 * max(errs):.1f}% worst" if errs else ""))
        return out

    def write(self, out_dir: str) -> list:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "run_report.json")
        with open(path, "w") as fh:
            json.dump({"budget_bytes": self.budget, "calibration": self.calibration,
                       "calibration_seconds": (self.calibration or {}).get("seconds"), "steps": self.steps},
                      fh, indent=1, default=float)
        paths = [path]
        png = self.plot(os.path.join(out_dir, "run_report.png"))
        if png:
            paths.append(png)
        return paths

    def plot(self, path: str):
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        st = self.steps
        it = [s["iteration"] for s in st]
        points = []  # (iteration, length, plan) per micro-batch
        for s_ in st:
            per = max(1, len(s_["plans"]))
            lens = s_["lengths"]
            b = max(1, len(lens) // per)  # lengths are stored micro-batch after micro-batch
            mbl = [lens[i * b:(i + 1) * b] for i in range(per)]
            for k, p in enumerate(s_["plans"] or [None]):
                name = "stock" if p is None else describe(tuple(p))
                for x in (mbl[k] if k < len(mbl) else []):
                    points.append((s_["iteration"], x, name))
        names = list(dict.fromkeys(n for _, _, n in sorted(points, key=lambda q: q[1])))
        cmap = plt.get_cmap("tab10")
        fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
        ax = axes[0]
        for i, n in enumerate(names):
            pts = [(x, y) for x, y, m in points if m == n]
            ax.scatter([q[0] for q in pts], [q[1] for q in pts], color=cmap(i % 10), s=28, label=n, zorder=3)
        ax.set_ylabel("micro-batch length")
        ax.set_yscale("log")
        ax.legend(fontsize=7, title="plan (per layer)", title_fontsize=7, loc="lower left", ncol=2)
        ax = axes[1]
        ax.plot(it, [s["seconds"] for s in st], "o-", label="measured", markersize=3)
        if any(s["predicted_seconds"] for s in st):
            ax.plot(it, [s["predicted_seconds"] for s in st], "x--", label="predicted", markersize=4)
        ax.set_ylabel("step time (s)")
        ax.legend(fontsize=7)
        ax = axes[2]
        meas = [s for s in st if s["peak_bytes"] is not None]
        ax.plot([s["iteration"] for s in meas], [s["peak_bytes"] / MiB for s in meas], "o-", label="measured peak",
                markersize=3)
        if any(s["predicted_peak_bytes"] for s in st):
            ax.plot(it, [(s["predicted_peak_bytes"] or 0) / MiB for s in st], "x--", label="predicted", markersize=4)
        if self.budget:
            ax.axhline(self.budget / MiB, color="r", linewidth=1, label="budget")
        ax.set_ylabel("peak MiB / rank")
        ax.set_xlabel("iteration")
        ax.legend(fontsize=7)
        fig.suptitle("ParaDySe run: length and plan per step, predicted vs measured", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _shape(mb) -> list:
    """What a micro-batch is planned by, as JSON keeps it: ``[b, s]`` or ``[1, [document lengths]]``."""
    length = mb.plan_length
    return [int(mb.tokens.shape[0]), list(length.lengths) if hasattr(length, "lengths") else int(length)]


def static_predictions(planner, steps: list) -> dict:
    """``{"plain" | "+rc": (fastest fitting (name, seconds) or None, fastest (name, seconds,
    steps over, worst excess bytes))}`` of every uniform plan over ``steps`` (each a list of
    :func:`_shape` s), by ``planner``'s cost model and budget (its update once per step)."""
    from ..parallel.packing import PackShape
    from ..parallel.plans import make_entry

    cm, budget = planner.cm, planner.budget
    update = planner.update_seconds()
    out = {}
    for kind, rc in (("plain", False), ("+rc", True)):
        rows = []
        for st in planner.strategies:
            entry = make_entry(st, rc)
            secs, over, worst = 0.0, 0, 0.0
            for shapes in steps:
                costs = [cm.step((entry,) * cm.num_layers, PackShape(tuple(s)) if isinstance(s, list) else s, b)
                         for b, s in shapes]
                secs += sum(c.seconds for c in costs) + update
                peak = max(c.peak_bytes for c in costs)
                over, worst = over + (peak > budget), max(worst, peak - budget)
            rows.append((entry, secs, over, worst))
        fitting = [r[:2] for r in rows if r[2] == 0]
        out[kind] = (min(fitting, key=lambda r: r[1]) if fitting else None, min(rows, key=lambda r: r[1]))
    return out


def max_per_stage(x: float, stage: int, stages: int) -> list:
    """Each pipeline stage's maximum of ``x`` over its ranks (one all-reduce over the world)."""
    t = torch.full((stages,), float("-inf"), dtype=torch.float64)
    t[stage] = float(x)
    if dist.is_initialized():
        t = t.to(collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.cpu()]


def max_over_ranks(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([float(x)], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
