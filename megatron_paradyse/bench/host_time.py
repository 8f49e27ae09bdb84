"""Host time per micro-batch at long packs: what the plugin spends in Python and on the CPU
outside the kernels, per micro-batch and per layer.

    python -m megatron_paradyse.bench.host_time                       # 64K tokens per rank, p = 1
    python -m megatron_paradyse.bench.host_time --p 1,2 --json runs/host_time.json
    python -m megatron_paradyse.bench.host_time --device cuda --bf16   # on a GPU (p = 1)
    python -m megatron_paradyse.bench.host_time --p 2 --skip-world --steps   # a step's own host work

Two tables, each cell the median over ``--repeats`` after ``--warmup``, every repeat a new pack
(the same lengths shuffled: what the caches of one micro-batch cannot reuse for the next):

* the pack's host-side layout, in this process: megatron's ``cu_seqlens`` read into
  ``Documents``, RoPE positions of the whole pack (new, and again: what a later layer pays), the
  ring strategies' ``PackedLayout``, its kernel and score blocks, hops and re-layout plan;
* a whole micro-batch (forward, loss, backward of a tiny GPT: hidden ``--hidden``, so kernel
  time is small and host time dominates) under each strategy at ``--layers`` 1 and 4: ``per
  layer`` is the slope, ``per micro-batch`` the rest. On CPU gloo ranks (``--p``); with
  ``--device cuda`` one process on the GPU (p > 1 then runs in a fake group: no communication).

A step whose analytic layer memory exceeds ``--max-gib`` (colossal's score rows at long packs)
is skipped and said so. Layout code that is not there (it is being reworked) prints ``n/a``.

``--steps`` adds a third: the planner's trainer on packs (CPU ranks, TP = p), per step the host
work at the step's start (reading, planning and checking its micro-batches: on a GPU the device
idles through it) with that work done at the start, and read ahead while the step before runs
(``--paradyse-no-read-ahead`` off, the default).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

from .. import device
from ..costmodel import analytic
from ..costmodel.measure import build, init_fake, packed_params
from ..costmodel.shape import ModelShape
from ..errors import ArgumentParser, UserError, command
from ..launch import run_ranks
from ..parallel import pack_layout, packing
from ..parallel.dispatch import set_plan
from ..parallel.strategies import STRATEGIES
from ..paths import writable_file

PROG = "python -m megatron_paradyse.bench.host_time"
QUIET = {"PYTHONWARNINGS": "ignore"}  # megatron's and torch's deprecation warnings, once per rank


@dataclasses.dataclass(frozen=True)
class HostConfig:
    """What one run measures (checked by :func:`parse`)."""

    tokens: int = 65536          # per rank
    doc_len: int = 32            # mean document length
    ps: tuple = (1,)
    layers: tuple = (1, 4)
    strategies: tuple = STRATEGIES
    hidden: int = 16
    heads: int = 2
    repeats: int = 5
    warmup: int = 1
    device: str = "cpu"
    bf16: bool = False
    max_gib: float = 4.0
    seed: int = 0

    def total(self, p: int) -> int:
        return self.tokens * p


def doc_lengths(total: int, mean: int, seed: int) -> list:
    """Document lengths uniform in ``1 .. 2*mean-1`` summing to ``total`` (deterministic)."""
    rng, out, left = random.Random(seed), [], total
    while left > 0:
        out.append(min(rng.randint(1, 2 * mean - 1), left))
        left -= out[-1]
    return out


def packs(cfg: HostConfig, p: int) -> list:
    """``warmup + repeats`` packs of ``cfg.total(p)`` tokens: one set of lengths, shuffled anew each time."""
    base = doc_lengths(cfg.total(p), cfg.doc_len, cfg.seed)
    out = []
    for i in range(cfg.warmup + cfg.repeats):
        x = list(base)
        random.Random(cfg.seed + 1 + i).shuffle(x)
        out.append(x)
    return out


def median_ms(fn, inputs: list, warmup: int, sync=lambda: None) -> float:
    """Median milliseconds of ``fn(x)`` over ``inputs`` after the first ``warmup``."""
    times = []
    for i, x in enumerate(inputs):
        sync()
        t0 = time.perf_counter()
        fn(x)
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- the layout, host only


def _bounds(lengths) -> tuple:
    out = [0]
    for d in lengths:
        out.append(out[-1] + d)
    return tuple(out)


def _positions_twice(docs):
    docs.positions([(0, docs.total)])
    return docs


def layout_ops(p: int) -> list:
    """``(name, prepare, fn)``: ``prepare(lengths)`` builds the input outside the clock."""
    Docs, PL = packing.Documents, pack_layout.PackedLayout
    return [
        ("cu_seqlens -> Documents (documents_from)", lambda ls: packed_params(ls),
         lambda prm: packing.documents_from(prm, prm.cu_seqlens_q[-1].item())),
        ("Documents.positions, whole pack, new", lambda ls: Docs(_bounds(ls)),
         lambda d: d.positions([(0, d.total)])),
        ("Documents.positions, whole pack, again", lambda ls: _positions_twice(Docs(_bounds(ls))),
         lambda d: d.positions([(0, d.total)])),
        (f"PackedLayout(p={p}, docs)", lambda ls: Docs(_bounds(ls)), lambda d: PL(p, d)),
        ("kernel_blocks of rank 0, every source", lambda ls: PL(p, Docs(_bounds(ls))),
         lambda lay: [lay.kernel_blocks(0, s) for s in range(p)]),
        ("score_blocks of rank 0, every source", lambda ls: PL(p, Docs(_bounds(ls))),
         lambda lay: [lay.score_blocks(0, s) for s in range(p)]),
        ("last_hops", lambda ls: PL(p, Docs(_bounds(ls))), lambda lay: lay.last_hops()),
        ("moves_plan of rank 0", lambda ls: PL(p, Docs(_bounds(ls))), lambda lay: lay.moves_plan(0)),
        ("rope_positions of rank 0", lambda ls: PL(p, Docs(_bounds(ls))), lambda lay: lay.rope_positions(0)),
    ]


def layout_rows(cfg: HostConfig, p: int) -> list:
    """``(name, ms or None, note)`` per layout operation; code that is not there: None."""
    rows, ls = [], packs(cfg, p)
    for name, prepare, fn in _safe_ops(p):
        try:
            rows.append((name, median_ms(fn, [prepare(x) for x in ls], cfg.warmup), ""))
        except (AttributeError, TypeError, ImportError) as e:
            rows.append((name, None, f"n/a: {type(e).__name__}: {e}"))
    return rows


def _safe_ops(p: int) -> list:
    try:
        return layout_ops(p)
    except (AttributeError, ImportError) as e:
        return [("layout", lambda ls: ls, _raiser(e))]


def _raiser(e):
    def fn(_):
        raise e
    return fn


# ---- a whole micro-batch, in a world


def shape_for(cfg: HostConfig, p: int, layers: int) -> ModelShape:
    return ModelShape(num_layers=layers, hidden=cfg.hidden, heads=cfg.heads, query_groups=cfg.heads,
                      ffn=4 * cfg.hidden, swiglu=False, bias=True, vocab=128 * p, p=p,
                      dtype="bf16" if cfg.bf16 else "fp32")


def fits(cfg: HostConfig, shape: ModelShape, st: str, lengths) -> bool:
    """Whether the analytic layer memory of ``st`` on this pack is within ``cfg.max_gib``."""
    saved, trans = analytic.layer_memory(st, shape, packing.PackShape(tuple(lengths)), 1)
    return (saved + trans) / 2 ** 30 <= cfg.max_gib


def batch(lengths, vocab: int) -> tuple:
    """``(tokens, positions, labels, params)`` of one pack on this device."""
    T, dev = sum(lengths), device.current()
    tokens = torch.randint(0, vocab, (1, T + 1), generator=torch.Generator().manual_seed(T))
    pos = torch.cat([torch.arange(d) for d in lengths]).unsqueeze(0)
    return tokens[:, :-1].to(dev), pos.to(dev), tokens[:, 1:].to(dev), lengths


def one_pass(model, b) -> None:
    """Forward, loss, backward of one micro-batch; its ``PackedSeqParams`` made here, as a
    training micro-batch brings its own."""
    tokens, pos, labels, lengths = b
    params = packed_params(lengths, tokens.device)
    model(tokens, pos, None, labels=labels, packed_seq_params=params).float().sum().backward()


def _aligned():
    if dist.get_backend() != "fake":
        dist.barrier()
    device.synchronize()


def strategy_ms(cfg: HostConfig, model, shape, ls: list) -> dict:
    """``{strategy: ms or None (skipped)}`` of one micro-batch, the slowest rank's."""
    out = {}
    inputs = [batch(x, shape.vocab) for x in ls]
    for st in cfg.strategies:
        if not fits(cfg, shape, st, ls[0]):
            out[st] = None
            continue
        set_plan(model, st)
        out[st] = median_ms(lambda b: one_pass(model, b), inputs, cfg.warmup, _aligned)
    if dist.get_backend() != "fake":
        vals = torch.tensor([v or 0.0 for v in out.values()], dtype=torch.float64)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        out = {k: (v if out[k] is not None else None) for k, v in zip(out, vals.tolist())}
    return out


