"""Accuracy of a cost model: ``python -m megatron_paradyse.costmodel report MODEL --profile HELDOUT``.

Per strategy: mean and worst absolute percentage error of layer time, saved bytes and
transient bytes on the held-out profile's lengths, split into interpolated (inside the
model's profiled range) and extrapolated (beyond it); the same on the profile's packs the
model was not fitted on (``profile --packs``, ``fit --holdout-packs``). ``--png`` draws predicted against
measured curves per strategy (time and memory against s, log axes). ``--steps`` measures
whole training steps (forward, backward, ``finalize_model_grads`` and megatron's Adam step,
as ``measure.TrainingUpdate`` sets them up; per-rank peak memory) for mixed plans end to end
on spawned gloo ranks and compares them with ``CostModel.step``.
"""
from __future__ import annotations

import gc
import json
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from ..errors import ArgumentParser, UserError, command
from ..paths import writable_file
from ..memory import PeakMemory, static_bytes
from ..parallel.buffers import release_pool
from ..parallel.dispatch import set_plan
from ..parallel.plans import describe
from ..units import MiB
from . import build_cost_model
from . import measure as M
from .fitted import TARGETS, FittedCostModel
from .profile import read_profile
from .ranks import run_ranks
from .shape import ModelShape


def ape(pred, meas):
    return abs(pred - meas) / abs(meas) * 100.0 if meas else float("nan")


def fitted_points(model) -> set:
    """``{(strategy, s, b)}`` the model was fitted on, where it records them (empty if not)."""
    return {(st, s, b) for st, pts in (getattr(model, "meta", {}).get("fitted") or {}).items() for s, b in pts}


def layer_errors(model, rows, profiled=frozenset()) -> dict:
    """``{strategy: {"interp"|"extrap": {target: [errors %]}, "points": [...]}}``.

    Rows at a ``(strategy, s, b)`` in ``profiled`` (what the model was fitted on) are skipped:
    a held-out error is measured where the model has seen nothing.
    """
    out = {}
    s_max = getattr(model, "meta", {}).get("s_max", {})
    for r in rows:
        if r.get("type") != "layer" or r["strategy"] not in model.strategies:
            continue
        if (r["strategy"], r["s"], r["b"]) in profiled:
            continue
        st = r["strategy"]
        pred = model.layer(st, r["s"], r["b"])
        region = "extrap" if r["s"] > s_max.get(st, float("inf")) else "interp"
        d = out.setdefault(st, {"interp": {t: [] for t in TARGETS}, "extrap": {t: [] for t in TARGETS},
                                "points": []})
        for tg, pv in zip(TARGETS, pred):
            d[region][tg].append(ape(pv, r[tg]))
        d["points"].append({"s": r["s"], "b": r["b"], "region": region,
                            **{f"pred_{t}": v for t, v in zip(TARGETS, pred)},
                            **{f"meas_{t}": r[t] for t in TARGETS}, "spread": r.get("layer_spread")})
    return out


def pack_errors(model, rows) -> dict:
    """``{strategy: {target: [errors %]}, "points": [...]}`` on the profile's packs that the model
    was not fitted on (``pack_fitted`` in its file; a model without packs: every pack)."""
    from .packs import PackShape

    seen = set(getattr(model, "meta", {}).get("pack_fitted") or ())
    out = {}
    for r in rows:
        if r.get("type") != "pack" or r["strategy"] not in model.strategies or r["pack"] in seen:
            continue
        pk = PackShape(tuple(r["lengths"]))
        pred = model.layer(r["strategy"], pk, 1)
        d = out.setdefault(r["strategy"], {**{t: [] for t in TARGETS}, "points": []})
        for tg, pv in zip(TARGETS, pred):
            d[tg].append(ape(pv, r[tg]))
        d["points"].append({"pack": r["pack"], "s": r["s"], "docs": len(r["lengths"]),
                            **{f"pred_{t}": v for t, v in zip(TARGETS, pred)}, **{f"meas_{t}": r[t] for t in TARGETS}})
    return out


