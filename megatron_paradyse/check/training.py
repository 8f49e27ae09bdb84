"""The check's training section: steps of ``pretrain_gpt_paradyse.py``'s trainer with the planner
under the default budget (what the device can hand out), each step's predicted time and peak
beside the measured ones (allocated, and reserved on GPU), no out-of-memory error."""
from __future__ import annotations

import statistics

import torch.distributed as dist

from ..parallel.plans import describe
from ..training.arguments import parse_args
from ..training.trainer import Trainer
from ..units import MiB
from .results import Line


def trainer_argv(model_argv: list, p: int, world: int, seq: int, iters: int, backend: str,
                 cost_model: str | None, bf16: bool) -> list:
    """The trainer's flags: the check's model flags, then what this section fixes."""
    argv = list(model_argv) + [
        "--tensor-model-parallel-size", str(p), "--sequence-parallel",
        "--micro-batch-size", "1", "--global-batch-size", str(2 * (world // p)),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq),
        "--train-iters", str(iters), "--lr", "1e-4", "--lr-warmup-iters", "1", "--mock-data",
        "--paradyse-mock-min-length", str(max(p, seq // 64)), "--log-interval", "1",
        "--distributed-backend", backend, "--paradyse", "--hidden-dropout", "0", "--attention-dropout", "0"]
    if bf16:
        argv.append("--bf16")
    if cost_model:
        argv += ["--paradyse-cost-model", cost_model]
    return argv


def run(argv: list) -> list:
    """Train ``argv``'s steps; the section's lines (every rank returns the same verdicts). The
    trainer logs as the check's ``--verbose`` set up (``__main__``)."""
    args = parse_args(argv, world_size=dist.get_world_size())
    trainer = Trainer(args)
    rows = []
    while trainer.iteration < args.train_iters:
        stats, _ = trainer.measured_step()
        rows.append(dict(trainer.last_measure, loss=stats.loss, seq=list(stats.seq_lengths),
                         plans=[list(x) if x else None for x in stats.plans]))
    return _lines(rows, trainer)


def _lines(rows: list, trainer) -> list:
    budget = rows[0]["budget"]
    over = [r for r in rows if r["peak"] > budget]
    t_err = statistics.median(abs(r["pred_seconds"] - r["seconds"]) / r["seconds"] for r in rows[1:] or rows)
    m_err = statistics.median(abs(r["pred_peak"] - r["peak"]) / max(r["peak"], 1.0) for r in rows)
    peak = max(r["peak"] for r in rows)
    reserved = [r["peak_reserved"] for r in rows if r["peak_reserved"] is not None]
    res_text = f", reserved {max(reserved) / MiB:.0f} MiB" if reserved else ""
    plans = sorted({_describe(p) for r in rows for p in r["plans"] if p})
    return [
        Line.verdict("training", f"{len(rows)} planned steps", not over,
                     f"peak {peak / MiB:.0f} MiB allocated{res_text} vs budget {budget / MiB:.0f} MiB "
                     f"(margin {rows[0]['margin'] / MiB:.0f}); {len(over)} step(s) over; no OOM",
                     rows=rows),
        Line("training", "predictions", "INFO",
             f"median |pred-meas|/meas: time {100 * t_err:.0f}% (first step left out), peak {100 * m_err:.1f}%; "
             f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; plans {', '.join(plans[:4])}"
             + (" ..." if len(plans) > 4 else "")),
    ]


def _describe(plan) -> str:
    return describe(tuple(plan))
