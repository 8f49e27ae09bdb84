"""The check's profile section: a short profile of the checked model in this world (the
profiler's own command line, ``python -m megatron_paradyse.costmodel profile``), a fit with
one length held out, and the fitted model's error there. The fitted model is what the
training section then plans with."""
from __future__ import annotations

import os
import statistics
import tempfile

import torch.distributed as dist

from ..costmodel import fit as F
from ..costmodel import profile as P
from ..costmodel import report as R
from ..costmodel.fitted import FittedCostModel
from ..costmodel.profile import read_profile
from .results import INFO, Line

TIME_TOL = 30.0      # % mean over strategies: a short profile (2 repeats) on a busy node
MEMORY_TOL = 10.0    # % per strategy, saved and transient bytes


def run(opts, model_argv: list) -> tuple:
    """``(lines, cost model path on this rank or None)``; every rank returns the same lines."""
    seqs = [int(x) for x in opts.profile_seqs.split(",")]
    held = seqs[len(seqs) // 2] if len(seqs) >= 3 else None
    out_dir = os.path.dirname(os.path.abspath(opts.out))
    prof = os.path.join(out_dir, "check_profile.jsonl")
    # the recompute phase off: the check stays as long as it was sized (the profile's tests cover it)
    argv = list(model_argv) + ["--tensor-model-parallel-size", str(opts.p), "--seqs", opts.profile_seqs,
                               "--repeats", "2", "--warmup", "1", "--no-recompute", "-o", prof]
    if opts.backend == "nccl":
        argv.append("--bf16")
    P.main(argv)  # under torchrun: this world's ranks; rank 0 writes the profile
    payload = [None]
    if dist.get_rank() == 0:
        payload = [_fit_and_score(prof, held)]
    dist.broadcast_object_list(payload, src=0)
    result = payload[0]
    path = _write_local(result["model"])
    return _lines(result, held, seqs), path


def _fit_and_score(prof: str, held) -> dict:
    model_path = os.path.splitext(prof)[0] + ".model.json"
    F.fit_profile(prof, model_path, holdout_seqs=(held,) if held else ())
    model = FittedCostModel.load(model_path)
    _, rows = read_profile(prof)
    errs = R.layer_errors(model, rows, profiled=R.fitted_points(model)) if held else {}
    with open(model_path) as f:
        meta = f.read()
    dur = next((r["duration_s"] for r in rows if r.get("type") == "footer"), None)
    return {"model": meta, "errors": {st: {k: v for k, v in d["interp"].items()} for st, d in errs.items()},
            "duration_s": dur, "strategies": list(model.strategies)}


def _write_local(meta: str) -> str:
    """The fitted model's metadata in a file of this rank's own (ranks on other nodes may not
    share the check's output folder)."""
    fd, path = tempfile.mkstemp(prefix="paradyse_check_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(meta)
    return path


def _lines(result: dict, held, seqs) -> list:
    dur = result.get("duration_s")
    lines = [Line("profile", "sweep", INFO, f"{len(result['strategies'])} strategies x {len(seqs)} lengths "
                  f"({','.join(map(str, seqs))}) in {dur:.0f} s" if dur else "profiled")]
    if not held or not result["errors"]:
        return lines + [Line("profile", "held-out error", INFO, "too few lengths to hold one out")]
    errs = result["errors"]
    t = {st: statistics.fmean(e["seconds"]) for st, e in errs.items() if e["seconds"]}
    m = {st: max(max(e["saved_bytes"] or [0]), max(e["transient_bytes"] or [0])) for st, e in errs.items()}
    worst_m = max(m, key=m.get)
    lines.append(Line.verdict("profile", f"time at held-out s={held}", statistics.fmean(t.values()) <= TIME_TOL,
                              ", ".join(f"{st} {v:.0f}%" for st, v in t.items())
                              + f" (mean <= {TIME_TOL:g}%)", errors=t))
    lines.append(Line.verdict("profile", f"memory at held-out s={held}", m[worst_m] <= MEMORY_TOL,
                              f"worst {worst_m} {m[worst_m]:.1f}% (saved and transient <= {MEMORY_TOL:g}%)",
                              errors=m))
    return lines

