"""Summaries, the per-batch oracle, JSON and plots of a benchmark run; with pipeline stages
the per-stage summary (steps over budget and peak prediction errors per stage), the oracle
with its steps' stage peaks, the headline ratios and the table."""
from __future__ import annotations

import json
import os
import statistics
import sys

from ..units import MiB
from .config import STATIC


def oracle(records: dict, budget: float, candidates) -> list:
    """Per step: the fastest measured system among ``candidates`` whose peak fits the budget."""
    names = [n for n in candidates if n in records]
    if not names:
        return []
    out = []
    for k in range(len(records[names[0]])):
        fit = [(records[n][k]["seconds"], n) for n in names if records[n][k]["peak_bytes"] is not None
               and records[n][k]["seconds"] is not None and records[n][k]["peak_bytes"] <= budget]
        r0 = records[names[0]][k]
        if fit:
            sec, who = min(fit)
            out.append(dict(step=k, length=r0["length"], padded=r0["padded"], seconds=sec, source=who,
                            plan=records[who][k]["plan"], peak_bytes=records[who][k]["peak_bytes"]))
        else:
            out.append(dict(step=k, length=r0["length"], padded=r0["padded"], seconds=None, source=None,
                            plan=None, peak_bytes=None))
    return out


def summarize(records: dict, budget: float) -> dict:
    out = {}
    for name, recs in records.items():
        done = [r for r in recs if r["seconds"] is not None]
        over = [r for r in done if r["peak_bytes"] is not None and r["peak_bytes"] > budget]
        missing = len(recs) - len(done)
        secs = sum(r["seconds"] for r in done)
        toks = sum(r["length"] for r in done)
        within = [r["length"] for r in done if r["peak_bytes"] is not None and r["peak_bytes"] <= budget]
        plans: dict = {}
        for r in done:
            plans[r.get("plan") or "stock"] = plans.get(r.get("plan") or "stock", 0) + 1
        pred = [(r["predicted_seconds"], r["seconds"]) for r in done if r.get("predicted_seconds")]
        predm = [(r["predicted_peak_bytes"], r["peak_bytes"]) for r in done if r.get("predicted_peak_bytes")]
        out[name] = dict(
            steps=len(recs), total_seconds=secs if not missing else None, tokens=toks,
            worst_over_mib=max((r["peak_bytes"] - budget for r in over), default=0) / MiB,
            tokens_per_second=toks / secs if secs and not missing else None,
            steps_over_budget=len(over) + missing, steps_without_a_fitting_plan=missing,
            all_steps_fit=not over and not missing,
            longest_trained_within_budget=max(within) if within else 0,
            longest_step=max(r["length"] for r in recs) if recs else 0,
            max_peak_mib=max((r["peak_bytes"] for r in done if r["peak_bytes"] is not None), default=0) / MiB,
            plans_used=plans,
            mean_abs_time_error=(sum(abs(p - m) / m for p, m in pred) / len(pred)) if pred else None,
            mean_abs_peak_error=(sum(abs(p - m) / m for p, m in predm) / len(predm)) if predm else None,
        )
    return out


def headline(summary: dict, search: dict | None) -> dict:
    """The ratios the docs report (None where a side is missing)."""
    h = {}
    statics = {n: s for n, s in summary.items() if n in STATIC + tuple(f"{x}+rc" for x in STATIC)}
    fitting = {n: s for n, s in statics.items() if s["all_steps_fit"] and s["total_seconds"]}
    best = min(fitting.items(), key=lambda kv: kv[1]["total_seconds"]) if fitting else None
    h["fastest_all_fitting_static"] = best[0] if best else None
    for pl in ("paradyse_heuristic", "paradyse_optimal"):
        s = summary.get(pl)
        if not s or not s["total_seconds"]:
            continue
        if best:
            h[f"{pl}_speedup_vs_{best[0]}"] = best[1]["total_seconds"] / s["total_seconds"]
        if summary.get("oracle", {}).get("total_seconds"):
            h[f"{pl}_vs_oracle"] = s["total_seconds"] / summary["oracle"]["total_seconds"]
        h[f"{pl}_all_steps_fit"] = s["all_steps_fit"]
    h.update(packed_headline(summary))
    h.update({k: v for k, v in honest_headline(summary).items() if k != "static_kinds"})
    if search:
        longest = {n: v["longest_fitting"] for n, v in search.items()}
        h["longest_fitting"] = longest
        for pl in ("paradyse_heuristic", "paradyse_optimal"):
            for ref in ("tp_sp", "tp_sp+rc", "stock", "stock+rc"):
                if longest.get(pl) and longest.get(ref):
                    h[f"{pl}_longest_vs_{ref}"] = longest[pl] / longest[ref]
            static = {n: v for n, v in longest.items() if v and (n in STATIC or n.endswith("+rc"))}
            if longest.get(pl) and static:
                top = max(static, key=static.get)
                h[f"{pl}_longest_vs_longest_static"] = (top, longest[pl] / static[top])
    return h


