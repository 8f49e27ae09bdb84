"""A cost model made on another host, rescaled to this one: ``python -m megatron_paradyse.costmodel
calibrate MODEL -o HERE.json`` (or the trainer's ``--paradyse-calibrate``, at start-up).

A fitted model's times describe the host that profiled it: two hosts of one kind differ by up
to 1.5x here, and a GPU user may reuse a profile of another node. Memory does not depend on the
host; time does. The calibration re-measures a small part of the profile on this host, with the
profiler's own layer runner (``sweep.rank_sweep`` with ``ProfileConfig.cells``): each
strategy's layer at two lengths, ``S / 4`` and ``S`` (``S``: the run's longest sequence, at most
the model's profiled range), only where the planner could choose it under the run's memory
budget (:func:`cells_for`); one warm-up pass per strategy (at its longest cell: the shorter
one reuses it), then per cell timed passes until one moves the cell's time by less than 3% (at
least 3). It then scales

* each strategy's predicted layer time by ``measured here / predicted`` at those lengths,
  interpolated in log s between them and held constant outside (a pack at
  ``fitted.host_length``: the single sequence with its share of attention);
* the non-layer part and the step's update by the median of those ratios (measuring them
  would build the whole model a second time).

The factors are the same on every rank (every pass's time is shared by all ranks, which stop
each cell at the same pass; measured times are the max over ranks of each rank's median, as in
a profile). The result is the same model with a ``calibration`` record: the host, the lengths,
measured and predicted seconds, the factors, the timed passes and the wall time (``seconds``,
the max over ranks). On this 2-core CPU at p = 4 (the demo) it takes seconds, not a minute.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist

from .. import device
from ..errors import ArgumentParser, UserError, command
from ..parallel.plans import RC
from ..paths import writable_file
from ..units import GiB
from . import measure as M
from .fitted import FittedCostModel
from .profile import ProfileConfig, _with_model_args, hardware, merge_ranks, run_profile
from .sweep import rank_sweep

log = logging.getLogger(__name__)
REPEATS = 3  # the fewest timed passes of a cell
STABLE = 0.03  # a cell's timed passes stop once one moves its time by less than this (relative)


def lengths_for(cm: FittedCostModel, seq_length: int) -> list:
    """``[S / 4, S]`` (multiples of p): ``S`` the run's longest length, at most the shortest
    profiled range of the model's strategies (every strategy ran there)."""
    p = cm.shape.p
    top = min(int(seq_length), min(int(v) for v in cm.meta["s_max"].values()))
    hi = max(p, top // p * p)
    lo = max(p, hi // 4 // p * p)
    return sorted({lo, hi})


def cells_for(cm: FittedCostModel, seq_length: int, budget_bytes: float | None = None) -> list:
    """The calibration's cells, ``(strategy, s)``, each strategy's longest first (its shorter
    cells reuse its warm-up, ``sweep._calibration_rows``): every strategy at :func:`lengths_for`'s
    lengths where the planner could choose it under ``budget_bytes`` (a layer of it, its leanest
    entry, plain or recomputed, fits beside the static memory, as the model predicts); a
    strategy that fits at none of them is measured at the shortest alone (its factor then holds
    at every length). ``budget_bytes`` None: every cell."""
    lengths = lengths_for(cm, seq_length)
    out = []
    for st in cm.strategies:
        fit = [s for s in lengths if budget_bytes is None or lean_bytes(cm, st, s) <= budget_bytes]
        out += [(st, s) for s in sorted(fit or lengths[:1], reverse=True)]
    return out


def lean_bytes(cm: FittedCostModel, st: str, s: int) -> float:
    """The least memory a plan with one layer of ``st`` at ``s`` needs, as ``cm`` predicts: the
    static bytes plus the leanest entry's saved + transient (``st`` or ``st:rc``)."""
    entries = [st] + ([st + RC] if cm.recomputes() else [])
    return cm.static_bytes() + min(cm.layer(e, s, 1).saved_bytes + cm.layer(e, s, 1).transient_bytes
                                   for e in entries)


def config_for(cm: FittedCostModel, cells: list, model_args: dict | None = None) -> ProfileConfig:
    """The sweep of a calibration (``sweep._calibration_rows``): the layer of each strategy at
    its lengths (``cells``), b = 1, one warm-up pass per strategy, then timed passes until the
    time settles (:data:`STABLE`): no pool, memory, kernel, recompute or non-layer phase (a
    recomputed layer's time follows its strategy's factor, ``FittedCostModel.layer``)."""
    strategies = tuple(dict.fromkeys(st for st, _ in cells))
    return ProfileConfig(seqs=tuple(sorted({s for _, s in cells})), strategies=strategies, batches=(1,),
                         parts=("layer",), warmup=1, repeats=REPEATS, nonlayer=False, kernels=False,
                         recompute=False, memory_limit=None, command="calibrate", model_args=model_args,
                         cells=tuple(cells), stable=STABLE, time_stat=cm.meta.get("time_stat", "median"))


def measure_in_world(cm: FittedCostModel, cells: list, model_args: dict) -> list:
    """Every rank of an initialised world (p divides it): the calibration's rows, merged over
    the ranks (the same list on every rank). Leaves megatron's parallel state as ``measure.build``
    set it (TP = p): the caller initialises its own afterwards."""
    cfg = config_for(cm, cells, model_args)
    cfg, _ = _with_model_args(cm.shape, cfg, device.current().type)
    rows = rank_sweep(dist.get_rank(), dist.get_world_size(), cm.shape.key(), cfg)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, rows)
    M.free_after_oom()  # the one-layer model's memory back before the run's model is built
    return merge_ranks(per_rank)


def factors(cm: FittedCostModel, rows: list) -> dict:
    """The ``calibration`` record: per strategy, ``[s, measured, predicted, ratio]`` at each
    length it ran here; the median ratio (non-layer part and update)."""
    stat = cm.meta.get("time_stat", "median")
    base = uncalibrated(cm)  # the profile's host: what the measured times are compared with
    per = {}
    passes = 0
    for r in rows:
        if r.get("type") not in ("layer", "calibration") or r.get("b") != 1:
            continue
        passes += len(r["layer_times"])
        st, s = r["strategy"], int(r["s"])
        meas = min(r["layer_times"]) if stat == "min" else r["seconds"]
        pred = base.layer(st, s, 1).seconds
        per.setdefault(st, []).append([s, float(meas), float(pred), float(meas / pred) if pred > 0 else 1.0])
    missing = sorted(set(cm.strategies) - set(per))
    if missing:
        raise UserError(f"the calibration measured no layer of {missing} (out of memory at every length?): "
                        "calibrate at shorter lengths (--seq-length)")
    ratios = [x[3] for pts in per.values() for x in pts]
    return {"strategies": {st: sorted(v) for st, v in per.items()}, "other": float(statistics.median(ratios)),
            "lengths": sorted({x[0] for v in per.values() for x in v}), "passes": passes}


def uncalibrated(cm: FittedCostModel) -> FittedCostModel:
    """``cm`` without its calibration (the profile's host), for the predictions to compare with."""
    if "calibration" not in cm.meta:
        return cm
    meta = {k: v for k, v in cm.meta.items() if k != "calibration"}
    return FittedCostModel(meta, cm.boosters, cm.path, cm.prefetch)


def apply(cm: FittedCostModel, record: dict, host: dict | None = None) -> FittedCostModel:
    """A copy of ``cm`` whose times carry ``record`` (:func:`factors`) and where it was made."""
    meta = copy.deepcopy(uncalibrated(cm).meta)
    meta["calibration"] = dict(record, host=host or hardware(None, device.current().type),
                               made=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return FittedCostModel(meta, cm.boosters, cm.path, cm.prefetch)


def summary(cm: FittedCostModel) -> str:
    """One line per strategy: its factor at each calibration length, and the other parts'."""
    cal = cm.meta.get("calibration")
    if not cal:
        return "not calibrated"
    parts = [f"{st} " + "/".join(f"{x[3]:.2f}x" for x in pts) for st, pts in cal["strategies"].items()]
    return (f"time here / on the profile's host at s = {'/'.join(map(str, cal['lengths']))}: "
            + ", ".join(parts) + f"; non-layer part and update {cal['other']:.2f}x")


def calibrate_in_world(cm: FittedCostModel, seq_length: int, model_args: dict,
                       budget_bytes: float | None = None) -> FittedCostModel:
    """The trainer's ``--paradyse-calibrate``: measure here (every rank, before the run's own
    parallel state and seeds) the cells the planner could choose under ``budget_bytes``
    (:func:`cells_for`) and return the calibrated model (the same on every rank), its record's
    ``seconds`` the calibration's wall time, the max over ranks."""
    cells = cells_for(cm, seq_length, budget_bytes)
    t0 = time.perf_counter()
    sweep_log = logging.getLogger(rank_sweep.__module__)
    level = sweep_log.level
    sweep_log.setLevel(logging.WARNING)  # the profiler's progress lines: one summary line instead
    try:
        rows = measure_in_world(cm, cells, model_args)
    finally:
        sweep_log.setLevel(level)
    out = apply(cm, factors(cm, rows))
    out.meta["calibration"]["seconds"] = round(max_over_ranks(time.perf_counter() - t0), 1)
    return out


def max_over_ranks(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (one all-reduce)."""
    t = torch.tensor([float(seconds)], dtype=torch.float64, device=device.current())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def save(cm: FittedCostModel, out: str) -> str:
    """Write ``cm`` (metadata, and its XGBoost files copied beside it) as ``out``."""
    folder = os.path.dirname(os.path.abspath(out))
    src = os.path.dirname(os.path.abspath(cm.path))
    meta = copy.deepcopy(cm.meta)
    for name in meta.get("files") or {}:
        if os.path.abspath(os.path.join(src, name)) != os.path.abspath(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(folder, name))
    prof = meta.get("profile") or {}
    if prof.get("path") and not os.path.isabs(prof["path"]):
        prof["path"] = os.path.relpath(os.path.join(src, prof["path"]), folder)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1, default=float)
    os.replace(tmp, out)
    return out


def build_parser():
    ap = ArgumentParser(prog="python -m megatron_paradyse.costmodel calibrate",
                        description="Rescale a fitted cost model's times to this host (seconds to a minute).")
    ap.add_argument("model", help="a fitted model's metadata JSON (made on another host or node)")
    ap.add_argument("-o", "--output", required=True, help="the calibrated model's metadata JSON")
    ap.add_argument("--seq-length", type=int, default=4096,
                    help="the longest sequence you train: calibrated at it and a quarter of it (capped at "
                         "the model's profiled range; default 4096)")
    ap.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                    help="the run's --paradyse-memory-budget: a strategy is measured only at the lengths where "
                         "a layer of it fits (default: every strategy at both lengths)")
    ap.add_argument("--nproc", type=int, default=None, help="ranks to start (default: the model's p)")
    ap.add_argument("--timeout", type=float, default=900.0)
    return ap


@command("python -m megatron_paradyse.costmodel calibrate")
def main(argv=None):
    args = build_parser().parse_args(argv)
    writable_file(args.output, "-o")
    cm = FittedCostModel.load(args.model)
    if args.seq_length < cm.shape.p:
        raise UserError(f"--seq-length {args.seq_length} is shorter than p = {cm.shape.p}")
    budget = None if args.memory_budget is None else args.memory_budget * GiB
    cfg = config_for(cm, cells_for(cm, args.seq_length, budget), profiled_model_args(cm))
    t0 = time.perf_counter()
    rows = run_profile(cm.shape, cfg, nproc=args.nproc or (None if "WORLD_SIZE" in os.environ else cm.shape.p),
                       timeout=args.timeout)
    if not rows:  # a launched rank other than 0
        return 0
    out = apply(cm, factors(cm, rows[1:-1]), host=rows[0]["hardware"])
    out.meta["calibration"]["seconds"] = round(time.perf_counter() - t0, 1)
    save(out, args.output)
    print(f"wrote {args.output}: {summary(out)} ({time.perf_counter() - t0:.0f} s)")
    return 0


def profiled_model_args(cm: FittedCostModel) -> dict | None:
    """The model flags the model's profile was made with (its header's command, parsed by the
    profiler's parser) where that profile lies beside the model; else None: the profiler's
    flags for the shape."""
    import shlex

    from .profile import build_parser as profile_parser
    from .profile import read_profile

    rel = (cm.meta.get("profile") or {}).get("path")
    path = rel and os.path.join(os.path.dirname(os.path.abspath(cm.path)), rel)
    if not path or not os.path.isfile(path):
        return None
    try:
        words = shlex.split(read_profile(path)[0].get("command") or "")[4:]  # after "python -m ... profile"
        parsed, _ = profile_parser().parse_known_args(words)
    except Exception:  # noqa: BLE001 - an old or foreign header: the shape's flags
        return None
    return {k: getattr(parsed, k) for k in M.model_flag_names()}
