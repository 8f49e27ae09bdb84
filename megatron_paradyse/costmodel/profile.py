"""The profiler: one decoder layer per strategy over a sweep of (s, b), on the real process
group or as one rank of a fake one; writes one JSON-lines file.

    python -m megatron_paradyse.costmodel profile --nproc 4 --hidden-size 128 \
        --num-attention-heads 8 --ffn-hidden-size 512 --num-layers 4 --vocab-size 258 \
        --seqs 128,256,512,1024,2048,4096 --batches 1,2 -o profile.jsonl

The model flags are the trainer's (``megatron_paradyse.model.add_model_args``: Megatron-LM
names, fusion switches included; defaults the demo's shape, RoPE, no dropout), and the profiled
layer is built by the trainer's builder from the same ``TransformerConfig``, on the rank's
device. Under ``torchrun`` (``WORLD_SIZE`` set) it uses the launched ranks (NCCL on GPUs, gloo
on CPU, ``--distributed-backend``; the device is selected before the process group starts);
else ``--nproc N`` spawns N gloo CPU ranks on this machine (``ranks.run_ranks``);
``--fake-world p --fake-rank r`` runs one process, on this machine's GPU where it has one, as
rank r of a fake p-rank group (compute and memory measured, communication time from
``configs/interconnects.json``).

Out of memory: whether a cell fits is decided by all ranks together (each reports, one
all-reduce MAX): a cell that ran out of memory on any rank is skipped on every rank, with a
``limit`` row, and its strategy goes no longer. On a GPU a length whose predicted one-layer
memory (scaled from the last measured length) exceeds the free device memory is not even
started. An OOM on one rank only, before a collective its peers already wait in, cannot be
rescued by any decision (they never reach it): the process group's timeout ends that job.

Lines: a header (``type: header``: shape, p, dtype, hardware, versions, mode, sweep, the packs'
totals and seed), then one ``type: layer`` line per (strategy, s, b) and one ``type: pack``
line per (strategy, pack) (``--packs``: its ``lengths``, padded total ``s``, index ``pack``;
the same fields otherwise; a reader that knows no packs skips these rows) with the median and spread of fwd+bwd time of the
whole layer (and, with ``--parts``, the attention and the MLP alone), saved and transient bytes (max over ranks); ``type:
limit`` where a strategy's sweep stopped (memory limit reached, or out of memory on GPU);
``type: kernel`` per (attention kernel class, s) (``kernels.py``: the class alone, fwd+bwd, at
the lengths its strategies measured; ``--no-kernels`` skips them);
``type: nonlayer`` per (s, b) (embedding, output layer and loss); ``type: optimizer`` once
(what a training step runs after its backward: gradient reduction and optimizer step, as
megatron-core training runs them, ``measure.TrainingUpdate``); ``type:
pool`` per strategy (and ``nonlayer``) at three (s, b): the communication pool's buffers one
micro-batch allocates (``{"name/dtype": bytes}``; ``--pool-only`` measures just these); ``type:
recompute`` per (strategy, s, b) of the recompute phase (``--no-recompute`` skips it): the layer
plain, checkpointed (``st:rc``) and with its attention or MLP block checkpointed (``st:rc-attn``,
``st:rc-mlp``), timed in the same rounds (``rc_times``, ``plain_times``, ``attn_times``, ``mlp_times``:
per round, the max over ranks; ``seconds``, ``plain_seconds``: medians), and the memory of
both (``saved_bytes``, ``transient_bytes``, ``plain_saved_bytes``, ``plain_transient_bytes``);
``--recompute-only`` runs this phase alone (``--append``: its rows go at the end of an
existing profile of the shape, after a ``type: section`` row); a footer with the duration. Progress and the estimated time left go to stderr.

Every (strategy, length) first gets its memory passes and a warm-up; then the timed repeats
run in rounds over all of them (alternating direction), so that a slow spell on a shared
machine spreads over every cell's repeats instead of shifting one strategy's medians; each
timed pass follows an untimed one of its own cell, as in training a pass follows one of its
size. This module is the launcher's side (the flags, :class:`ProfileConfig`, the ranks, the
merged file); ``sweep.py`` is what every rank runs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from importlib.metadata import version

import torch
import torch.distributed as dist

from .. import device
from ..errors import ArgumentParser, UserError, command
from ..cpu_compat import ALLOCATOR_ENV, RANK_ENV
from ..device import default_backend
from ..model import ModelArgsError
from ..parallel.strategies import STRATEGIES, supports
from ..paths import shown, shown_argv, writable_file
from . import measure as M
from .analytic import load_config
from .measure import add_model_flags
from .packs import random_packs
from .ranks import run_ranks
from .shape import ModelShape
from .sweep import rank_sweep

FORMAT = "paradyse-profile/1"


@dataclass(frozen=True)
class ProfileConfig:
    """What one profile sweeps and how, checked once here; it travels (pickled) to the ranks.

    ``model_args``: the model flags as parsed (``measure.add_model_flags``), uncompleted (each
    rank completes them for its device); None: the profiler's flags for the shape.
    ``memory_limit``: bytes per rank (a strategy's sweep stops where ``num_layers`` layers'
    saved + one transient would exceed it), or None. ``backend``: the ranks' (None: the
    machine's default, gloo for spawned ranks). ``fake_world``/``fake_rank``: one process
    plays a rank of a fake group, its communication time from ``interconnect`` (a key of
    ``configs/interconnects.json``, or of ``interconnect_path``). Rank 0 logs the progress
    (``sweep``'s logger; spawned ranks log as the process that started them). ``cells``: a
    calibration's (strategy, s) pairs, timed alone (``sweep._calibration_rows``: each until its
    time, ``time_stat`` of the passes, moves by less than ``stable`` between passes); the other
    phases are then not run."""

    seqs: tuple
    strategies: tuple
    batches: tuple = (1,)
    parts: tuple = ("layer",)
    warmup: int = 1
    repeats: int = 3
    memory_limit: float | None = None
    nonlayer: bool = True
    kernels: bool = True
    pool_only: bool = False
    backend: str | None = None
    fake_world: int | None = None
    fake_rank: int | None = None
    interconnect: str = "nvlink4"
    interconnect_path: str | None = None
    command: str | None = None
    model_args: dict | None = None
    packs: tuple = ()
    packs_per_length: int = 3
    pack_seed: int = 0
    recompute: bool = True
    recompute_only: bool = False
    recompute_seqs: tuple = ()
    recompute_points: int = 4
    cells: tuple = ()
    stable: float = 0.03
    time_stat: str = "median"

    def pack_shapes(self, p: int) -> list:
        """The profile's packs: ``packs.random_packs`` of the totals ``packs`` (fixed seed)."""
        return random_packs(self.packs, self.packs_per_length, self.pack_seed, p) if self.packs else []

    def __post_init__(self):
        for name in ("seqs", "strategies", "batches", "parts", "packs", "recompute_seqs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "cells", tuple((str(st), int(s)) for st, s in self.cells))
        for name in ("seqs", "batches"):
            values = getattr(self, name)
            if not values or any(int(v) != v or v < 1 for v in values):
                raise ValueError(f"--{name} must be positive integers, got {values}")
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad:
            raise ValueError(f"unknown strategies {bad}; known: {STRATEGIES}")
        if "layer" not in self.parts or set(self.parts) - {"layer", "attn", "mlp"}:
            raise ValueError("--parts must include 'layer' and only name layer, attn, mlp")
        if self.recompute_only and (self.pool_only or not self.recompute):
            raise ValueError("--recompute-only goes with neither --pool-only nor --no-recompute")
        if self.recompute_points < 1 or any(int(v) != v or v < 1 for v in self.recompute_seqs):
            raise ValueError("--recompute-points and --recompute-seqs must be positive integers")
        self._check_fake()

    def _check_fake(self):
        """The single-device mode's rank and interconnect."""
        if (self.fake_world is None) != (self.fake_rank is None):
            raise ValueError("--fake-world and --fake-rank go together")
        if self.fake_world is None:
            return
        if not 0 <= self.fake_rank < self.fake_world:
            raise ValueError(f"--fake-rank {self.fake_rank} is outside 0..{self.fake_world - 1}")
        nets = load_config("interconnects.json", self.interconnect_path)
        if self.interconnect not in nets:
            raise ValueError(f"unknown --interconnect {self.interconnect!r}; known: "
                             f"{sorted(k for k in nets if not k.startswith('_'))}")


def shape_of_flags(model_args: dict, p: int | None = None) -> ModelShape:
    """The ``ModelShape`` of model flag values (``measure.add_model_flags``'s names; completed on
    the CPU: the shape does not depend on the device)."""
    return M.shape_of(M.complete(model_args, p, torch.device("cpu")))


def parse_ints(text: str, what: str) -> list:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise UserError(f"{what} must be positive integers, got {text!r}")
    return sorted(set(vals))


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        out["megatron-core"] = version("megatron-core")
    except Exception:  # noqa: BLE001
        pass
    return out


def hardware(rank_env: dict | None = None, dev_type: str | None = None) -> dict:
    """The machine the ranks ran on, and their allocator settings (``cpu_compat.ALLOCATOR_ENV``
    as the ranks had it; ``rank_env``: what the spawned ranks started with; default this
    process's environment): CPU times of large tensors depend on them. ``dev_type``: the ranks' device
    (``"cuda"``: the GPU's name and memory are recorded; CPU ranks on a GPU host record none)."""
    env = os.environ if rank_env is None else {**os.environ, **rank_env}
    hw = {"machine": platform.machine(), "cpus": os.cpu_count(), "node": platform.node(),
          "device": dev_type, "allocator_env": {k: env.get(k) for k in ALLOCATOR_ENV}}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    hw["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if dev_type == "cuda":
        hw["gpu"] = torch.cuda.get_device_name()
        hw["gpu_memory"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return hw


def merge_ranks(per_rank: list) -> list:
    """One row per measurement: memory and median times are the max over ranks."""
    out = []
    for i, row in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        m = {k: v for k, v in row.items() if k != "rank"}
        for key in list(row):
            if key.endswith("_times"):
                part = key[:-6]
                meds = [statistics.median(r[key]) for r in rows]
                m[f"{part}_seconds"] = max(meds)
                all_t = [t for r in rows for t in r[key]]
                m[f"{part}_spread"] = (max(meds) - min(meds)) / max(meds) if max(meds) else 0.0
                m[f"{part}_times"] = [max(ts) for ts in zip(*[r[key] for r in rows])]
                m[f"{part}_min_seconds"] = min(all_t)
            elif key in ("saved_bytes", "transient_bytes", "buffer_bytes", "param_bytes", "plain_saved_bytes",
                         "plain_transient_bytes", "attn_saved_bytes", "attn_transient_bytes", "mlp_saved_bytes",
                         "mlp_transient_bytes"):
                m[key] = max(r[key] for r in rows)
            elif key == "buffers":
                names = sorted({n for r in rows for n in r[key]})
                m[key] = {n: max(r[key].get(n, 0) for r in rows) for n in names}
        if row.get("type") in ("layer", "pack"):
            m["seconds"] = m["layer_seconds"] + m.get("comm_seconds", 0.0)
            m["saved_by_rank"] = [r["saved_bytes"] for r in rows]
            m["transient_by_rank"] = [r["transient_bytes"] for r in rows]
        if row.get("type") == "nonlayer":
            m["seconds"] = m["nonlayer_seconds"]
        if row.get("type") == "calibration":
            m["seconds"] = m["layer_seconds"]
        if row.get("type") == "recompute":  # st:rc's times and the plain layer's, round by round
            m["seconds"] = m["rc_seconds"]
        out.append(m)
    return out


def profile_mode(cfg: ProfileConfig, nproc: int | None = None) -> str:
    """``"fake"`` (one process, a fake group), ``"torchrun"`` (the launched ranks) or ``"spawn"``
    (gloo CPU ranks started here)."""
    if cfg.fake_world:
        return "fake"
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ and nproc is None:
        return "torchrun"
    return "spawn"


def rank_backend(mode: str, cfg: ProfileConfig) -> str:
    """The backend whose device the ranks compute on (``device.select``): spawned ranks are gloo
    (CPU); launched ranks and the single-device mode default to this machine's
    (``device.default_backend()``: NCCL and the GPU where there is one)."""
    backend = cfg.backend
    if mode == "spawn":
        if backend not in (None, "gloo"):
            raise ValueError(f"spawned ranks are gloo (CPU) ranks; launch with torchrun for {backend}")
        return "gloo"
    return backend or default_backend()


def unsupported(shape: ModelShape, cfg: ProfileConfig, dev_type: str = "cpu") -> str | None:
    """Why this profile cannot run on ranks computing on ``dev_type`` (checked before any rank
    starts), or None."""
    if shape.dtype != "fp32" and cfg.nonlayer and dev_type != "cuda":
        return (f"a {shape.dtype} profile measures a training step's update with megatron's mixed-precision "
                "optimizer, which needs CUDA tensors: on CPU profile fp32, or give --no-nonlayer to "
                "measure the layers alone")
    return None


def run_profile(shape: ModelShape, cfg: ProfileConfig, nproc: int | None = None, out: str | None = None,
                timeout: float = 3600) -> list:
    """Profile ``shape``; returns the merged rows (header first) and writes ``out`` if given.

    ``cfg.model_args`` (optional): the model flags as parsed (``measure.add_model_flags``),
    which must describe ``shape``; default the profiler's flags for ``shape``."""
    t0 = time.time()
    mode = profile_mode(cfg, nproc)
    backend = rank_backend(mode, cfg)
    dev_type = "cuda" if backend == "nccl" else "cpu"
    why = unsupported(shape, cfg, dev_type)
    if why:
        raise ValueError(why)
    cfg, done = _with_model_args(shape, cfg, dev_type)
    per_rank = _sweep_ranks(mode, backend, shape, cfg, nproc, timeout)
    if per_rank is None:
        return []
    rows = merge_ranks(per_rank)
    header = _header(shape, cfg, mode, dev_type, done, t0)
    footer = {"type": "footer", "duration_s": round(time.time() - t0, 1)}
    allrows = [header] + rows + [footer]
    if out:
        _write_rows(out, allrows)
    return allrows


def _with_model_args(shape: ModelShape, cfg: ProfileConfig, dev_type: str) -> tuple:
    """``(cfg, completed flags)``: ``cfg`` holding its model flags (default the profiler's for
    ``shape``), checked to describe ``shape`` once completed for ``dev_type``."""
    margs = cfg.model_args
    if margs is None:
        margs = vars(M.model_args_for_shape(shape))
    cfg = replace(cfg, model_args=dict(margs))
    done = M.complete(cfg.model_args, shape.p, torch.device(dev_type), max_seq=max(cfg.seqs))
    if M.shape_of(done) != shape:
        raise ValueError(f"the model flags describe {M.shape_of(done).describe()}, not {shape.describe()}")
    return cfg, done


def _sweep_ranks(mode: str, backend: str, shape: ModelShape, cfg: ProfileConfig, nproc, timeout) -> list | None:
    """Every rank's rows (``sweep.rank_sweep``), on the ranks ``mode`` names; None on launched
    ranks other than 0 (rank 0 gathers them)."""
    if mode == "fake":
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            raise UserError("--fake-world runs in one process; do not launch it with torchrun")
        return run_ranks(rank_sweep, 1, shape.key(), cfg, timeout=timeout, backend="fake", fake_device=backend)
    if mode == "spawn":
        return run_ranks(rank_sweep, nproc or shape.p, shape.key(), cfg, timeout=timeout)
    if not dist.is_initialized():
        device.select(backend)  # nccl: this rank's GPU, set before NCCL starts; gloo: the CPU
        dist.init_process_group(backend)
    elif dist.get_backend() != backend:
        raise ValueError(f"torch.distributed runs {dist.get_backend()}, not {backend}")
    rows = rank_sweep(dist.get_rank(), dist.get_world_size(), shape.key(), cfg)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, rows)
    return per_rank if dist.get_rank() == 0 else None


def _header(shape: ModelShape, cfg: ProfileConfig, mode: str, dev_type: str, done, t0: float) -> dict:
    """The first line: shape, mode, machine, versions, the completed model flags, the sweep."""
    return {"type": "header", "format": FORMAT, "shape": shape.key(), "p": shape.p, "dtype": shape.dtype,
            "mode": mode, "fake_rank": cfg.fake_rank, "interconnect": cfg.interconnect if mode == "fake" else None,
            "hardware": hardware(None if mode == "torchrun" else RANK_ENV, dev_type),
            "versions": versions(), "model": M.describe_model(done),
            "warmup": cfg.warmup, "repeats": cfg.repeats,
            "seqs": list(cfg.seqs), "batches": list(cfg.batches), "strategies": list(cfg.strategies),
            "packs": list(cfg.packs), "packs_per_length": cfg.packs_per_length, "pack_seed": cfg.pack_seed,
            "memory_limit": cfg.memory_limit, "kernels": cfg.kernels, "command": cfg.command,
            "recompute": cfg.recompute, "recompute_only": cfg.recompute_only,
            "recompute_seqs": list(cfg.recompute_seqs), "recompute_points": cfg.recompute_points,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0))}