# The kinds of static system a Megatron user runs: one strategy on every layer, plain, with every
# layer recomputed, with every MLP block recomputed (megatron's selective MLP recompute), packed,
# packed and recomputed (stock megatron-core with the plain and +rc ones)
KINDS = {"plain": ("stock",) + STATIC, "+rc": ("stock+rc",) + tuple(f"{x}+rc" for x in STATIC),
         "+rc-mlp": tuple(f"{x}+rc-mlp" for x in STATIC),
         "+pack": tuple(f"{x}+pack" for x in STATIC), "+rc+pack": tuple(f"{x}+rc+pack" for x in STATIC),
         "+rc-mlp+pack": tuple(f"{x}+rc-mlp+pack" for x in STATIC)}
PLANNERS = ("paradyse_heuristic", "paradyse_optimal", "paradyse_heuristic+pack", "paradyse_optimal+pack")


def _fastest(summary: dict, names) -> str | None:
    names = [n for n in names if summary.get(n, {}).get("tokens_per_second")]
    return max(names, key=lambda n: summary[n]["tokens_per_second"]) if names else None


def static_kinds(summary: dict) -> dict:
    """Per kind of static system (:data:`KINDS`) that ran: the fastest whose steps all fit and the
    fastest fitting or not (tokens/s of the same documents), with how often and by how much the
    latter misses the budget."""
    out = {}
    for kind, names in KINDS.items():
        ran = [n for n in names if n in summary]
        if not ran:
            continue
        fit = _fastest(summary, [n for n in ran if summary[n]["all_steps_fit"]])
        top = _fastest(summary, ran)
        s = summary.get(top, {})
        out[kind] = dict(fastest_fitting=fit,
                         fastest_fitting_tokens_per_s=summary[fit]["tokens_per_second"] if fit else None,
                         fastest=top, fastest_tokens_per_s=s.get("tokens_per_second"),
                         fastest_steps_over=s.get("steps_over_budget"), fastest_steps=s.get("steps"),
                         fastest_worst_over_mib=s.get("worst_over_mib"))
    return out


def honest_headline(summary: dict) -> dict:
    """Each planner's tokens/s against the fastest static of any kind whose steps all fit (the
    headline) and against the fastest static of any kind, fitting or not (beside it)."""
    kinds = static_kinds(summary)
    fit = _fastest(summary, [k["fastest_fitting"] for k in kinds.values() if k["fastest_fitting"]])
    top = _fastest(summary, [k["fastest"] for k in kinds.values() if k["fastest"]])
    h = {"static_kinds": kinds, "fastest_fitting_static": fit, "fastest_static": top}
    for pl in PLANNERS:
        tps = summary.get(pl, {}).get("tokens_per_second")
        if not tps:
            continue
        h[f"{pl}_all_steps_fit"] = summary[pl]["all_steps_fit"]
        if fit:
            h[f"{pl}_vs_fastest_fitting_static"] = tps / summary[fit]["tokens_per_second"]
        if top:
            h[f"{pl}_vs_fastest_static"] = tps / summary[top]["tokens_per_second"]
    return h


