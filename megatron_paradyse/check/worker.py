"""The rank side of ``python -m megatron_paradyse.check``: the sections, in one world.

Every rank runs every section; rank 0 writes the lines to the JSON file after each section,
so a section that ends the job still leaves the ones before it. A rank that raises ends the
whole job within seconds (``training.faults.FailFast``), never a hang.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import os
import time

import torch
import torch.distributed as dist

from .. import cpu_compat
from ..device import current, select
from ..layout import ParallelDims
from ..model import ModelFlags, transformer_config
from ..parallel import attention_kernels as K
from ..parallel import kernel_select
from ..parallel.kernel_check import kernel_choices, kernel_families, packed_selfcheck, ring_blocks_selfcheck
from ..units import GiB
from . import comm, exactness, profile, timing, training
from .results import INFO, SKIP, Line, to_json

SECTIONS = ("env", "comm", "kernels", "exactness", "timing", "profile", "training")


@dataclasses.dataclass
class ExactSpec:
    """The exactness section's model: the check's model flags, dropout 0, CPU initialisation
    (every TP size holds shards of the same weights)."""

    args: argparse.Namespace
    num_layers: int
    seq: int
    batch: int = 2
    seed: int = 1234

    @property
    def vocab(self) -> int:
        return self.args.padded_vocab_size

    def config(self, tp: int, dtype):
        flags = dataclasses.replace(ModelFlags.from_flags(vars(self.args)), params_dtype=dtype, bf16=dtype == torch.bfloat16)
        return transformer_config(flags, ParallelDims(tp=tp, sequence_parallel=tp > 1), num_layers=self.num_layers,
                                  hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)


def env_lines(opts, notes, model_args) -> list:
    """What this world runs on (INFO lines)."""
    dev = current()
    lines = [Line("env", "device", INFO, f"{dev} ({torch.cuda.get_device_name(dev)}, "
                  f"{torch.cuda.get_device_properties(dev).total_memory / GiB:.0f} GiB)"
                  if dev.type == "cuda" else f"{dev}: {os.cpu_count()} cores"),
             Line("env", "world", INFO, f"{opts.world} rank(s), switching group p = {opts.p}, "
                  f"backend {opts.backend}"),
             Line("env", "torch", INFO, f"{torch.__version__}, CUDA {torch.version.cuda}, NCCL "
                  f"{'.'.join(map(str, torch.cuda.nccl.version())) if dev.type == 'cuda' else '-'}, "
                  f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')}")]
    found = []
    for mod in ("megatron.core", "flash_attn", "transformer_engine", "apex"):
        try:
            found.append(f"{mod} {getattr(importlib.import_module(mod), '__version__', '?')}")
        except Exception:  # noqa: BLE001 - absent or broken: say so
            found.append(f"{mod} absent")
    lines.append(Line("env", "packages", INFO, ", ".join(found)))
    head_dim = model_args.kv_channels or model_args.hidden_size // model_args.num_attention_heads
    dtypes = (torch.float32, torch.bfloat16) if dev.type == "cuda" else (torch.float32,)
    lines += [Line("env", "kernels", INFO, t) for t in kernel_choices(dev, head_dim, dtypes)]
    lines += [Line("env", "model", INFO, n) for n in notes]
    return lines


def kernel_lines(dtypes, head_dim: int = 64) -> list:
    """The ring's block kernels and, on a pack, the ring and the variable-length primitive,
    against a float64 reference on this device, with every kernel family the device takes."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
    lines = []
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        for family in kernel_families(current(), dtype):
            with kernel_select.only(family):
                r = ring_blocks_selfcheck(current(), dtype)
                worst = max(r[k] for k in ("out", "dq", "dk", "dv"))
                lines.append(Line.verdict("kernels", f"ring blocks {name} [{r['path']}]", worst < tol[dtype],
                                          f"out {r['out']:.1e} dq {r['dq']:.1e} dk {r['dk']:.1e} dv {r['dv']:.1e} "
                                          f"(vs float64; < {tol[dtype]:g})", **r))
                r = packed_selfcheck(current(), dtype)
                worst = max(e[k] for e in (r["ring"], r["varlen"]) for k in ("out", "dq", "dk", "dv"))
                lines.append(Line.verdict("kernels", f"packs {name} [{r['path']}]", worst < tol[dtype],
                                          f"ring and whole-pack worst {worst:.1e} (out/dq/dk/dv vs float64 inside "
                                          f"each document; < {tol[dtype]:g})", **r))
    return lines


def run(opts, model_argv: list, model_args, notes: list) -> list:
    """Every selected section in this world; returns the lines (rank 0 also writes them)."""
    lines: list = []
    rank0 = dist.get_rank() == 0

    def emit(new):
        lines.extend(new)
        if rank0:
            for x in new:
                print(f"[check] {x.section:<9} {x.name:<40} {x.status:<5} {x.detail}", flush=True)
            with open(opts.out + ".part", "w") as f:
                f.write(to_json(lines, {"world": opts.world, "p": opts.p, "backend": opts.backend}))
            os.replace(opts.out + ".part", opts.out)

    on_gpu = opts.backend == "nccl"
    if "env" in opts.sections:
        emit(env_lines(opts, notes, model_args))
    if "comm" in opts.sections:
        emit(comm.run(opts))
    if "kernels" in opts.sections:
        emit(kernel_lines([torch.float32, torch.bfloat16] if on_gpu else [torch.float32]))
    if "exactness" in opts.sections:
        spec = ExactSpec(model_args, num_layers=min(model_args.num_layers, opts.exact_layers),
                         seq=opts.exact_seq)
        for kernels in _kernel_settings():
            with kernels[1]():
                emit(exactness.check(spec, opts.p, bf16=on_gpu or opts.bf16_on_cpu, kernels=kernels[0]))
    if "timing" in opts.sections:
        emit(timing.run(model_args, opts))
    cost_model = None
    if "profile" in opts.sections:
        new, cost_model = profile.run(opts, model_argv)
        emit(new)
    if "training" in opts.sections:
        argv = training.trainer_argv(model_argv, opts.p, opts.world, opts.train_seq, opts.train_iters,
                                     opts.backend, cost_model, bf16=on_gpu)
        t0 = time.perf_counter()
        new = training.run(argv)
        new[-1].detail += f"; {time.perf_counter() - t0:.0f} s"
        emit(new)
    return lines


def _kernel_settings() -> list:
    """``(name, context manager)`` per attention-kernel setting to check: torch's kernels always,
    flash-attn too where it is installed."""
    settings = [("torch kernels", K.torch_kernels_only)]
    if K.FLASH_ATTN_VERSION:
        settings.append((f"flash-attn {K.FLASH_ATTN_VERSION}", K.default_kernels))
    return settings


def init_world(backend: str, timeout_s: float) -> None:
    """This process's device, then its process group (from torchrun's environment)."""
    select(backend)
    if backend == "gloo":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    cpu_compat.apply()


def skipped(section: str, why: str) -> Line:
    return Line(section, "-", SKIP, why)
