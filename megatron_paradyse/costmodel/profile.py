"""The profiler: one decoder layer per strategy over a sweep of (s, b), on the real process
group or as one rank of a fake one; writes one JSON-lines file.

    python -m megatron_paradyse.costmodel profile --nproc 4 --hidden-size 128 \
        --num-attention-heads 8 --ffn-hidden-size 512 --num-layers 4 --vocab-size 258 \
        --seqs 128,256,512,1024,2048,4096 --batches 1,2 -o profile.jsonl

Under ``torchrun`` (``WORLD_SIZE`` set) it uses the launched ranks (NCCL on GPUs, gloo on
CPU); else ``--nproc N`` spawns N gloo ranks on this machine (megatron_paradyse.testing.spawn);
``--fake-world p --fake-rank r`` runs in this one process as rank r of a fake p-rank group
(compute and memory measured, communication time from ``configs/interconnects.json``).

Lines: a header (``type: header``: shape, p, dtype, hardware, versions, mode, sweep), then one
``type: layer`` line per (strategy, s, b) with the median and spread of fwd+bwd time of the
whole layer, the attention and the MLP, saved and transient bytes (max over ranks); ``type:
limit`` where a strategy's sweep stopped (memory limit reached, or out of memory on GPU);
``type: nonlayer`` per (s, b) (embedding, output layer and loss); ``type: optimizer`` once
(what a training step runs after its backward: gradient reduction and optimizer step, as
megatron-core training runs them, ``measure.TrainingUpdate``); ``type:
pool`` per strategy (and ``nonlayer``) at three (s, b): the communication pool's buffers one
micro-batch allocates (``{"name/dtype": bytes}``; ``--pool-only`` measures just these); a footer
with the duration. Progress and the estimated time left go to stderr.

Every (strategy, length) first gets its memory passes and a warm-up; then the timed repeats
run in rounds over all of them (alternating direction), so that a slow spell on a shared
machine spreads over every cell's repeats instead of shifting one strategy's medians; each
timed pass follows an untimed one of its own cell, as in training a pass follows one of its
size.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from .shape import ModelShape, pad_vocab

FORMAT = "paradyse-profile/1"


def add_shape_args(ap):
    g = ap.add_argument_group("model shape (Megatron-LM flag names)")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=8)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--vocab-size", type=int, default=258, help="unpadded; padded like megatron")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--tensor-model-parallel-size", "--p", dest="p", type=int, default=None)
    g.add_argument("--bf16", action="store_true")


def shape_from_args(args, p: int) -> ModelShape:
    return ModelShape(num_layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
                      query_groups=args.num_query_groups or args.num_attention_heads,
                      ffn=args.ffn_hidden_size or 4 * args.hidden_size, swiglu=args.swiglu,
                      bias=not args.disable_bias_linear,
                      vocab=pad_vocab(args.vocab_size, p, args.make_vocab_size_divisible_by), p=p,
                      dtype="bf16" if args.bf16 else "fp32")


def parse_ints(text: str, what: str) -> list:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {what} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise SystemExit(f"error: {what} must be positive integers, got {text!r}")
    return sorted(set(vals))


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        from importlib.metadata import version

        out["megatron-core"] = version("megatron-core")
    except Exception:  # noqa: BLE001
        pass
    return out


def hardware(rank_env: dict | None = None) -> dict:
    """The machine, and ``THP_MEM_ALLOC_ENABLE`` as the ranks had it (``rank_env``: what the
    spawned ranks started with; default this process's environment): CPU times of large
    tensors depend on it (``cpu_compat.RANK_ENV``)."""
    import torch

    env = os.environ if rank_env is None else {**os.environ, **rank_env}
    hw = {"machine": platform.machine(), "cpus": os.cpu_count(), "node": platform.node(),
          "thp_mem_alloc_enable": env.get("THP_MEM_ALLOC_ENABLE")}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    hw["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if torch.cuda.is_available():
        hw["gpu"] = torch.cuda.get_device_name()
        hw["gpu_memory"] = torch.cuda.get_device_properties(0).total_memory
    return hw


def _is_oom(exc) -> bool:
    import torch

    return isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(exc).lower()


def repeats_for(repeats: int, tokens: int) -> int:
    """More repeats for short passes (the same on every rank: collectives stay in step)."""
    return repeats * max(1, min(4, 1024 // max(tokens, 1)))


def pool_lengths(seqs, p: int) -> list:
    """The (s, b) at which the pool is measured: the two shortest profiled lengths at b = 1, the
    shortest at b = 2 (pool buffers are deterministic: constant or proportional to b * s)."""
    ok = [s for s in sorted(seqs) if s % p == 0]
    if not ok:
        return []
    two = ok[:2] if len(ok) > 1 else [ok[0], 2 * ok[0]]
    return [(two[0], 1), (two[1], 1), (two[0], 2)]


def rank_sweep(rank, world, shape_d, cfg):
    """Runs on every rank: the whole sweep; returns the per-rank rows (rank 0 prints progress)."""
    import torch
    import torch.distributed as dist

    from . import analytic
    from . import measure as M

    shape = ModelShape(**shape_d)
    log = cfg.get("log", True) and rank == 0  # the process that prints (also in fake mode)
    if cfg.get("fake_world"):
        M.init_fake(cfg["fake_rank"], cfg["fake_world"])
        rank = cfg["fake_rank"]
    torch.manual_seed(0)
    max_seq = max(cfg["seqs"])
    spec, model = M.build(shape, num_layers=1, max_seq=max_seq)
    runner = M.LayerRunner(model, shape)
    fake = M.is_fake()
    net = analytic.load_config("interconnects.json", cfg.get("interconnect_path"))[cfg["interconnect"]] if fake else None
    rows = []
    groups = [(st, b) for st in cfg["strategies"] for b in cfg["batches"]]
    # rough cost of a cell, once for its memory passes and warm-up and once for its timed passes
    weights = {(st, s, b): s * b * (1 + s / 2048) for st, b in groups for s in cfg["seqs"]}
    total_w, done_w, t0 = 2 * sum(weights.values()), 0.0, time.time()
    limit = cfg.get("memory_limit")

    def progress(msg):
        if log:
            el = time.time() - t0
            eta = el / done_w * (total_w - done_w) if done_w else float("nan")
            print(f"[profile {el:6.0f}s, ETA {eta:5.0f}s] {msg}", file=sys.stderr, flush=True)

    def agree(over: bool) -> bool:
        """True on every rank if it is true on any (every rank must stop at the same length)."""
        flag = torch.tensor([1.0 if over else 0.0])
        if dist.is_initialized() and not fake:
            dist.all_reduce(flag)
        return flag.item() > 0

    def stop(st, s, b, reason):
        nonlocal done_w
        done_w += 2 * sum(w for (st_, s_, b_), w in weights.items() if st_ == st and b_ == b and s_ >= s)
        rows.append({"type": "limit", "strategy": st, "s": s, "b": b, "rank": rank, "reason": reason})
        progress(f"{st} s={s} b={b}: {reason.split(':')[0]}, sweep stops")

    # the communication pool (released before every micro-batch in training): per strategy and
    # for the non-layer part, its buffers at three (s, b), enough to fit each buffer as
    # c0 + c1 * b * s and to check that form on a third point
    pool_points = pool_lengths(cfg["seqs"], shape.p)
    for st in cfg["strategies"]:
        M.set_strategy(model, st)
        for s, b in pool_points:
            rows.append({"type": "pool", "strategy": st, "s": s, "b": b, "rank": rank,
                         "buffers": runner.pool(s, b)})
    progress(f"communication pool measured at (s, b) = {pool_points}")
    if cfg.get("pool_only"):
        groups = []

    cells = []  # the rows to time, every strategy's
    for st, b in groups:
        M.set_strategy(model, st)
        # 1) memory and warm-up at every length, up to the memory limit
        todo, prev = [], None
        for s in cfg["seqs"]:
            if s % shape.p:
                continue
            if limit is not None and prev is not None:
                # the analytic form scaled to the last measured length: do not even run a length
                # that would not fit (on a CPU host, running it could exhaust the machine)
                ps, psaved, ptrans = prev
                a_prev, a_now = analytic.layer_memory(st, shape, ps, b), analytic.layer_memory(st, shape, s, b)
                guess = (psaved * a_now[0] / max(a_prev[0], 1.0)) * shape.num_layers \
                    + ptrans * a_now[1] / max(a_prev[1], 1.0)
                if agree(guess > limit):
                    stop(st, s, b, f"memory limit {limit} bytes: {shape.num_layers} layers' saved + "
                                   f"transient predicted {guess:.0f} bytes from s={ps}")
                    break
            row = {"type": "layer", "strategy": st, "s": s, "b": b, "rank": rank}
            try:
                saved, trans = runner.memory("layer", s, b)
                row.update(saved_bytes=saved, transient_bytes=trans, buffer_bytes=M.buffer_bytes())
                if agree(limit is not None and saved * shape.num_layers + trans > limit):
                    stop(st, s, b, f"memory limit {limit} bytes: {shape.num_layers} layers' saved "
                                   f"+ transient = {saved * shape.num_layers + trans:.0f} bytes")
                    break
                for part in cfg["parts"]:
                    runner.time(part, s, b, cfg["warmup"], 0)
            except Exception as exc:  # noqa: BLE001
                if not _is_oom(exc):
                    raise
                torch.cuda.empty_cache()
                stop(st, s, b, f"out of memory: {str(exc).splitlines()[0][:200]}")
                break
            for part in cfg["parts"]:
                row[f"{part}_times"] = []
            if fake:
                row["comm_seconds"] = analytic.comm_seconds(st, shape, s, b, net)
            todo.append(row)
            prev = (s, saved, trans)
            done_w += weights[(st, s, b)]
        cells += todo
        progress(f"{st} b={b}: memory measured at {len(todo)} lengths")
    # 2) timed passes in rounds over every (strategy, s, b), alternating direction: on a shared
    # machine whose speed drifts over minutes, each cell's repeats spread over the whole sweep
    # instead of one strategy's stretch of it (the pool is reset at each switch, as in phase 1,
    # so a GPU holds no other strategy's buffers beside the one being timed). Each visit
    # first runs one untimed pass of its cell, so the timed one follows a pass of its own
    # size, as a training step's layers and micro-batches do: without it a pass after a
    # smaller cell paid for memory the machine had handed back (on this VM the hypervisor
    # reclaims freed guest memory within seconds; docs/costmodel.md), after a larger one not
    reps = [repeats_for(cfg["repeats"], row["s"] * row["b"]) for row in cells]
    n_rounds = max(reps, default=0)
    current = None
    for rnd in range(n_rounds):
        for i in (range(len(cells)) if rnd % 2 == 0 else reversed(range(len(cells)))):
            row = cells[i]
            if rnd >= reps[i]:
                continue
            if row["strategy"] != current:
                current = row["strategy"]
                M.set_strategy(model, current)
            for j, part in enumerate(cfg["parts"]):
                row[f"{part}_times"] += runner.time(part, row["s"], row["b"], 1 if j == 0 else 0, 1)
            done_w += weights[(row["strategy"], row["s"], row["b"])] / reps[i]
        progress(f"round {rnd + 1}/{n_rounds} of timed passes")
    for row in cells:
        rows.append(row)
        times = sorted(row["layer_times"])
        progress(f"{row['strategy']:8s} s={row['s']:5d} b={row['b']}: {times[len(times) // 2] * 1e3:8.1f} ms, saved "
                 f"{row['saved_bytes'] / 2**20:7.2f} MiB, transient {row['transient_bytes'] / 2**20:7.2f} MiB")
    if cfg.get("nonlayer", True):
        del runner
        spec, full = M.build(shape, num_layers=shape.num_layers, max_seq=max_seq)
        nl = M.NonLayerRunner(full, spec, shape)
        for s, b in pool_points:
            rows.append({"type": "pool", "strategy": "nonlayer", "s": s, "b": b, "rank": rank,
                         "buffers": nl.pool(s, b)})
        if cfg.get("pool_only"):
            return rows
        for b in cfg["batches"]:
            for s in cfg["seqs"]:
                if s % shape.p:
                    continue
                times, saved, trans = nl.measure(s, b, cfg["warmup"], cfg["repeats"])
                rows.append({"type": "nonlayer", "s": s, "b": b, "rank": rank, "nonlayer_times": times,
                             "saved_bytes": saved, "transient_bytes": trans})
        upd = nl.update_times(cfg["warmup"], cfg["repeats"])
        row = {"type": "optimizer", "rank": rank, "grad_sync_times": upd["grad_sync"],
               "optimizer_times": upd["optimizer"], "param_bytes": M.param_bytes(full)}
        if fake:
            row["comm_seconds"] = analytic.update_comm_seconds(shape, net)
        rows.append(row)
        progress("non-layer costs done")
    return rows


def merge_ranks(per_rank: list) -> list:
    """One row per measurement: memory and median times are the max over ranks."""
    import statistics

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
            elif key in ("saved_bytes", "transient_bytes", "buffer_bytes", "param_bytes"):
                m[key] = max(r[key] for r in rows)
            elif key == "buffers":
                names = sorted({n for r in rows for n in r[key]})
                m[key] = {n: max(r[key].get(n, 0) for r in rows) for n in names}
        if row.get("type") == "layer":
            m["seconds"] = m["layer_seconds"] + m.get("comm_seconds", 0.0)
            m["saved_by_rank"] = [r["saved_bytes"] for r in rows]
            m["transient_by_rank"] = [r["transient_bytes"] for r in rows]
        if row.get("type") == "nonlayer":
            m["seconds"] = m["nonlayer_seconds"]
        out.append(m)
    return out


def unsupported(shape: ModelShape, cfg: dict) -> str | None:
    """Why this profile cannot run here (checked before any rank starts), or None."""
    import torch

    if shape.dtype != "fp32" and cfg.get("nonlayer", True) and not torch.cuda.is_available():
        return (f"a {shape.dtype} profile measures a training step's update with megatron's mixed-precision "
                "optimizer, which needs CUDA tensors: on CPU profile fp32, or give --no-nonlayer to "
                "measure the layers alone")
    return None


def run_profile(shape: ModelShape, cfg: dict, nproc: int | None = None, out: str | None = None,
                timeout: float = 3600) -> list:
    """Profile ``shape``; returns the merged rows (header first) and writes ``out`` if given."""
    why = unsupported(shape, cfg)
    if why:
        raise ValueError(why)
    t0 = time.time()
    cfg = dict(cfg)
    if cfg.get("fake_world"):
        mode = "fake"
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            raise SystemExit("error: --fake-world runs in one process; do not launch it with torchrun")
        from megatron_paradyse.testing.spawn import run_world

        per_rank = run_world(rank_sweep, 1, shape.key(), cfg, timeout=timeout)
    elif "WORLD_SIZE" in os.environ and "RANK" in os.environ and nproc is None:
        mode = "torchrun"
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        rows = rank_sweep(dist.get_rank(), dist.get_world_size(), shape.key(), cfg)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, rows)
        if dist.get_rank() != 0:
            return []
    else:
        mode = "spawn"
        from megatron_paradyse.testing.spawn import run_world

        per_rank = run_world(rank_sweep, nproc or shape.p, shape.key(), cfg, timeout=timeout)
    rows = merge_ranks(per_rank)
    from ..cpu_compat import RANK_ENV

    header = {"type": "header", "format": FORMAT, "shape": shape.key(), "p": shape.p, "dtype": shape.dtype,
              "mode": mode, "fake_rank": cfg.get("fake_rank"), "interconnect": cfg.get("interconnect") if mode == "fake" else None,
              "hardware": hardware(None if mode == "torchrun" else RANK_ENV), "versions": versions(), "warmup": cfg["warmup"], "repeats": cfg["repeats"],
              "seqs": cfg["seqs"], "batches": cfg["batches"], "strategies": cfg["strategies"],
              "memory_limit": cfg.get("memory_limit"), "command": cfg.get("command"),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0))}
    footer = {"type": "footer", "duration_s": round(time.time() - t0, 1)}
    allrows = [header] + rows + [footer]
    if out:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            for r in allrows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, out)
    return allrows


def read_profile(path: str) -> tuple[dict, list]:
    """``(header, rows)`` of a profile file; a clear error for a broken one."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: profile {path!r} does not exist")
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"profile {path!r} line {i} is not valid JSON ({exc}): truncated or corrupt") from None
    if not rows or rows[0].get("type") != "header" or rows[0].get("format") != FORMAT:
        raise ValueError(f"profile {path!r} does not start with a {FORMAT} header line")
    return rows[0], rows[1:]