def kinds_table(summary: dict) -> str:
    """The fastest static of every kind beside each planner: tokens/s, and for a static that
    misses the budget how often and by how much."""
    h = honest_headline(summary)
    lines = [f"{'kind':10s} {'fastest fitting':22s} {'tok/s':>7s}   {'fastest':22s} {'tok/s':>7s} {'misses':>14s}"]
    for kind, k in h["static_kinds"].items():
        ff = k["fastest_fitting"] or "-"
        ft = f"{k['fastest_fitting_tokens_per_s']:.0f}" if k["fastest_fitting_tokens_per_s"] else "-"
        miss = (f"{k['fastest_steps_over']}/{k['fastest_steps']}, +{k['fastest_worst_over_mib']:.1f} MiB"
                if k["fastest_steps_over"] else "none")
        at = f"{k['fastest_tokens_per_s']:.0f}" if k["fastest_tokens_per_s"] else "-"
        lines.append(f"{kind:10s} {ff:22s} {ft:>7s}   {k['fastest'] or '-':22s} {at:>7s} {miss:>14s}")
    for pl in PLANNERS:
        if f"{pl}_vs_fastest_fitting_static" in h or f"{pl}_vs_fastest_static" in h:
            s = summary[pl]
            lines.append(f"{pl:24s} {s['tokens_per_second']:.0f} tok/s, {s['steps_over_budget']} steps over: "
                         f"{h.get(pl + '_vs_fastest_fitting_static', float('nan')):.3f}x the fastest fitting static "
                         f"({h['fastest_fitting_static']}), {h.get(pl + '_vs_fastest_static', float('nan')):.3f}x "
                         f"the fastest static ({h['fastest_static']})")
    return "\n".join(lines)


def packed_headline(summary: dict) -> dict:
    """Tokens/s of each packed planner against its unpacked self and against the fastest packed
    static strategy whose steps all fit (the issue's aims), where both sides exist."""
    h = {}
    statics = {n: s for n, s in summary.items() if n.endswith("+pack") and not n.startswith("paradyse_")
               and s["all_steps_fit"] and s["tokens_per_second"]}
    best = max(statics.items(), key=lambda kv: kv[1]["tokens_per_second"]) if statics else None
    h["fastest_all_fitting_packed_static"] = best[0] if best else None
    for pl in ("paradyse_heuristic", "paradyse_optimal"):
        s = summary.get(pl + "+pack")
        if not s or not s["tokens_per_second"]:
            continue
        h[f"{pl}+pack_all_steps_fit"] = s["all_steps_fit"]
        if summary.get(pl, {}).get("tokens_per_second"):
            h[f"{pl}+pack_tokens_per_s_vs_{pl}"] = s["tokens_per_second"] / summary[pl]["tokens_per_second"]
        if best:
            h[f"{pl}+pack_tokens_per_s_vs_{best[0]}"] = s["tokens_per_second"] / best[1]["tokens_per_second"]
    return h


# ------------------------------------------------------------------------------ pipeline stages


def pipeline_oracle(records: dict, budget: float, candidates) -> list:
    """:func:`oracle` over pipelined steps (a step fits when every stage's peak does: its
    ``peak_bytes`` is the max over stages), each step with its source's stage peaks and order."""
    out = oracle(records, budget, candidates)
    for o in out:
        src = records[o["source"]][o["step"]] if o["source"] else {}
        first = next(records[n][o["step"]] for n in candidates if n in records)
        o.update(documents=first["documents"], lengths=first["lengths"], order=src.get("order"),
                 stage_peak_bytes=src.get("stage_peak_bytes"), predicted_seconds=None,
                 predicted_peak_bytes=None, predicted_stage_peak_bytes=None)
    return out


def peak_errors(pairs) -> dict | None:
    """``{median, worst, worst_signed, n}`` of ``|pred - meas| / meas`` over ``(pred, meas)``
    pairs (None without pairs); ``worst_signed`` keeps the worst one's sign (+: over-predicted)."""
    errs = [(p - m) / m for p, m in pairs if p is not None and m]
    if not errs:
        return None
    worst = max(errs, key=abs)
    return dict(median=statistics.median(abs(e) for e in errs), worst=abs(worst), worst_signed=worst, n=len(errs))


def stage_summary(records: dict, budget: float, stages: int) -> dict:
    """Per system: steps over the budget per stage, each stage's highest measured peak (MiB),
    the per-stage peak prediction errors (:func:`peak_errors`, per stage and over all stages)
    and the longest document of a step whose every stage fit."""
    out = {}
    for name, recs in records.items():
        done = [r for r in recs if r["seconds"] is not None and r.get("stage_peak_bytes")]
        per = [[(r.get("predicted_stage_peak_bytes") or [None] * stages)[i], r["stage_peak_bytes"][i]]
               for r in done for i in range(stages)]
        out[name] = dict(
            steps_over_budget_per_stage=[sum(r["stage_peak_bytes"][i] > budget for r in done) for i in range(stages)],
            max_stage_peak_mib=[max((r["stage_peak_bytes"][i] for r in done), default=0) / MiB for i in range(stages)],
            stage_peak_error=[peak_errors(per[i::stages]) for i in range(stages)],
            peak_error=peak_errors(per),
            longest_document_within_budget=max((max(r["lengths"]) for r in done if r["peak_bytes"] <= budget),
                                               default=0))
    return out