def layer_world(rank: int, world: int, cfg: HostConfig, p: int) -> dict:
    """``{layers: {strategy: ms}}`` in this world (gloo ranks, or one fake-group process)."""
    if cfg.device == "cuda":
        init_fake(0, p)
    torch.manual_seed(cfg.seed)
    ls, out = packs(cfg, p), {}
    for n in cfg.layers:
        shape = shape_for(cfg, p, n)
        _, model = build(shape, num_layers=n, max_seq=cfg.total(p), seed=cfg.seed)
        out[n] = strategy_ms(cfg, model, shape, ls)
        del model
    return out


def world_rows(cfg: HostConfig, p: int) -> dict:
    """Run :func:`layer_world` on ``p`` gloo ranks, or one process on the GPU."""
    if cfg.device == "cuda":
        return run_ranks(layer_world, 1, cfg, p, backend="fake", fake_device="nccl", timeout=3000, env=QUIET)[0]
    return run_ranks(layer_world, p, cfg, p, timeout=3000, env=QUIET)[0]


# ---- a training step's own host work: reading, planning, the plan check


STEP_ARGV = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "1024",
             "--max-position-embeddings", "1024", "--vocab-size", "128", "--micro-batch-size", "1",
             "--global-batch-size", "8", "--lr", "1e-3", "--attention-dropout", "0", "--hidden-dropout", "0",
             "--position-embedding-type", "rope", "--mock-data", "--paradyse-mock-min-length", "64",
             "--log-interval", "1000", "--sequence-parallel", "--paradyse", "--paradyse-memory-budget", "1",
             "--paradyse-pack", "balanced", "--paradyse-pack-tokens", "1024"]


