"""``python -m megatron_paradyse.check``: what a GPU user runs first, on the devices it finds.

    python -m megatron_paradyse.check                      # launches its own world (torchrun)
    python -m megatron_paradyse.check --nproc 8 --hidden-size 4096 --num-attention-heads 32 ...
    torchrun --nproc-per-node 8 -m megatron_paradyse.check  # or inside your own launcher
    MEGATRON_LM_PATH=/path/to/Megatron-LM python -m megatron_paradyse.check

Sections: ``env`` (what runs), ``kernels`` (the ring's block kernels against float64),
``exactness`` (every strategy and three mixed plans, one recomputing layers, against stock
megatron-core TP = 1 on the same weights, fp32 and, on GPUs, bf16; with torch's kernels and with flash-attn where
installed), ``timing`` (each strategy's forward + backward time and TFLOP/s at a few lengths and
on one pack, with and without weight prefetch where the plugin has it), ``profile`` (a short
profile and fit of the model, error on a held-out length),
``training`` (planned steps under the default budget: peaks beside predictions, no OOM) and,
launched with ``MEGATRON_LM_PATH``, ``megatron-lm`` (Megatron-LM's own ``pretrain_gpt.py``
with and without ``--paradyse``: equal losses). Model flags are Megatron-LM's
(``megatron_paradyse.model``); unknown ones are an error. Prints a table and writes a JSON
file (``--out``); exits 1 if any line fails, 2 on bad flags, 124 when the world times out.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from .. import logs
from ..errors import ArgumentParser, UserError, command
from ..paths import writable_file
from ..cpu_compat import RANK_ENV
from ..device import default_backend
from ..model import ModelArgsError, add_model_args
from ..training.model_args import complete_model_args
from ..training.faults import FailFast
from . import megatron_lm, timing, worker
from .results import FAIL, Line, failed, from_json, table, to_json
from .worker import SECTIONS

# The model checked unless flags say otherwise: Llama-like (RMSNorm, SwiGLU, GQA, RoPE, no bias)
GPU_MODEL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--group-query-attention", "--num-query-groups", "8", "--vocab-size", "32000"]
CPU_MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "8",
             "--group-query-attention", "--num-query-groups", "4", "--vocab-size", "500"]
COMMON_MODEL = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
                "--hidden-dropout", "0", "--attention-dropout", "0"]


class CheckArgsError(UserError, ValueError):
    """A bad flag of the check or of the model, found before anything is launched."""


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m megatron_paradyse.check", allow_abbrev=False,
                                 description=__doc__.split("\n\n")[0])
    g = ap.add_argument_group("the check")
    g.add_argument("--nproc", type=int, default=None,
                   help="ranks to launch (default: every GPU with nccl, 2 CPU ranks with gloo)")
    g.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="nccl on GPUs (default where CUDA is present), gloo on CPU ranks")
    g.add_argument("--tp", type=int, default=None, help="switching group size p (default: the world)")
    g.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {','.join(SECTIONS)}")
    g.add_argument("--quick", action="store_true",
                   help="the short CPU form CI runs: fewer lengths and steps")
    g.add_argument("--out", default="runs/check/check.json", help="the JSON file of every line")
    g.add_argument("--timeout", type=float, default=1500.0, help="seconds before the world is ended")
    g.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM_PATH"),
                   help="a Megatron-LM checkout: also compare its pretrain_gpt.py with and without "
                        "--paradyse (default $MEGATRON_LM_PATH; launcher mode only)")
    g.add_argument("--exact-seq", type=int, default=None, help="exactness: tokens per sequence")
    g.add_argument("--exact-layers", type=int, default=4, help="exactness: decoder layers (at most)")
    g.add_argument("--train-seq", type=int, default=None, help="training: the longest sequence")
    g.add_argument("--train-iters", type=int, default=None, help="training: steps")
    g.add_argument("--profile-seqs", default=None, help="profile: comma list of lengths")
    g.add_argument("--timing-seqs", default=None,
                   help="timing: comma list of lengths (default 2048,4096,8192 on GPUs; the longest "
                        "also as a pack)")
    g.add_argument("--timing-layers", type=int, default=None,
                   help="timing: decoder layers of the model timed (at most; default 4, 2 with --quick)")
    g.add_argument("--bf16-on-cpu", action="store_true", help="exactness in bf16 on CPU ranks too")
    g.add_argument("--verbose", action="store_true", help="print the trainer's and profiler's logs")
    return ap


def complete(opts, world: int) -> None:
    """Defaults that depend on the device and the world."""
    opts.backend = opts.backend or default_backend()
    on_gpu = opts.backend == "nccl"
    opts.world = world
    opts.p = opts.tp or world
    opts.sections = [s.strip() for s in opts.sections.split(",") if s.strip()]
    unknown = set(opts.sections) - set(SECTIONS) - {"megatron-lm"}
    if unknown:
        raise CheckArgsError(f"unknown section(s) {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    if on_gpu and not torch.cuda.is_available():
        raise CheckArgsError("--backend nccl needs CUDA; use --backend gloo")
    q = opts.quick
    opts.exact_seq = opts.exact_seq or (64 if q else 256 if not on_gpu else 1024)
    opts.train_seq = opts.train_seq or (256 if q else 1024 if not on_gpu else 16384)
    opts.train_iters = opts.train_iters or (4 if q else 20)
    # four lengths or more (one is held out; memory models need three), long enough that the
    # quadratic terms show on the CPU
    opts.profile_seqs = opts.profile_seqs or ("256,512,768,1024" if q else "256,512,768,1024,1536,2048"
                                              if not on_gpu else "1024,2048,4096,8192,16384")
    opts.timing_seqs = opts.timing_seqs or ("64,128" if q else "256,512,1024" if not on_gpu else "2048,4096,8192")
    if opts.timing_layers is None:
        opts.timing_layers = 2 if q else 4
    try:
        timing.parse_seqs(opts.timing_seqs, opts.p)
    except ValueError as e:
        raise CheckArgsError(str(e)) from None
    if opts.timing_layers < 1:
        raise CheckArgsError(f"--timing-layers must be at least 1, got {opts.timing_layers}")


def model_flags(opts, rest: list) -> list:
    """The model's flags: the check's defaults for the device, then the user's."""
    return (GPU_MODEL if opts.backend == "nccl" else CPU_MODEL) + COMMON_MODEL + list(rest)