def pack_table(errs) -> str:
    lines = ["| strategy | packs | time mean / worst % | saved mean / worst % | transient mean / worst % |",
             "|---|---:|---:|---:|---:|"]
    for st, d in errs.items():
        cells = [f"{np.mean(d[t]):.1f} / {np.max(d[t]):.1f}" for t in TARGETS]
        lines.append(f"| {st} | {len(d['seconds'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(errs) -> str:
    lines = ["| strategy | region | n | time mean / worst % | saved mean / worst % | transient mean / worst % |",
             "|---|---|---:|---:|---:|---:|"]
    for st, d in errs.items():
        for region in ("interp", "extrap"):
            e = d[region]
            n = len(e["seconds"])
            if not n:
                continue
            cells = [f"{np.mean(e[t]):.1f} / {np.max(e[t]):.1f}" for t in TARGETS]
            lines.append(f"| {st} | {'interpolated' if region == 'interp' else 'extrapolated'} | {n} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def extrapolation_table(model, errs) -> str:
    """Time error (signed %, predicted / measured - 1) of each held-out length beyond the fitted
    range, by its multiple of the strategy's largest fitted length (2x, 4x ...); empty if none."""
    s_max = getattr(model, "meta", {}).get("s_max", {})
    cells = {}
    for st, d in errs.items():
        for pt in d["points"]:
            if pt["region"] == "extrap" and st in s_max:
                mult = pt["s"] / s_max[st]
                err = 100.0 * (pt["pred_seconds"] / pt["meas_seconds"] - 1.0)
                cells.setdefault(st, {})[f"{mult:g}x"] = err
    if not cells:
        return ""
    cols = sorted({c for v in cells.values() for c in v}, key=lambda c: float(c[:-1]))
    lines = ["| strategy | " + " | ".join(f"time at {c} s_max, %" for c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for st, v in cells.items():
        lines.append(f"| {st} | " + " | ".join(f"{v[c]:+.1f}" if c in v else "" for c in cols) + " |")
    return "\n".join(lines)


def plot(model, errs, train_rows, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sts = list(errs)
    fitted = fitted_points(model)
    fig, axes = plt.subplots(2, len(sts), figsize=(3.2 * len(sts), 6), squeeze=False)
    colors = dict(zip(("tp_sp", "ulysses", "ring", "colossal", "metp"), plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    smax = max(p["s"] for d in errs.values() for p in d["points"])
    smin = min([r["s"] for r in train_rows if r.get("type") == "layer"] + [smax])
    grid = np.unique(np.geomspace(smin, smax, 60).astype(int) // model.shape.p * model.shape.p)
    grid = grid[grid > 0]
    for j, st in enumerate(sts):
        c = colors.get(st)
        pts = errs[st]["points"]
        tr = [r for r in train_rows if r.get("type") == "layer" and r["strategy"] == st and r["b"] == 1
              and (not fitted or (st, r["s"], r["b"]) in fitted)]
        pred = [model.layer(st, int(s), 1) for s in grid]
        ax = axes[0][j]
        ax.plot(grid, [p.seconds * 1e3 for p in pred], "-", color=c, label="model")
        ax.plot([r["s"] for r in tr], [r["seconds"] * 1e3 for r in tr], "o", mfc="none", color="k", label="profiled")
        ax.plot([p["s"] for p in pts], [p["meas_seconds"] * 1e3 for p in pts], "x", color="r", label="held out")
        ax.set_xscale("log"); ax.set_yscale("log"); ax.set_title(st); ax.set_xlabel("s")
        if j == 0:
            ax.set_ylabel("layer fwd+bwd (ms)"); ax.legend(fontsize=7)
        L = model.num_layers
        ax = axes[1][j]
        ax.plot(grid, [(L * p.saved_bytes + p.transient_bytes) / MiB for p in pred], "-", color=c)
        ax.plot([r["s"] for r in tr], [(L * r["saved_bytes"] + r["transient_bytes"]) / MiB for r in tr], "o",
                mfc="none", color="k")
        ax.plot([p["s"] for p in pts], [(L * p["meas_saved_bytes"] + p["meas_transient_bytes"]) / MiB for p in pts],
                "x", color="r")
        ax.set_xscale("log"); ax.set_yscale("log"); ax.set_xlabel("s")
        if j == 0:
            ax.set_ylabel(f"{L} layers' saved + transient (MiB)")
    # crossovers: all strategies' time on one panel would hide them at this size; the title says
    fig.suptitle(f"cost model vs measurement: {model.shape.describe()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_all(model, png):
    """All strategies' predicted time and memory on one panel each (the crossovers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.unique(np.geomspace(128, 16384, 50).astype(int) // model.shape.p * model.shape.p)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for st in model.strategies:
        pr = [model.layer(st, int(s), 1) for s in grid]
        a.plot(grid, [p.seconds * 1e3 for p in pr], label=st)
        b.plot(grid, [(model.num_layers * p.saved_bytes + p.transient_bytes) / MiB for p in pr], label=st)
    for ax, yl in ((a, "layer fwd+bwd (ms)"), (b, "layers' saved + transient (MiB)")):
        ax.set_xscale("log"); ax.set_yscale("log"); ax.set_xlabel("s"); ax.set_ylabel(yl)
        if hasattr(model, "meta"):
            ax.axvline(max(model.meta["s_max"].values()), color="gray", ls=":", lw=1)
    a.legend(fontsize=7)
    fig.suptitle(f"predicted, all strategies ({model.shape.describe()}); dotted: largest profiled s", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------
# whole steps, end to end


def _step_rank(rank, world, shape_d, plans, seqs, repeats):
    shape = ModelShape(**shape_d)
    spec, model = M.build(shape, max_seq=max(seqs))
    upd = M.TrainingUpdate(model, shape)
    batches = {}
    for s in seqs:
        tok, lab = M.make_batch(M.token_vocab(spec, shape), 1, s, seed=s)
        batches[s] = (tok, torch.arange(s, device=tok.device).unsqueeze(0).expand_as(tok), lab)
    cells = [(s, tuple(plan)) for s in seqs for plan in plans]

    def fwd_bwd(s, plan):
        set_plan(model, list(plan))
        release_pool()  # as in training: each micro-batch allocates its own pool
        upd.zero_grad()
        tok, pos, lab = batches[s]
        model(tok, pos, None, labels=lab).float().mean().backward()

    def step(s, plan):
        fwd_bwd(s, plan)
        upd.grad_sync()
        upd.optimizer_step()

    for cell in cells:  # warm-up: Adam state exists from here on
        step(*cell)
    # timed steps in rounds over every (s, plan), alternating direction, so that a slow spell
    # of a shared machine spreads over every cell's repeats; each after an untimed
    # forward+backward of its own cell, as a training step follows one of its size (as the
    # profiler's timed passes do, profile.py)
    times = {cell: [] for cell in cells}
    for rnd in range(repeats):
        for cell in (cells if rnd % 2 == 0 else cells[::-1]):
            fwd_bwd(*cell)
            dist.barrier()
            t0 = time.perf_counter()
            step(*cell)
            times[cell].append(time.perf_counter() - t0)
    out = []
    for cell in cells:
        gc.collect()
        with PeakMemory() as m:
            fwd_bwd(*cell)
        out.append({"s": cell[0], "plan": list(cell[1]), "seconds": statistics.median(times[cell]),
                    "times": times[cell], "dynamic_peak": m.peak_bytes,
                    "static": static_bytes(model, upd.optimizer)})
    return out


def measure_steps(shape, plans, seqs, repeats=5, timeout=1800):
    per_rank = run_ranks(_step_rank, shape.p, shape.key(), plans, seqs, repeats, timeout=timeout)
    rows = []
    for i, r in enumerate(per_rank[0]):
        rows.append(dict(r, seconds=max(x[i]["seconds"] for x in per_rank),
                         dynamic_peak=max(x[i]["dynamic_peak"] for x in per_rank),
                         static=max(x[i]["static"] for x in per_rank)))
    return rows


DEFAULT_PLANS = [
    ("tp_sp",) * 4, ("tp_sp", "tp_sp", "ulysses", "ulysses"), ("ulysses", "ring", "ring", "metp"),
    ("tp_sp", "colossal", "metp", "metp"), ("ring", "ring", "metp", "metp"),
    ("metp", "ulysses", "tp_sp", "ring"),
]


def step_errors(model, measured) -> list:
    out = []
    for r in measured:
        pred = model.step(tuple(r["plan"]), r["s"], 1)
        seconds = pred.seconds + model.update_seconds()  # one micro-batch and the step's update
        static_pred = model.static_bytes()
        dyn_pred = pred.peak_bytes - static_pred
        out.append(dict(r, pred_seconds=seconds, pred_peak=pred.peak_bytes,
                        meas_peak=r["static"] + r["dynamic_peak"],
                        err_time=ape(seconds, r["seconds"]),
                        err_peak=ape(pred.peak_bytes, r["static"] + r["dynamic_peak"]),
                        err_dynamic=ape(dyn_pred, r["dynamic_peak"])))
    return out


def step_table(errs) -> str:
    lines = ["| s | plan | measured ms | predicted ms | time err % | measured peak MiB | predicted MiB | peak err % | activations-only err % |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for e in errs:
        lines.append(f"| {e['s']} | {describe(tuple(e['plan']))} | {e['seconds'] * 1e3:.1f} | {e['pred_seconds'] * 1e3:.1f} | "
                     f"{e['err_time']:.1f} | {e['meas_peak'] / MiB:.2f} | {e['pred_peak'] / MiB:.2f} | "
                     f"{e['err_peak']:.1f} | {e['err_dynamic']:.1f} |")
    return "\n".join(lines)


def fake_table(real_rows, fake_path) -> str:
    """The single-device profile ``fake_path`` (one process as rank r of a fake p-rank group)
    beside rank r of the real p-rank profile's rows: time and per-rank memory per (strategy, s)."""
    header, fake_rows = read_profile(fake_path)
    if header.get("mode") != "fake":
        raise UserError(f"--fake {fake_path!r} is not a single-device profile (mode {header.get('mode')!r})")
    r = header["fake_rank"]
    real = {(x["strategy"], x["s"], x["b"]): x for x in real_rows if x.get("type") == "layer"}
    lines = [f"| strategy | s | real p = {header['p']} (layer ms, slowest rank) | fake rank {r}: compute ms "
             f"| + modelled comm ms ({header.get('interconnect')}) | saved MiB, real rank {r} / fake "
             f"| transient MiB, real rank {r} / fake |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for f in fake_rows:
        x = real.get((f.get("strategy"), f.get("s"), f.get("b"))) if f.get("type") == "layer" else None
        if x is None or "saved_by_rank" not in x:
            continue
        lines.append(f"| {f['strategy']} | {f['s']} | {x['layer_seconds'] * 1e3:.0f} | {f['layer_seconds'] * 1e3:.0f} "
                     f"| {f.get('comm_seconds', 0.0) * 1e3:.1f} | {x['saved_by_rank'][r] / MiB:.2f} / "
                     f"{f['saved_bytes'] / MiB:.2f} | {x['transient_by_rank'][r] / MiB:.2f} / "
                     f"{f['transient_bytes'] / MiB:.2f} |")
    return "\n".join(lines)


def build_parser():
    """The ``report`` command's flags."""
    ap = ArgumentParser(prog="python -m megatron_paradyse.costmodel report",
                                 description="Accuracy of a cost model on held-out measurements.")
    ap.add_argument("model", help="fitted model metadata JSON, or 'analytic'")
    ap.add_argument("--profile", required=True, action="append",
                    help="held-out profile (JSON lines); repeat to pool several (same shape)")
    ap.add_argument("--train-profile", default=None,
                    help="the profile the model was fitted on, drawn in the plot; for a model that does "
                         "not record its fitted lengths, these are left out of the held-out errors")
    ap.add_argument("--png", default=None, help="write the per-strategy plot here")
    ap.add_argument("--png-all", default=None, help="write the all-strategies plot here")
    ap.add_argument("--steps", default=None, help="comma-separated lengths: measure whole steps end to end")
    ap.add_argument("--step-repeats", type=int, default=5)
    ap.add_argument("--fake", default=None,
                    help="a single-device profile (--fake-world p --fake-rank r) of the same shape: print it "
                         "beside rank r of the --profile rows (time, per-rank memory)")
    ap.add_argument("--json", default=None, help="write all numbers here")
    return ap


def _held_out(paths) -> tuple:
    """(rows, shape) of the held-out profiles ``paths``, pooled; a UserError when their shapes differ."""
    rows, shape = [], None
    for path in paths:
        header, more = read_profile(path)
        this = ModelShape.from_dict(header["shape"])
        if shape is not None and this != shape:
            raise UserError(f"held-out profile {path!r} is for {this.describe()}, "
                             f"{paths[0]!r} for {shape.describe()}")
        shape = this
        rows += more
    return rows, shape


@command("python -m megatron_paradyse.costmodel report")
def main(argv=None):
    args = build_parser().parse_args(argv)
    for flag in ("png", "png_all", "json"):
        if getattr(args, flag):
            writable_file(getattr(args, flag), "--" + flag.replace("_", "-"))
    rows, shape = _held_out(args.profile)
    model = build_cost_model(shape) if args.model == "analytic" else FittedCostModel.load(args.model, shape)
    # the plot draws the fitted points: from --train-profile, else from --profile itself (a
    # model that records its fitted lengths picks them out of it)
    train = read_profile(args.train_profile)[1] if args.train_profile else (rows if fitted_points(model) else [])
    # what the model was fitted on is never a held-out point: the model records it (older
    # models do not: then every length of the training profile counts as fitted)
    profiled = fitted_points(model)
    if not profiled:
        profiled = {(r["strategy"], r["s"], r["b"]) for r in train if r.get("type") == "layer"}
    errs = layer_errors(model, rows, profiled)
    if not errs and not pack_errors(model, rows) and (args.png or not (args.steps or args.fake or args.png_all)):
        raise UserError(f"nothing to report: every layer measurement of {', '.join(args.profile)} is one the "
                        f"model {args.model} was fitted on; fit with --holdout-seqs L (or --holdout-largest, "
                        "--fit-max-seq S) to leave lengths out, or give a profile measured apart")
    print(f"model {args.model} ({getattr(model, 'kind', '?')}), held-out {', '.join(args.profile)}: "
          f"{shape.describe()}\n")
    result = _report_layers(model, rows, errs)
    _report_plots(model, errs, train, rows, png=args.png, png_all=args.png_all, fake=args.fake)
    if args.steps:
        result["steps"] = _report_steps(model, shape, args.steps, args.step_repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=float)


def _report_layers(model, rows, errs) -> dict:
    """Print the held-out layer errors, beyond the fitted range, and the held-out packs'; the
    JSON result so far (``layers``, ``packs``)."""
    print(table(errs))
    ext = extrapolation_table(model, errs)
    if ext:
        print("\nbeyond the fitted range, by multiple of the largest fitted length:\n")
        print(ext)
    result = {"layers": errs}
    perrs = pack_errors(model, rows)
    if perrs:
        held = getattr(model, "meta", {}).get("pack_held_out")
        print(f"\npacks the model was not fitted on ({'indices ' + str(held) if held is not None else 'all'}; "
              "b = 1, padded to a multiple of p):\n")
        print(pack_table(perrs))
        result["packs"] = perrs
    return result


def _report_plots(model, errs, train, rows, png=None, png_all=None, fake=None) -> None:
    """``--png``, ``--png-all`` and ``--fake``: the plots written, the single-device table printed."""
    if png:
        plot(model, errs, train, png)
        print(f"\nwrote {png}")
    if png_all:
        plot_all(model, png_all)
        print(f"wrote {png_all}")
    if fake:
        print("\nsingle-device profile beside the real one:\n")
        print(fake_table(rows, fake))


def _report_steps(model, shape, steps: str, repeats: int) -> list:
    """``--steps``: whole training steps measured end to end at those lengths against the model;
    printed, and returned."""
    seqs = [int(x) for x in steps.split(",")]
    plans = [p for p in DEFAULT_PLANS if len(p) == shape.num_layers] or [("tp_sp",) * shape.num_layers]
    measured = measure_steps(shape, plans, seqs, repeats)
    se = step_errors(model, measured)
    print("\nwhole steps (fwd + bwd + finalize_model_grads + megatron Adam step, measured end to end; "
          "peak per rank incl. weights, grads, Adam state):\n")
    print(step_table(se))
    print(f"\nworst: time {max(e['err_time'] for e in se):.1f}%, peak {max(e['err_peak'] for e in se):.1f}%, "
          f"activation part of the peak {max(e['err_dynamic'] for e in se):.1f}%")
    return se