def step_world(rank: int, world: int, cfg: HostConfig, read_ahead: bool) -> dict:
    """The planner's trainer at TP = ``world`` on packs: per step, the host work at the step's
    start (reading, planning and checking its micro-batches before the first forward: the GPU
    idles through it) and the host work read ahead while the step before ran."""
    from ..training import arguments, trainer as training

    steps = cfg.warmup + cfg.repeats
    argv = STEP_ARGV + ["--tensor-model-parallel-size", str(world), "--train-iters", str(steps),
                        "--seed", str(cfg.seed)] + ([] if read_ahead else ["--paradyse-no-read-ahead"])
    tr = training.Trainer(arguments.parse_args(argv, world_size=world))
    tr._read_ahead_until = steps
    start, ahead = [], []
    for _ in range(steps):
        tr.train_step()
        start.append(tr.data_iterator.critical_seconds * 1e3)
        ahead.append(tr.data_iterator.ahead_seconds * 1e3 if read_ahead else 0.0)
        tr.data_iterator.ahead_seconds = 0.0
    w = cfg.warmup
    return {"at start": statistics.median(start[w:]), "read ahead": statistics.median(ahead[w:])}


def step_rows(cfg: HostConfig, p: int) -> dict:
    """``{"read at the step's start" | "read ahead": {"at start", "read ahead"} ms}`` on ``p`` gloo ranks."""
    out = {}
    for label, on in (("read at the step's start", False), ("read ahead", True)):
        out[label] = run_ranks(step_world, p, cfg, on, timeout=3000, env=QUIET)[0]
    return out


def step_table(steps: dict) -> str:
    out = [f"{'a step (planner, packs)':<28} {'ms at its start':>16} {'ms read ahead':>14}"]
    out += [f"{label:<28} {v['at start']:>16.1f} {v['read ahead']:>14.1f}" for label, v in steps.items()]
    return "\n".join(out)


# ---- report


def split(times: dict) -> tuple:
    """``(per layer, per micro-batch)`` ms from ``{layers: ms}`` (slope between the extremes)."""
    lo, hi = min(times), max(times)
    if lo == hi or times[lo] is None or times[hi] is None:
        return None, None
    slope = (times[hi] - times[lo]) / (hi - lo)
    return slope, times[lo] - lo * slope


def header(cfg: HostConfig, p: int) -> str:
    """One line: the pack, the model, the device."""
    T = cfg.total(p)
    n = len(doc_lengths(T, cfg.doc_len, cfg.seed))
    return (f"p = {p}: a pack of {T} tokens ({cfg.tokens} per rank), {n} documents (mean {T / n:.0f}), "
            f"{cfg.device}, hidden {cfg.hidden}, {cfg.heads} heads, median of {cfg.repeats} after {cfg.warmup}")