def main(argv=None):
    import megatron_paradyse as mp

    ap = argparse.ArgumentParser(prog="python -m megatron_paradyse.costmodel profile",
                                 description="Profile one decoder layer per strategy over a sweep of lengths.")
    add_shape_args(ap)
    ap.add_argument("--nproc", type=int, default=None, help="spawn this many gloo ranks (default: p)")
    ap.add_argument("--fake-world", type=int, default=None, help="single-device mode: p of the fake group")
    ap.add_argument("--fake-rank", type=int, default=None, help="single-device mode: the rank played")
    ap.add_argument("--interconnect", default="nvlink4", help="key of configs/interconnects.json (fake mode)")
    ap.add_argument("--interconnect-config", default=None, help="your own interconnects JSON")
    ap.add_argument("--seqs", default="128,256,512,1024,2048,4096")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--strategies", default=",".join(mp.STRATEGIES))
    ap.add_argument("--parts", default="layer,attn,mlp", help="which passes to time")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory-limit", default=None,
                    help="bytes per rank (suffix G/M allowed); a strategy's sweep stops where num_layers "
                         "layers' saved + one transient would exceed it")
    ap.add_argument("--no-nonlayer", action="store_true")
    ap.add_argument("--pool-only", action="store_true",
                    help="measure only the communication pool (seconds): its rows can be added to an "
                         "older profile with a second PROFILE argument to `fit`")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    if (args.fake_world is None) != (args.fake_rank is None):
        ap.error("--fake-world and --fake-rank go together")
    p = args.fake_world or args.p or args.nproc or int(os.environ.get("WORLD_SIZE", 0)) or None
    if p is None:
        ap.error("give --tensor-model-parallel-size (or --nproc / --fake-world)")
    if args.nproc and args.nproc != p:
        ap.error(f"--nproc {args.nproc} differs from p = {p}: the layer runs over the whole world")
    strategies = [s for s in args.strategies.split(",") if s]
    bad = [s for s in strategies if s not in mp.STRATEGIES]
    if bad:
        ap.error(f"unknown strategies {bad}; known: {mp.STRATEGIES}")
    parts = [x for x in args.parts.split(",") if x]
    if "layer" not in parts or set(parts) - {"layer", "attn", "mlp"}:
        ap.error("--parts must include 'layer' and only name layer, attn, mlp")
    shape = shape_from_args(args, p)
    for st in strategies:
        import types

        ok, why = mp.supports(st, types.SimpleNamespace(**_config_like(shape)), p) if hasattr(mp, "supports") else (True, "")
        if not ok:
            ap.error(f"strategy {st} cannot run this shape at p={p}: {why}")
    if args.fake_world is not None and not 0 <= args.fake_rank < args.fake_world:
        ap.error(f"--fake-rank {args.fake_rank} is outside 0..{args.fake_world - 1}")
    from .analytic import load_config

    nets = load_config("interconnects.json", args.interconnect_config)
    if args.fake_world and args.interconnect not in nets:
        ap.error(f"unknown --interconnect {args.interconnect!r}; known: {sorted(k for k in nets if not k.startswith('_'))}")
    cfg = dict(seqs=parse_ints(args.seqs, "--seqs"), batches=parse_ints(args.batches, "--batches"),
               strategies=strategies, parts=parts, warmup=args.warmup, repeats=args.repeats,
               memory_limit=_bytes(args.memory_limit), nonlayer=not args.no_nonlayer,
               pool_only=args.pool_only,
               fake_world=args.fake_world, fake_rank=args.fake_rank, interconnect=args.interconnect,
               interconnect_path=args.interconnect_config, command=" ".join(sys.argv))
    bad_s = [s for s in cfg["seqs"] if s % p]
    if bad_s:
        ap.error(f"sequence lengths {bad_s} are not divisible by p={p}")
    why = unsupported(shape, cfg)
    if why:
        ap.error(why)
    t0 = time.time()
    rows = run_profile(shape, cfg, nproc=None if args.fake_world else (args.nproc or (None if "WORLD_SIZE" in os.environ else p)),
                       out=args.output, timeout=args.timeout)
    if rows:
        n = sum(1 for r in rows if r.get("type") == "layer")
        k = sum(1 for r in rows if r.get("type") == "pool")
        print(f"wrote {args.output}: {n} layer and {k} pool measurements of {shape.describe()} in "
              f"{time.time() - t0:.0f} s")


def _bytes(v):
    """``"6G"``, ``"512M"``, ``"1e9"`` to bytes (None stays None)."""
    if v is None:
        return None
    text = str(v).strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}.get(text[-1:], 1)
    try:
        n = float(text[:-1] if mult > 1 else text) * mult
    except ValueError:
        raise SystemExit(f"error: --memory-limit {v!r} is not a size (e.g. 6G, 512M, 1e9)") from None
    if n <= 0:
        raise SystemExit(f"error: --memory-limit must be positive, got {v!r}")
    return n


def _config_like(shape: ModelShape) -> dict:
    return dict(num_attention_heads=shape.heads, num_query_groups=shape.query_groups,
                hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
                context_parallel_size=1)
