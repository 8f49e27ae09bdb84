"""``python -m megatron_paradyse.plan`` (the command is ``megatron_paradyse/plan.py``): explain the
planners' choice per sequence length as a table, without starting a training run.

    python -m megatron_paradyse.plan --cost-model M.json --seq-lens 4k,32k,256k --memory-budget 70
    python -m megatron_paradyse.plan --p 2 --pack 72,900,31 --memory-budget 0.03   # a pack
    python -m megatron_paradyse.plan --pp 2 --step-lengths 4096,1024,2048,512 --memory-budget 0.05   # a pipelined step

Per length: every candidate (each uniform plan, recomputed ones too with ``--recompute auto``,
the heuristic's two-strategy mixes, the optimal plan; ``tp_sp:rc*2+tp_sp*2``: two layers of
``tp_sp`` recomputed in backward, then two plain) with its predicted time and peak, whether it fits the budget minus the margin,
which plan each planner chose and why; when nothing fits, the numbers and the longest length
that fits with the leanest plan. ``--step-lengths`` (one step's micro-batches, in run order)
with ``--pp P`` (pipeline stages, default 1): each planner's plans for the step over the
stages (``PipelinePlanner.explain_step``: per stage its layers, each micro-batch's plan, the
predicted peak against the limit; the step time and its bubble fraction).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging

from .. import logs
from ..costmodel import build_cost_model, demo_shape, extrapolation_note
from ..errors import ArgumentParser, UserError, command
from ..costmodel.analytic import AnalyticCostModel
from ..costmodel.fitted import FittedCostModel
from ..parallel.plans import describe
from ..units import GiB, MiB
from .build import build_planner
from ..parallel.packing import PackShape
from .core import describe_length, fmt_bytes
from .heuristic import HeuristicPlanner
from .stages import PipelinePlanner


def parse_length(text: str) -> int:
    t = text.strip().lower()
    mult = {"k": 1024, "m": 1024 ** 2}.get(t[-1:], 1)
    if mult > 1:
        t = t[:-1]
    try:
        v = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad length {text!r} (e.g. 4096, 4k, 1m)") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"length must be positive: {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m megatron_paradyse.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cost-model", default=None, metavar="PATH",
                    help="a fitted cost model (metadata .json); default: the model shipped for the shape "
                         "given by --p and the shape flags (the demo's shape), else the analytic model")
    ap.add_argument("--analytic", action="store_true", help="use the analytic model for the shape")
    ap.add_argument("--p", type=int, default=None, help="switching group size (default 4) for the demo shape")
    ap.add_argument("--num-layers", type=int, default=None, help="override the demo shape's layer count")
    ap.add_argument("--hidden-size", type=int, default=None)
    ap.add_argument("--num-attention-heads", type=int, default=None)
    ap.add_argument("--ffn-hidden-size", type=int, default=None)
    ap.add_argument("--seq-lens", default="", help="comma list of padded lengths: 4096,32k,1m")
    ap.add_argument("--pack", action="append", default=[], metavar="D1,D2,...",
                    help="a pack's document lengths (one micro-batch row, b = 1, padded to a multiple of p); "
                         "repeat for several")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--memory-budget", type=float, required=True, help="GiB per rank")
    ap.add_argument("--memory-margin", type=float, default=None,
                    help="GiB kept free (default 10%% of the budget for a GPU cost model, 5%% for a CPU one: by the cost model's device, not this machine)")
    ap.add_argument("--gamma", type=float, default=None)
    ap.add_argument("--planner", choices=("heuristic", "optimal", "both"), default="both")
    ap.add_argument("--recompute", choices=("auto", "off"), default="auto",
                    help="auto (default): a layer may also run recomputed in backward (plan entry "
                         "'tp_sp:rc': only its input kept, the layer run again in backward), where the "
                         "cost model prices that; off: never")
    ap.add_argument("--pp", type=int, default=1,
                    help="pipeline stages (megatron's 1F1B schedule) for --step-lengths; the layers must split evenly")
    ap.add_argument("--step-lengths", default="", metavar="S1,S2,...",
                    help="one step's micro-batches (padded lengths, in run order): plan them together over --pp stages")
    return ap


SHAPE_FLAGS = {"p": "p", "num_layers": "num_layers", "hidden_size": "hidden", "num_attention_heads": "heads",
               "ffn_hidden_size": "ffn"}  # flag dest -> ModelShape field


def load_model(a):
    """The cost model the flags name: ``--cost-model`` (shape flags, if given, must agree with
    it), or the shipped/analytic model of the demo shape with the shape flags applied."""
    if a.cost_model and not a.analytic:
        cm = FittedCostModel.load(a.cost_model)
        differ = [f"--{k.replace('_', '-')} {getattr(a, k)} (the model: {getattr(cm.shape, f)})"
                  for k, f in SHAPE_FLAGS.items() if getattr(a, k) is not None and getattr(a, k) != getattr(cm.shape, f)]
        if differ:
            raise UserError(f"--cost-model {a.cost_model} was made for {cm.shape.describe()}; the shape flags "
                            f"say otherwise: {', '.join(differ)}: drop them (the model fixes the shape)")
        return cm
    shape = demo_shape(a.p or 4)
    over = {k: v for k, v in dict(num_layers=a.num_layers, hidden=a.hidden_size, heads=a.num_attention_heads,
                                    ffn=a.ffn_hidden_size).items() if v is not None}
    if over:
        if "heads" in over:
            over["query_groups"] = over["heads"]
        shape = dataclasses.replace(shape, **over)
    if a.analytic:
        return AnalyticCostModel(shape)
    return build_cost_model(shape)


def explain(planners: dict, s: int, b: int) -> str:
    """The table of every candidate plan at ``(s, b)`` and what each planner chose (the command's output)."""
    any_pl = next(iter(planners.values()))
    h = planners.get("heuristic") or HeuristicPlanner(any_pl.cm, any_pl.budget, gamma=0.0,
                                                       margin_bytes=any_pl.margin, strategies=any_pl.strategies,
                                                       recompute=any_pl.recompute,
                                                       recompute_chunk=any_pl.recompute_chunk)
    costs = h.costs(s, b)
    rows = {}
    for layers, sec, peak, fits, note in h.candidates(costs):
        rows[layers] = [sec, peak, fits, note]
    for name, sec, peak in h.uniform(costs):  # dominated uniform plans too
        layers = (name,) * h.num_layers
        rows.setdefault(layers, [sec, peak, peak <= h.limit, f"uniform {name} (dominated)"])
    chosen = {}
    for kind, pl in planners.items():
        c = pl.choose(s, b)
        chosen[kind] = c
        rows.setdefault(c.layers, [c.seconds, c.peak_bytes, c.fits, "exact search"])
    where = describe_length(s) if isinstance(s, PackShape) else f"s = {s}"
    out = [f"\n== {where}, micro-batch {b}: budget {fmt_bytes(h.budget)} - margin {fmt_bytes(h.margin)} "
           f"= {fmt_bytes(h.limit)} per rank"]
    w = max(len(describe(k)) for k in rows) + 2
    unit, div = ("GiB", GiB) if h.budget >= GiB else ("MiB", MiB)
    out.append(f"  {'plan':<{w}} {'pred s':>12} {'peak ' + unit:>12}  fits  candidate / chosen by")
    for layers, (sec, peak, fits, note) in sorted(rows.items(), key=lambda kv: kv[1][0]):
        by = [k for k, c in chosen.items() if c.layers == layers and c.fits]
        mark = ("  <== chosen by " + ", ".join(by)) if by else ""
        out.append(f"  {describe(layers):<{w}} {sec:12.4f} {peak / div:12.4f}  {'yes ' if fits else 'no  '}  {note}{mark}")
    for kind, c in chosen.items():
        out.append(f"  {kind}: {describe(c.layers)}: {c.reason}")
    return "\n".join(out)


@command("python -m megatron_paradyse.plan")
def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    logs.setup(stream="stderr")  # the tables are the output (stdout)
    try:
        lens = [parse_length(x) for x in a.seq_lens.split(",") if x.strip()]
        lens += [PackShape(tuple(parse_length(x) for x in pk.split(",") if x.strip())) for pk in a.pack]
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise UserError(str(e)) from None
    try:
        step = [parse_length(x) for x in a.step_lengths.split(",") if x.strip()]
    except argparse.ArgumentTypeError as e:
        raise UserError(f"--step-lengths: {e}") from None
    if not lens and not step:
        raise UserError("give --seq-lens, --pack and/or --step-lengths")
    if a.pp < 1 or (a.pp > 1 and not step):
        raise UserError("--pp needs a number of stages >= 1 and --step-lengths (the step's micro-batches)")
    if a.pack and a.micro_batch != 1:
        raise UserError("a pack is one micro-batch row: --micro-batch must be 1 with --pack")
    if a.memory_budget <= 0:
        raise UserError("--memory-budget must be positive (GiB)")
    cm = load_model(a)
    note = extrapolation_note(cm, max(int(getattr(s, "tokens", s)) for s in lens + step))
    if note:
        logging.getLogger(__name__).warning(f"warning: {note}")
    kinds = ("heuristic", "optimal") if a.planner == "both" else (a.planner,)
    margin = None if a.memory_margin is None else a.memory_margin * GiB
    planners = {k: build_planner(k, cm, a.memory_budget * GiB, gamma=a.gamma, margin_bytes=margin,
                                 recompute=a.recompute) for k in kinds}
    pipes = pipeline_planners(kinds, cm, a, margin, step)
    shape = getattr(cm, "shape", None)
    print(f"cost model: {type(cm).__name__}" + (f" for {shape.describe()}" if shape is not None else "")
          + f"; {next(iter(planners.values())).describe()}")
    for s in lens:
        print(explain(planners, s, a.micro_batch))
    for pipe in pipes.values():
        print("\n" + pipe.explain_step([(s, a.micro_batch) for s in step]))
    return 0


def pipeline_planners(kinds, cm, a, margin, step: list) -> dict:
    """``{kind: PipelinePlanner}`` for the ``--step-lengths`` over ``--pp`` stages (none without
    them); a length that is not a multiple of p or layers that do not split evenly: UserError."""
    if not step:
        return {}
    p = int(getattr(getattr(cm, "shape", None), "p", 1) or 1)
    bad = [s for s in step if s % p]
    if bad:
        raise UserError(f"--step-lengths must be multiples of p = {p}: {', '.join(map(str, bad))}")
    try:
        return {k: PipelinePlanner(k, cm, a.memory_budget * GiB, a.pp, gamma=a.gamma, margin_bytes=margin,
                                   recompute=a.recompute) for k in kinds}
    except ValueError as e:  # layers that do not split evenly over the stages
        raise UserError(f"--pp {a.pp}: {e}") from None


if __name__ == "__main__":
    raise SystemExit(main())
