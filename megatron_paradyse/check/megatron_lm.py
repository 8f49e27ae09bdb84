"""The check's Megatron-LM section (launcher mode, ``MEGATRON_LM_PATH``): Megatron-LM's own
``pretrain_gpt.py`` through ``python -m megatron_paradyse.training.megatron_lm``, a few
iterations stock and with ``--paradyse`` (a length rule mixing strategies per layer and per
micro-batch), then both again under megatron's full recompute (the plugin's side also
recomputing layers of its own), in fp32: the per-iteration ``lm loss`` lines must agree
(Megatron-LM prints 7 significant digits)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from .results import FAIL, Line

ITERS = 6
TOL = 1e-5
PLAN = "rule:256=tp_sp,512=ulysses*2+colossal*2,768=ring*2+metp*2,tp_sp+ulysses+ring+metp"
# Megatron's full recompute on both sides; the plugin's side also recomputes layers of its own
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
PLAN_RC = "rule:256=tp_sp:rc,512=ulysses*2+colossal:rc*2,tp_sp+ring:rc+metp+ulysses:rc"


def flags(nproc: int, backend: str) -> list:
    """Megatron-LM flags of a small local-spec GPT on mock data, variable-length documents."""
    return [
        "--tensor-model-parallel-size", str(nproc), "--sequence-parallel", "--num-layers", "4",
        "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "1024",
        "--max-position-embeddings", "1024", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--lr", "1e-4", "--train-iters", str(ITERS), "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "255", "--transformer-impl", "local", "--distributed-backend", backend,
        "--no-gradient-accumulation-fusion", "--use-cpu-initialization", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--calculate-per-token-loss", "--no-create-attention-mask-in-dataloader",
        "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234", "--mock-data",
        "--paradyse-document-data",
    ]


def losses(out: str) -> dict:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|", out)}


def _launch(path: str, nproc: int, extra: list, env: dict, timeout: float):
    script = os.path.join(path, "pretrain_gpt.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "megatron_paradyse.training.megatron_lm", script, *extra]
    stub = os.environ.get("PARADYSE_MEGATRON_LM_STUB")  # tests: a checkout without megatron/legacy
    env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (path, stub, env.get("PYTHONPATH")) if p))
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return 124, (e.stdout or "") if isinstance(e.stdout, str) else ""
    return res.returncode, res.stdout + res.stderr


def _pair(path, nproc, base, plan, env, timeout):
    """Stock and ``--paradyse`` runs of ``base``: ``({name: losses}, None)`` or ``(None, Line)``."""
    runs = {}
    for name, extra in (("stock", []), ("paradyse", ["--paradyse", "--paradyse-plan", plan])):
        rc, out = _launch(path, nproc, base + extra, env, timeout=timeout)
        runs[name] = losses(out)
        if rc or len(runs[name]) < ITERS:
            return None, Line("megatron-lm", f"{name} run", FAIL,
                              f"exit status {rc}, {len(runs[name])} of {ITERS} iterations; last output: "
                              + " / ".join(out.strip().splitlines()[-3:])[-600:])
    return runs, None


def run(opts, nproc: int, env: dict) -> list:
    path = opts.megatron_lm
    if not os.path.isfile(os.path.join(path, "pretrain_gpt.py")):
        return [Line("megatron-lm", "pretrain_gpt.py", FAIL, f"{path} has no pretrain_gpt.py")]
    lines = []
    for label, extra, plan in (("", [], PLAN), (" with full recompute", RECOMPUTE, PLAN_RC)):
        runs, failed = _pair(path, nproc, flags(nproc, opts.backend) + extra, plan, env,
                             timeout=min(150.0, opts.timeout / 4))
        if failed:
            return lines + [failed]
        rel = max(abs(runs["paradyse"][i] - runs["stock"][i]) / abs(runs["stock"][i]) for i in runs["stock"])
        lines.append(Line.verdict(
            "megatron-lm", f"pretrain_gpt.py stock vs --paradyse{label} ({nproc} ranks)", rel < TOL,
            f"{ITERS} iterations, worst relative loss difference {rel:.1e} (< {TOL:g}); "
            f"loss {runs['stock'][1]:.4f} -> {runs['stock'][ITERS]:.4f}",
            stock=runs["stock"], paradyse=runs["paradyse"]))
    return lines