def pipeline_headline(summary: dict, stages: dict) -> dict:
    """:func:`headline`'s ratios (each planner's tokens/s against the fastest static strategy,
    plain or ``+rc``, whose steps all fit on every stage; against the oracle), plus each
    planner's steps over the budget per stage and its worst and median stage peak error."""
    h = {k: v for k, v in headline(summary, None).items() if "+pack" not in k and "packed" not in k}
    for pl in ("paradyse_heuristic", "paradyse_optimal"):
        if pl not in stages:
            continue
        h[f"{pl}_steps_over_budget_per_stage"] = stages[pl]["steps_over_budget_per_stage"]
        err = stages[pl]["peak_error"]
        if err:
            h[f"{pl}_stage_peak_error_median"], h[f"{pl}_stage_peak_error_worst"] = err["median"], err["worst_signed"]
    return h


def pipeline_table(summary: dict, stages: dict, budget: float) -> str:
    """The pipelined run's table: time, tokens/s, steps over budget (any stage, then per stage),
    each stage's highest peak, the stage peak prediction error (median / worst, %)."""
    n = len(next(iter(stages.values()))["steps_over_budget_per_stage"]) if stages else 0
    over = "/".join(f"s{i}" for i in range(n))
    lines = [f"{'system':20s} {'total s':>8s} {'tok/s':>7s} {'over':>5s} {'over ' + over:>10s} "
             f"{'max peak MiB ' + over:>20s} {'pred err % med/worst':>21s}   (budget {budget / MiB:.1f} MiB)"]
    for name, s in summary.items():
        st = stages.get(name, {})
        tot = f"{s['total_seconds']:.1f}" if s["total_seconds"] else "n/a"
        tps = f"{s['tokens_per_second']:.0f}" if s["tokens_per_second"] else "n/a"
        per = "/".join(str(x) for x in st.get("steps_over_budget_per_stage", []))
        peaks = "/".join(f"{x:.1f}" for x in st.get("max_stage_peak_mib", []))
        e = st.get("peak_error")
        err = f"{100 * e['median']:.1f}/{100 * e['worst_signed']:+.1f}" if e else "-"
        lines.append(f"{name:20s} {tot:>8s} {tps:>7s} {s['steps_over_budget']:5d} {per:>10s} {peaks:>20s} {err:>21s}")
    return "\n".join(lines)


def write_json(result: dict, path: str) -> str:
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1, default=float)
    return path


def table(summary: dict, budget: float) -> str:
    lines = [f"{'system':24s} {'total s':>9s} {'tok/s':>8s} {'over':>5s} {'longest ok':>10s} "
             f"{'max peak MiB':>12s}   (budget {budget / MiB:.1f} MiB)"]
    for name, s in summary.items():
        tot = f"{s['total_seconds']:.1f}" if s["total_seconds"] else "n/a"
        tps = f"{s['tokens_per_second']:.0f}" if s["tokens_per_second"] else "n/a"
        lines.append(f"{name:24s} {tot:>9s} {tps:>8s} {s['steps_over_budget']:5d} "
                     f"{s['longest_trained_within_budget']:10d} {s['max_peak_mib']:12.1f}")
    return "\n".join(lines)


