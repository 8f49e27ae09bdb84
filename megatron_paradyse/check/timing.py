"""The check's timing section: each strategy's forward + backward time and achieved TFLOP/s on
this node, at a few lengths and on one pack, with and without weight prefetch.

The model is the check's own, cut to its first ``--timing-layers`` decoder layers (bf16 on
GPUs, fp32 on CPU ranks); one micro-batch ``[1, s]`` runs forward, loss and backward (no
optimizer step), as a training micro-batch does. Per cell: untimed warm-up passes, then timed
ones (ranks aligned by a barrier and the device synchronised around each); the median, then
the slowest rank's. Where ``megatron_paradyse.parallel.prefetch`` imports (weight prefetch,
on by default), every repeat also runs under ``prefetch.disabled()``, interleaved.

FLOPs per rank: ``costmodel.analytic.layer_flops`` per layer (the project's analytic count,
the busiest rank, ``metp``'s backward recompute counted) plus the output layer's standard
``6*T*h*V/p``. Timings are INFO lines, never judged; one line checks that every measurement
is finite and positive.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import statistics
import time

import torch
import torch.distributed as dist

from .. import device
from ..costmodel import analytic
from ..costmodel.measure import complete, free_after_oom, model_config, packed_params, shape_of
from ..costmodel.ranks import init_parallel
from ..costmodel.shape import ModelShape
from ..model import build_gpt_for
from ..parallel.dispatch import install, set_plan
from ..parallel.packing import PackShape
from ..parallel.strategies import STRATEGIES, supports
from .results import INFO, SKIP, Line

SECTION = "timing"
SEED = 1234
PREFETCH = "megatron_paradyse.parallel.prefetch"


def parse_seqs(text: str, p: int) -> list:
    """``--timing-seqs``: a comma list of positive lengths, each divisible by p (ValueError)."""
    try:
        seqs = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--timing-seqs must be a comma list of lengths, got {text!r}") from None
    bad = [s for s in seqs if s < 1 or s % p]
    if not seqs or bad:
        raise ValueError(f"--timing-seqs needs positive lengths divisible by p={p}, got {text!r}")
    return seqs


def pack_of(tokens: int, p: int) -> PackShape:
    """A pack of ``tokens`` in documents of a few lengths (halving: T/2, T/4, ...), padded to p."""
    lengths, left = [], tokens
    while left > max(tokens // 16, 1):
        lengths.append(left // 2 or left)
        left -= lengths[-1]
    return PackShape(tuple(lengths + [left] if left else lengths)).padded(p)


def passes(on_gpu: bool, quick: bool) -> tuple:
    """``(warm-up, repeats)`` per cell; ``--quick`` (CI's sanity run) times one pass."""
    return (2, 5) if on_gpu else (1, 1) if quick else (1, 5)


def prefetch_modes() -> tuple:
    """``([(label, context factory)], note)``: the plugin's default, and without weight prefetch
    where ``megatron_paradyse.parallel.prefetch`` imports."""
    if importlib.util.find_spec(PREFETCH) is None:
        return [("", contextlib.nullcontext)], f"{PREFETCH} not available: timed as the plugin runs by default only"
    from ..parallel import prefetch  # a module that is there but fails to import is an error

    return [("", contextlib.nullcontext), ("no prefetch", prefetch.disabled)], \
        "each cell with weight prefetch (the default) and without (prefetch.disabled())"


def build(model_args, p: int, layers: int, on_gpu: bool, max_tokens: int) -> tuple:
    """``(shape, config, model)``: the check's model with ``layers`` layers at TP = p on this device."""
    done = complete({**vars(model_args), "num_layers": layers, "bf16": on_gpu, "max_position_embeddings": max_tokens}, p)
    init_parallel(p, seed=SEED)
    install()
    config = model_config(done, hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False)
    return shape_of(done), config, build_gpt_for(done.flags, config, seed=done.seed)


def batch(s, vocab: int) -> tuple:
    """``(tokens, position_ids, labels, lengths or None)`` of one row of ``s`` tokens (an int)
    or of the pack ``s`` (in-document positions), on this device, the same on every rank."""
    lengths = s.lengths if isinstance(s, PackShape) else None
    T = s.tokens if lengths else int(s)
    g = torch.Generator().manual_seed(T)
    tokens = torch.randint(0, vocab, (1, T + 1), generator=g)
    pos = torch.cat([torch.arange(d) for d in lengths]) if lengths else torch.arange(T)
    dev = device.current()
    return tokens[:, :-1].to(dev), pos.unsqueeze(0).to(dev), tokens[:, 1:].to(dev), lengths


def one_pass(model, b) -> None:
    """Forward, loss and backward of one micro-batch (a pack's parameters made afresh, as each
    training micro-batch brings its own)."""
    tokens, pos, labels, lengths = b
    kw = {"packed_seq_params": packed_params(lengths, tokens.device)} if lengths else {}
    model(tokens, pos, None, labels=labels, **kw).float().sum().backward()


def time_cell(model, b, modes, warmup: int, repeats: int) -> list:
    """Seconds per mode: the median of ``repeats`` after ``warmup``, the slowest rank's."""
    times = [[] for _ in modes]
    for i in range(warmup + repeats):
        for k, (_, ctx) in enumerate(modes):
            with ctx():
                dist.barrier()
                device.synchronize()
                t0 = time.perf_counter()
                one_pass(model, b)
                device.synchronize()
                if i >= warmup:
                    times[k].append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64, device=device.current())
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.tolist()