def parse_model(argv: list, opts):
    """Completed model flags (``megatron_paradyse.model``) for TP = p; (args, notes)."""
    ap = add_model_args(ArgumentParser(prog="python -m megatron_paradyse.check", allow_abbrev=False))
    args = ap.parse_args(argv)  # an unknown flag: a UserError, one line and exit status 2
    args.tensor_model_parallel_size, args.sequence_parallel, args.seed = opts.p, opts.p > 1, 1234
    try:
        notes = complete_model_args(args, opts.p, torch.device("cuda" if opts.backend == "nccl" else "cpu"))
    except ModelArgsError as e:
        raise CheckArgsError(str(e)) from None
    return args, notes


def worker_main(opts, rest: list) -> int:
    """Under torchrun: run the sections in this world."""
    argv = model_flags(opts, rest)
    model_args, notes = parse_model(argv, opts)
    writable_file(opts.out, "--out")  # every rank, before the world: rank 0 writes it at the end
    worker.init_world(opts.backend, opts.timeout)
    with FailFast(prog=PROG):
        lines = worker.run(opts, argv, model_args, notes)
        dist.barrier()
    rank = dist.get_rank()
    dist.destroy_process_group()
    if os.environ.get("PARADYSE_CHECK_LAUNCHED"):
        return 0  # the launcher reads the verdict from the JSON file
    if rank == 0:
        print(table(lines), flush=True)
    return 1 if failed(lines) else 0


def launch(opts, rest: list) -> int:
    """Not under torchrun: launch the world, then Megatron-LM's script, then print the table."""
    nproc = opts.nproc
    writable_file(opts.out, "--out")
    if os.path.exists(opts.out):
        os.remove(opts.out)
    env = dict(os.environ, PARADYSE_CHECK_LAUNCHED="1", PYTHONUNBUFFERED="1",
               PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore"))
    if opts.backend == "gloo":
        env.update(RANK_ENV)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "megatron_paradyse.check", *_worker_argv(opts, rest)]
    t0 = time.perf_counter()
    code = _run(cmd, env, opts.timeout)
    lines = from_json(open(opts.out).read())[1] if os.path.exists(opts.out) else []
    if code:
        lines.append(Line("world", f"{nproc} rank(s)", FAIL,
                          "timed out" if code == 124 else f"exit status {code} (tracebacks above)"))
    if opts.megatron_lm:
        lines += megatron_lm.run(opts, nproc, env)
    print(table(lines), flush=True)
    print(f"({time.perf_counter() - t0:.0f} s; every line in {opts.out})", flush=True)
    with open(opts.out, "w") as f:
        f.write(to_json(lines, {"world": nproc, "backend": opts.backend}))
    return 124 if code == 124 else (1 if failed(lines) or code else 0)


def _worker_argv(opts, rest: list) -> list:
    """The check's flags for the launched ranks (completed here), then the model flags."""
    argv = ["--backend", opts.backend, "--sections", ",".join(opts.sections), "--out", opts.out,
            "--timeout", str(opts.timeout), "--exact-seq", str(opts.exact_seq),
            "--exact-layers", str(opts.exact_layers), "--train-seq", str(opts.train_seq),
            "--train-iters", str(opts.train_iters), "--profile-seqs", opts.profile_seqs,
            "--timing-seqs", opts.timing_seqs, "--timing-layers", str(opts.timing_layers)]
    argv += ["--tp", str(opts.tp)] if opts.tp else []
    argv += [f for f, on in (("--quick", opts.quick), ("--bf16-on-cpu", opts.bf16_on_cpu),
                             ("--verbose", opts.verbose)) if on]
    return argv + list(rest)


def _run(cmd, env, timeout) -> int:
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        return 124


PROG = "python -m megatron_paradyse.check"


@command(PROG)
def main(argv=None) -> int:
    """The check: launched here (a world of its own) or under torchrun; a user's mistake is one
    line and exit status 2 (``errors``)."""
    return _main(argv)


def _main(argv=None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    opts, rest = build_parser().parse_known_args(raw)
    logs.setup(logging.INFO if opts.verbose else logging.WARNING)
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:  # under torchrun
        complete(opts, int(os.environ.get("WORLD_SIZE", "1")))
        return worker_main(opts, rest)
    opts.backend = opts.backend or default_backend()
    opts.nproc = opts.nproc or (torch.cuda.device_count() if opts.backend == "nccl" else 2)
    complete(opts, opts.nproc)
    parse_model(model_flags(opts, rest), opts)  # bad model flags: an error before any launch
    return launch(opts, rest)


if __name__ == "__main__":
    sys.exit(main())