class ProfileFileError(UserError, ValueError):
    """A profile file that is missing, truncated, corrupt or not a profile."""


def _write_rows(out: str, rows: list) -> None:
    """JSON lines, through a temporary file replaced at once (its folder made first)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, out)


def read_profile(path: str) -> tuple[dict, list]:
    """``(header, rows)`` of a profile file; a :class:`ProfileFileError` for a broken one."""
    if not os.path.isfile(path):
        raise ProfileFileError(f"profile {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError:
        raise ProfileFileError(f"profile {path!r} is not a text file of JSON lines") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ProfileFileError(f"profile {path!r} line {i} is not valid JSON ({exc}): truncated or "
                                   "corrupt") from None
    if not rows or not isinstance(rows[0], dict) or rows[0].get("type") != "header" \
            or rows[0].get("format") != FORMAT:
        raise ProfileFileError(f"profile {path!r} does not start with a {FORMAT} header line")
    return rows[0], rows[1:]


def build_parser() -> argparse.ArgumentParser:
    """The profiler's command line: the trainer's model flags (``measure.add_model_flags``) and
    the sweep's."""
    ap = ArgumentParser(prog="python -m megatron_paradyse.costmodel profile",
                                 description="Profile one decoder layer per strategy over a sweep of lengths.")
    add_model_flags(ap)
    ap.add_argument("--nproc", type=int, default=None, help="spawn this many gloo ranks (default: p)")
    ap.add_argument("--distributed-backend", dest="backend", choices=("nccl", "gloo"), default=None,
                    help="under torchrun: the ranks' backend (default nccl where CUDA is present); "
                         "--fake-world: nccl plays a GPU rank, gloo a CPU one; spawned ranks are gloo")
    ap.add_argument("--fake-world", type=int, default=None, help="single-device mode: p of the fake group")
    ap.add_argument("--fake-rank", type=int, default=None, help="single-device mode: the rank played")
    ap.add_argument("--interconnect", default="nvlink4", help="key of configs/interconnects.json (fake mode)")
    ap.add_argument("--interconnect-config", default=None, help="your own interconnects JSON")
    ap.add_argument("--seqs", default="128,256,512,1024,2048,4096")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--packs", default="",
                    help="comma-separated pack totals T: per total, --packs-per-length deterministic random "
                         "packs (many short documents, log-uniform lengths, one long among short ones) are "
                         "profiled per strategy at b = 1 (`pack` rows; `fit` and `report` use them)")
    ap.add_argument("--packs-per-length", type=int, default=3)
    ap.add_argument("--pack-seed", type=int, default=0)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--parts", default="layer",
                    help="which passes to time: layer, and for information attn, mlp (the fit uses the "
                         "layer's; each part adds a pass to every timed visit)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory-limit", default=None,
                    help="bytes per rank (suffix G/M allowed); a strategy's sweep stops where num_layers "
                         "layers' saved + one transient would exceed it")
    ap.add_argument("--no-nonlayer", action="store_true")
    ap.add_argument("--no-kernels", action="store_true",
                    help="skip the attention kernel calibration (`kernel` rows: each kernel class alone at the "
                         "profiled lengths; `fit` takes the attention rates from them)")
    ap.add_argument("--pool-only", action="store_true",
                    help="measure only the communication pool (seconds): its rows can be added to an "
                         "older profile with a second PROFILE argument to `fit`")
    ap.add_argument("--no-recompute", action="store_true",
                    help="skip the recompute phase (`recompute` rows: per strategy at a few lengths, the layer "
                         "plain and checkpointed, `st:rc`, timed in the same rounds, and both memories; `fit` "
                         "prices `:rc` plan entries from them)")
    ap.add_argument("--recompute-only", action="store_true",
                    help="run the recompute phase alone, at --seqs (or --recompute-seqs) up to the memory limit; "
                         "with --append its rows go at the end of -o, an existing profile of this shape")
    ap.add_argument("--recompute-seqs", default="",
                    help="the recompute phase's lengths (default: up to --recompute-points spread over each "
                         "strategy's lengths that fit)")
    ap.add_argument("--recompute-points", type=int, default=4)
    ap.add_argument("--append", action="store_true",
                    help="with --recompute-only: append the rows to -o, an existing profile of the same shape "
                         "and model flags, after a `section` row (its command, start, duration)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("-o", "--output", required=True)
    return ap


def _command(argv) -> str:
    """How this profile was asked for, without the machine's absolute paths."""
    return "python -m megatron_paradyse.costmodel profile " + shown_argv(sys.argv[1:] if argv is None else argv)


@command("python -m megatron_paradyse.costmodel profile")
def main(argv=None):
    """The profiler's command line: checks every flag (and that ``-o`` can be written) before
    any rank starts, then profiles."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.append and not args.recompute_only:
        ap.error("--append goes with --recompute-only")
    if args.append and not os.path.isfile(args.output):  # before -o's folder is made
        ap.error(f"--append: profile {shown(args.output)!r} does not exist")
    writable_file(args.output, "-o")
    try:  # the sweep the flags ask for
        cfg = ProfileConfig(
            seqs=parse_ints(args.seqs, "--seqs"), batches=parse_ints(args.batches, "--batches"),
            strategies=[s for s in args.strategies.split(",") if s], parts=[x for x in args.parts.split(",") if x],
            packs=parse_ints(args.packs, "--packs") if args.packs.strip() else (),
            packs_per_length=args.packs_per_length, pack_seed=args.pack_seed,
            warmup=args.warmup, repeats=args.repeats, memory_limit=_bytes(args.memory_limit),
            nonlayer=not (args.no_nonlayer or args.recompute_only),
            kernels=not (args.no_kernels or args.recompute_only),
            pool_only=args.pool_only, backend=args.backend, recompute=not args.no_recompute,
            recompute_only=args.recompute_only, recompute_points=args.recompute_points,
            recompute_seqs=parse_ints(args.recompute_seqs, "--recompute-seqs") if args.recompute_seqs.strip() else (),
            fake_world=args.fake_world, fake_rank=args.fake_rank, interconnect=args.interconnect,
            interconnect_path=args.interconnect_config, command=_command(argv),
            model_args={k: getattr(args, k) for k in M.model_flag_names()})
    except ValueError as e:
        ap.error(str(e))
    p = _world_p(ap, cfg, args.nproc)
    nproc = None if args.fake_world else (args.nproc or (None if "WORLD_SIZE" in os.environ else p))
    mode = profile_mode(cfg, nproc)
    try:
        backend = rank_backend(mode, cfg)
    except ValueError as e:
        ap.error(str(e))
    dev_type = "cuda" if backend == "nccl" else "cpu"
    shape = _checked_shape(ap, cfg, p, dev_type)
    if args.append:
        base = _appendable(args.output, shape, cfg, dev_type)
    t0 = time.time()
    rows = run_profile(shape, cfg, nproc=nproc, out=None if args.append else args.output, timeout=args.timeout)
    if rows and args.append:
        append_section(args.output, base, rows)
    if rows and cfg.recompute_only:
        n = sum(1 for r in rows if r.get("type") == "recompute")
        print(f"{'appended to' if args.append else 'wrote'} {args.output}: {n} recompute measurements of "
              f"{shape.describe()} in {time.time() - t0:.0f} s")
    elif rows:
        n = sum(1 for r in rows if r.get("type") == "layer")
        k = sum(1 for r in rows if r.get("type") == "pool")
        np_ = sum(1 for r in rows if r.get("type") == "pack")
        print(f"wrote {args.output}: {n} layer, {np_} pack and {k} pool measurements of {shape.describe()} in "
              f"{time.time() - t0:.0f} s")


def _appendable(path: str, shape: ModelShape, cfg: ProfileConfig, dev_type: str) -> dict:
    """The header of ``path``, an existing profile that rows measured with ``cfg`` may join: the
    same shape and model (norm, position embedding, fusions: the header's ``model``), profiled
    on the same kind of device; a :class:`ProfileFileError` naming the difference otherwise."""
    header, rows = read_profile(path)
    if header.get("shape") != shape.key():
        raise ProfileFileError(f"--append: profile {path!r} is of another shape ({header.get('shape')}), "
                               f"not {shape.key()}")
    _, done = _with_model_args(shape, cfg, dev_type)
    mine = json.loads(json.dumps(M.describe_model(done)))
    theirs = header.get("model")
    diff = sorted(k for k in set(mine) | set(theirs or {}) if mine.get(k) != (theirs or {}).get(k)
                  # the RoPE table's length is the longest --seqs of each run, not a model property
                  and not (k == "max_position_embeddings" and mine.get("position_embedding_type") == "rope"))
    if theirs is not None and diff:
        raise ProfileFileError(f"--append: profile {path!r} was measured with other model flags ({diff})")
    if (header.get("hardware") or {}).get("device", dev_type) != dev_type:
        raise ProfileFileError(f"--append: profile {path!r} was measured on {header['hardware']['device']}, "
                               f"not {dev_type}")
    if any(r.get("type") == "recompute" for r in rows):
        raise ProfileFileError(f"--append: profile {path!r} has recompute rows already")
    return header


def append_section(path: str, header: dict, rows: list) -> None:
    """``rows`` (a profile of its own: header, measurements, footer) appended to the profile
    ``path`` as a ``section`` row (what was run, when, how long, on which machine and with
    which allocator settings) and the measurements; the file is replaced at once."""
    head, body, foot = rows[0], rows[1:-1], rows[-1]
    _, old = read_profile(path)
    section = {"type": "section", "phase": "recompute", "command": head.get("command"),
               "started": head.get("started"), "duration_s": foot.get("duration_s"),
               "hardware": head.get("hardware"), "versions": head.get("versions"),
               "repeats": head.get("repeats"), "memory_limit": head.get("memory_limit"),
               "recompute_seqs": head.get("recompute_seqs"), "recompute_points": head.get("recompute_points")}
    _write_rows(path, [header] + old + [section] + body)


def _world_p(ap, cfg: ProfileConfig, nproc: int | None) -> int:
    """p, the group the layer runs over, and the flags that must agree with it (``--nproc``,
    the model's flags in ``cfg.model_args``, ``cfg.seqs``)."""
    m, seqs = cfg.model_args, cfg.seqs
    p = (cfg.fake_world or m["tensor_model_parallel_size"] or nproc
         or int(os.environ.get("WORLD_SIZE", 0)) or None)
    if p is None:
        ap.error("give --tensor-model-parallel-size (or --nproc / --fake-world)")
    if nproc and nproc != p:
        ap.error(f"--nproc {nproc} differs from p = {p}: the layer runs over the whole world")
    if (m["num_query_groups"] is not None and not m["group_query_attention"]
            and m["num_query_groups"] != m["num_attention_heads"]):
        ap.error(f"--num-query-groups {m['num_query_groups']} without --group-query-attention: Megatron-LM "
                 "(and the trainer) would ignore it and build multi-head attention; add "
                 "--group-query-attention to profile grouped-query attention")
    bad_s = [s for s in seqs if s % p]
    if bad_s:
        ap.error(f"sequence lengths {bad_s} are not divisible by p={p}")
    if (m["position_embedding_type"] == "learned_absolute" and m["max_position_embeddings"] is not None
            and max(seqs) > m["max_position_embeddings"]):
        ap.error(f"--seqs up to {max(seqs)} exceed --max-position-embeddings {m['max_position_embeddings']}")
    return p


def _checked_shape(ap, cfg: ProfileConfig, p: int, dev_type: str) -> ModelShape:
    """The model's shape, its flags completed as the ranks will complete them for their device,
    every strategy able to run it and the profile able to run there."""
    if dev_type == "cuda" and not torch.cuda.is_available():
        ap.error("--distributed-backend nccl needs CUDA, which this machine does not have")
    try:
        done = M.complete(cfg.model_args, p, torch.device(dev_type), max_seq=max(cfg.seqs))
        config = M.model_config(done)
    except (ModelArgsError, ValueError) as e:
        ap.error(str(e))
    shape = M.shape_of(done)
    for st in cfg.strategies:
        ok, why = supports(st, config, p)
        if not ok:
            ap.error(f"strategy {st} cannot run this model at p={p}: {why}")
    why = unsupported(shape, cfg, dev_type)
    if why:
        ap.error(why)
    return shape


def _bytes(v):
    """``"6G"``, ``"512M"``, ``"1e9"`` to bytes (None stays None)."""
    if v is None:
        return None
    text = str(v).strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}.get(text[-1:], 1)
    try:
        n = float(text[:-1] if mult > 1 else text) * mult
    except ValueError:
        raise UserError(f"--memory-limit {v!r} is not a size (e.g. 6G, 512M, 1e9)") from None
    if n <= 0:
        raise UserError(f"--memory-limit must be positive, got {v!r}")
    return n