def flops(strategy: str, shape: ModelShape, s, layers: int) -> float:
    """fwd+bwd FLOPs per rank (module docstring)."""
    T = s.tokens if isinstance(s, PackShape) else int(s)
    return layers * analytic.layer_flops(strategy, shape, s, 1) + 6.0 * T * shape.hidden * shape.vocab / shape.p


def cell_line(strategy: str, s, secs: list, modes, fl: float) -> Line:
    """One INFO line: time and TFLOP/s per mode."""
    name = f"{strategy} pack T={s.tokens} ({s.num_docs} docs)" if isinstance(s, PackShape) else f"{strategy} s={s}"
    parts = [f"{label + ' ' if label else ''}{t * 1e3:.3g} ms, {fl / t / 1e12:.3g} TFLOP/s"
             for (label, _), t in zip(modes, secs)]
    ms = {label or "default": t * 1e3 for (label, _), t in zip(modes, secs)}
    return Line(SECTION, name, INFO, "; ".join(parts), {"strategy": strategy, "tokens": int(getattr(s, "tokens", s)),
                                                        "ms": ms, "flops": fl})


def sanity_line(lines: list, seconds: float) -> Line:
    """PASS when every timing is finite and positive; ``seconds``: the section's duration."""
    bad = [x.name for x in lines if x.status == INFO and "ms" in x.data
           and not all(math.isfinite(v) and v > 0 for v in x.data["ms"].values())]
    n = sum(len(x.data["ms"]) for x in lines if "ms" in x.data)
    return Line.verdict(SECTION, "measurements", n > 0 and not bad,
                        (f"{n} timings finite and positive" if not bad else f"not finite or not positive: {bad}")
                        + f" (section {seconds:.0f} s)", seconds=seconds)


def header_lines(what: str, warmup: int, repeats: int, note: str) -> list:
    """The setup and prefetch INFO lines."""
    return [Line(SECTION, "setup", INFO, f"{what}: forward + loss + backward of one micro-batch, median of "
                 f"{repeats} after {warmup} warm-up, slowest rank; TFLOP/s per rank from the analytic FLOPs "
                 "(costmodel.analytic.layer_flops, metp's recompute counted) + the output layer's 6*T*h*V/p"),
            Line(SECTION, "prefetch", INFO, note)]


def run(model_args, opts) -> list:
    """The section's lines (the same on every rank)."""
    t0, on_gpu = time.perf_counter(), opts.backend == "nccl"
    seqs = parse_seqs(opts.timing_seqs, opts.p)
    layers = min(model_args.num_layers, opts.timing_layers)
    cells = seqs + [pack_of(max(seqs), opts.p)]
    shape, config, model = build(model_args, opts.p, layers, on_gpu, max(seqs) + opts.p)
    modes, note = prefetch_modes()
    warmup, repeats = passes(on_gpu, opts.quick)
    lines = header_lines(f"{layers} layer(s) of the check's model, {shape.dtype}, p = {opts.p}", warmup, repeats, note)
    for st in STRATEGIES:
        ok, why = supports(st, config, opts.p)
        if not ok:
            lines.append(Line(SECTION, st, SKIP, why))
            continue
        set_plan(model, st)
        for s in cells:
            secs = time_cell(model, batch(s, model_args.vocab_size), modes, warmup, repeats)
            lines.append(cell_line(st, s, secs, modes, flops(st, shape, s, layers)))
    del model
    free_after_oom()  # not an OOM: the same release (pool, garbage, CUDA cache) for the sections after
    return lines + [sanity_line(lines, time.perf_counter() - t0)]