def layout_table(layout: list) -> str:
    """The layout operations' medians."""
    out = [f"{'layout (host only)':<44} {'ms':>9}"]
    out += [f"{name:<44} {ms:>9.2f}" if ms is not None else f"{name:<44} {note}" for name, ms, note in layout]
    return "\n".join(out)


def world_table(cfg: HostConfig, p: int, world: dict) -> str:
    """Per strategy: ms at each layer count, the per-layer slope, the rest, the slope per document."""
    docs = len(doc_lengths(cfg.total(p), cfg.doc_len, cfg.seed))
    cols = " ".join(f"{'L=' + str(k) + ' ms':>10}" for k in cfg.layers)
    out = [f"{'micro-batch fwd+loss+bwd':<24} {cols} {'per layer':>10} {'per mb':>10} {'us/doc/layer':>12}"]
    for st in cfg.strategies:
        t = {k: world[k][st] for k in cfg.layers}
        if any(v is None for v in t.values()):
            out.append(f"{st:<24} skipped: analytic layer memory over {cfg.max_gib:g} GiB")
            continue
        per_layer, rest = split(t)
        out.append(f"{st:<24} " + " ".join(f"{v:>10.1f}" for v in t.values())
                   + (f" {per_layer:>10.1f} {rest:>10.1f} {per_layer * 1e3 / docs:>12.1f}"
                      if per_layer is not None else ""))
    return "\n".join(out)


# ---- command line


def build_parser() -> argparse.ArgumentParser:
    d = HostConfig()
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--tokens", type=int, default=d.tokens, help="tokens per rank in the pack")
    ap.add_argument("--doc-len", type=int, default=d.doc_len, help="mean document length")
    ap.add_argument("--p", default="1", help="comma list of switching group sizes")
    ap.add_argument("--layers", default="1,4", help="comma list of layer counts (two or more: the slope is per layer)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16 model (GPU)")
    ap.add_argument("--max-gib", type=float, default=d.max_gib, help="skip a strategy whose analytic layer memory is over this")
    ap.add_argument("--skip-world", action="store_true", help="the layout table only")
    ap.add_argument("--steps", action="store_true",
                    help="also time a training step's own host work (reading, planning, the plan "
                         "check) at its start, read at the start and read ahead (CPU ranks)")
    ap.add_argument("--json", default=None, help="also write every number here")
    return ap


def _ints(text: str, flag: str) -> tuple:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{flag} must be a comma list of integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise UserError(f"{flag} needs positive integers, got {text!r}")
    return out


def parse(argv) -> tuple:
    """``(HostConfig, args)``; a bad flag is a UserError."""
    a = build_parser().parse_args(argv)
    sts = tuple(s.strip() for s in a.strategies.split(",") if s.strip())
    bad = [s for s in sts if s not in STRATEGIES]
    if bad or not sts:
        raise UserError(f"--strategies: unknown {bad or sts}; known: {', '.join(STRATEGIES)}")
    for flag, v in (("--tokens", a.tokens), ("--doc-len", a.doc_len), ("--hidden", a.hidden),
                    ("--heads", a.heads), ("--repeats", a.repeats)):
        if v < 1:
            raise UserError(f"{flag} must be at least 1, got {v}")
    if a.hidden % a.heads or a.doc_len > a.tokens or a.warmup < 0:
        raise UserError("--hidden must be divisible by --heads, --doc-len at most --tokens, --warmup >= 0")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda needs CUDA")
    cfg = HostConfig(a.tokens, a.doc_len, _ints(a.p, "--p"), _ints(a.layers, "--layers"), sts, a.hidden,
                     a.heads, a.repeats, a.warmup, a.device, a.bf16, a.max_gib)
    if any(a.heads % p for p in cfg.ps):
        raise UserError(f"--heads {a.heads} must be divisible by every --p")
    if a.json:
        a.json = writable_file(a.json, "--json")  # its folder made now, before any measuring
    return cfg, a


@command(PROG)
def main(argv=None) -> int:
    cfg, a = parse(sys.argv[1:] if argv is None else argv)
    result = {"config": dataclasses.asdict(cfg), "p": {}}
    for p in cfg.ps:
        layout = layout_rows(cfg, p)
        world = {} if a.skip_world else world_rows(cfg, p)
        steps = step_rows(cfg, p) if a.steps else {}
        result["p"][p] = {"layout": layout, "world": world, "steps": steps}
        parts = [header(cfg, p), layout_table(layout)] + ([world_table(cfg, p, world)] if world else [])
        parts += [step_table(steps)] if steps else []
        print("\n\n".join(parts) + "\n", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