def plot(result: dict, out_dir: str) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    records, budget, summary = result["records"], result["budget_bytes"], result["summary"]
    paths = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, recs in records.items():
        if name.endswith("+pack"):  # a pack's length is its total: not this plot's axis
            continue
        pts = sorted((r["length"], r["seconds"], r["peak_bytes"] is not None and r["peak_bytes"] > budget)
                     for r in recs if r["seconds"] is not None)
        if not pts:
            continue
        style = dict(linestyle="--", linewidth=1) if name in ("stock", "oracle") else dict(linewidth=1.2)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=name, **style)
        over = [p for p in pts if p[2]]
        if over:
            ax.scatter([p[0] for p in over], [p[1] for p in over], marker="x", s=40, color=line.get_color())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per step (its micro-batches)" if result.get("pp", 1) > 1 else "sequence length (tokens)")
    ax.set_ylabel("time per step (s)")
    ax.set_title(f"{result['title']}\nx = step over the {budget / MiB:g} MiB budget", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    p = os.path.join(out_dir, "time_vs_length.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(8, 4))
    names = [n for n in summary if summary[n]["total_seconds"]]
    vals = [summary[n]["total_seconds"] for n in names]
    colors = ["#cc6677" if not summary[n]["all_steps_fit"] else "#4477aa" for n in names]
    ax.bar(names, vals, color=colors)
    for i, n in enumerate(names):
        s = summary[n]
        ax.text(i, vals[i], f"{vals[i]:.0f}s" + ("" if s["all_steps_fit"] else f"\n{s['steps_over_budget']} over"),
                ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("total time (s)")
    ax.set_title(f"{result['title']}\nred: some steps over the {budget / MiB:g} MiB budget", fontsize=9)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    p = os.path.join(out_dir, "total_time.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths


def kinds_markdown(summary: dict) -> list:
    """:func:`kinds_table` as markdown lines."""
    h = honest_headline(summary)
    if not h["static_kinds"]:
        return []
    out = ["| kind | fastest static whose steps all fit | tokens/s | fastest static | tokens/s | its steps over the budget |",
           "|---|---|---:|---|---:|---|"]
    for kind, k in h["static_kinds"].items():
        ft = f"{k['fastest_fitting_tokens_per_s']:.0f}" if k["fastest_fitting_tokens_per_s"] else "-"
        at = f"{k['fastest_tokens_per_s']:.0f}" if k["fastest_tokens_per_s"] else "-"
        miss = (f"{k['fastest_steps_over']} of {k['fastest_steps']}, worst +{k['fastest_worst_over_mib']:.1f} MiB"
                if k["fastest_steps_over"] else "none")
        out.append(f"| {kind} | `{k['fastest_fitting'] or '-'}` | {ft} | `{k['fastest'] or '-'}` | {at} | {miss} |")
    out.append("")
    for pl in PLANNERS:
        if f"{pl}_vs_fastest_fitting_static" in h:
            out.append(f"- `{pl}`: {summary[pl]['tokens_per_second']:.0f} tokens/s, {summary[pl]['steps_over_budget']} "
                       f"steps over; **{h[pl + '_vs_fastest_fitting_static']:.3f}x** the fastest static whose steps "
                       f"all fit (`{h['fastest_fitting_static']}`), {h[pl + '_vs_fastest_static']:.3f}x the fastest "
                       f"static fitting or not (`{h['fastest_static']}`)")
    out.append("")
    return out


def markdown(bench: dict | None = None, sim: dict | None = None) -> str:
    """Markdown tables of a bench.json and a simulation.json (for docs/benchmark.md)."""
    out = []
    if bench:
        b = bench["budget_bytes"]
        out.append(f"Budget {b / MiB:.0f} MiB per rank; {bench['steps']} steps; run took "
                   f"{bench['wall_seconds']:.0f} s.\n")
        out.append("| system | total time (s) | tokens/s | steps over budget | longest step within budget "
                   "| max peak (MiB) | longest trainable (search) |")
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        search = bench.get("search") or {}
        for n, s in bench["summary"].items():
            tot = f"{s['total_seconds']:.1f}" if s["total_seconds"] else "n/a"
            tps = f"{s['tokens_per_second']:.0f}" if s["tokens_per_second"] else "n/a"
            lf = search.get(n, {}).get("longest_fitting")
            out.append(f"| `{n}` | {tot} | {tps} | {s['steps_over_budget']} | "
                       f"{s['longest_trained_within_budget']} | {s['max_peak_mib']:.1f} | "
                       f"{'' if lf is None else lf} |")
        out.append("")
        out += kinds_markdown(bench["summary"])
    if sim:
        d = sim["distribution"]
        out.append(f"{sim['label']}: {d['n']} sequences, median {d['median']:.0f}, p90 {d['p90']}, "
                   f"max {d['max']} tokens; ParaDySe = {sim['planner_source']}.\n")
        out.append("| system | OOM steps | tokens/s (fitting steps) | long steps (≥ p90) fitting | "
                   "time of long steps (s) | longest trainable |")
        out.append("|---|---:|---:|---:|---:|---:|")
        for n, s in sim["systems"].items():
            out.append(f"| `{n}` | {s['oom_steps']} | {s['throughput_tokens_per_s']:.0f} | "
                       f"{s['long_steps_fitting']}/{d['long_steps']} | {s['long_steps_seconds']:.0f} | "
                       f"{s['longest_trainable']:,} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    args = sys.argv[1:]
    bj = json.load(open(args[0])) if args and args[0] != "-" else None
    sj = json.load(open(args[1])) if len(args) > 1 else None
    print(markdown(bj, sj))
