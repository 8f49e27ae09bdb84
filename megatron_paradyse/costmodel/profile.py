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

from .shape import ModelShape

FORMAT = "paradyse-profile/1"


def shape_from_args(args, p: int | None = None) -> ModelShape:
    """The ``ModelShape`` of the parsed model flags (completed on the CPU: the shape does not
    depend on the device)."""
    import torch

    from . import measure as M

    return M.shape_of(M.complete(args, p, torch.device("cpu")))


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


def hardware(rank_env: dict | None = None, dev_type: str | None = None) -> dict:
    """The machine the ranks ran on, and ``THP_MEM_ALLOC_ENABLE`` as they had it (``rank_env``:
    what the spawned ranks started with; default this process's environment): CPU times of
    large tensors depend on it (``cpu_compat.RANK_ENV``). ``dev_type``: the ranks' device
    (``"cuda"``: the GPU's name and memory are recorded; CPU ranks on a GPU host record none)."""
    import torch

    env = os.environ if rank_env is None else {**os.environ, **rank_env}
    hw = {"machine": platform.machine(), "cpus": os.cpu_count(), "node": platform.node(),
          "thp_mem_alloc_enable": env.get("THP_MEM_ALLOC_ENABLE"), "device": dev_type}
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


def _is_oom(exc) -> bool:
    from .measure import is_oom

    return is_oom(exc)


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
    """Runs on every rank: the whole sweep; returns the per-rank rows (rank 0 prints progress).

    ``cfg["model_args"]``: the model flags (uncompleted; completed here for this rank's device),
    default the profiler's flags for the shape. Every rank returns the same sequence of rows:
    each skip (memory limit, out of memory) is agreed by all of them."""
    import torch
    import torch.distributed as dist

    from .. import device
    from . import analytic
    from . import measure as M

    shape = ModelShape(**shape_d)
    log = cfg.get("log", True) and rank == 0  # the process that prints (also in fake mode)
    if cfg.get("fake_world"):
        M.init_fake(cfg["fake_rank"], cfg["fake_world"])
        rank = cfg["fake_rank"]
    fake = M.is_fake()
    dev = device.current()
    torch.manual_seed(0)
    max_seq = max(cfg["seqs"])
    margs = cfg.get("model_args")
    spec, model = M.build(shape, num_layers=1, max_seq=max_seq, args=margs)
    runner = M.LayerRunner(model, shape)
    net = analytic.load_config("interconnects.json", cfg.get("interconnect_path"))[cfg["interconnect"]] if fake else None
    rows = []
    groups = [(st, b) for st in cfg["strategies"] for b in cfg["batches"]]
    # rough cost of a cell, once for its memory passes and warm-up and once for its timed passes
    weights = {(st, s, b): s * b * (1 + s / 2048) for st, b in groups for s in cfg["seqs"]}
    total_w, done_w, t0 = 2 * sum(weights.values()), 0.0, time.time()
    limit = cfg.get("memory_limit")
    collective = dist.is_initialized() and not fake
    me, n_ranks = (dist.get_rank(), dist.get_world_size()) if collective else (0, 1)

    def progress(msg):
        if log:
            el = time.time() - t0
            eta = el / done_w * (total_w - done_w) if done_w else float("nan")
            print(f"[profile {el:6.0f}s, ETA {eta:5.0f}s] {msg}", file=sys.stderr, flush=True)

    def failed_ranks(failed: bool) -> list:
        """The ranks on which ``failed`` is true, known to every rank: one all-reduce (MAX) of a
        one-hot vector on this rank's device (every rank calls it at the same point)."""
        flags = torch.zeros(n_ranks, device=dev)
        if failed:
            flags[me] = 1.0
        if collective:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [i for i, v in enumerate(flags.tolist()) if v > 0]

    def agree(over: bool) -> bool:
        """True on every rank if it is true on any (every rank must stop at the same length)."""
        return bool(failed_ranks(over))

    def attempt(fn, what, net_model=None):
        """``fn()`` on every rank; ``(result, [])`` where it fit on all of them, else ``(None,
        ranks that ran out of memory)`` on every rank, the failed pass's memory freed first."""
        err, out = None, None
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - only an OOM is agreed on; anything else is raised
            if not _is_oom(exc):
                raise
            err = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            # leaving this block drops the exception and its traceback: the frames that held
            # the failed pass's inputs, outputs and gradients
        if err is not None:
            print(f"[profile rank {me}] out of memory at {what}: {err}", file=sys.stderr, flush=True)
            M.free_after_oom(net_model if net_model is not None else model)
        bad = failed_ranks(err is not None)
        if bad:
            out = None
            if err is None:  # a peer failed: this rank's pass succeeded, start the next cell alike
                M.free_after_oom(net_model if net_model is not None else model)
        return out, bad

    def stop(st, s, b, reason, **extra):
        nonlocal done_w
        done_w += 2 * sum(w for (st_, s_, b_), w in weights.items() if st_ == st and b_ == b and s_ >= s)
        rows.append({"type": "limit", "strategy": st, "s": s, "b": b, "rank": rank, "reason": reason, **extra})
        progress(f"{st} s={s} b={b}: {reason.split(':')[0]}, sweep stops")

    def oom_reason(bad):
        return f"out of memory on rank(s) {bad}"

    # the communication pool (released before every micro-batch in training): per strategy and
    # for the non-layer part, its buffers at three (s, b), enough to fit each buffer as
    # c0 + c1 * b * s and to check that form on a third point
    # (a point that runs out of memory on any rank is left out on every rank: its layer pass
    # does not fit, and the sweep below finds that length's limit)
    pool_points = pool_lengths(cfg["seqs"], shape.p)
    for st in cfg["strategies"]:
        M.set_strategy(model, st)
        for s, b in pool_points:
            got, bad = attempt(lambda: runner.pool(s, b), f"{st} pool s={s} b={b}")
            if bad:
                progress(f"{st} pool at s={s} b={b}: {oom_reason(bad)}, left out")
                continue
            rows.append({"type": "pool", "strategy": st, "s": s, "b": b, "rank": rank, "buffers": got})
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
            if prev is not None:
                # the analytic form scaled to the last measured length: do not even run a length
                # that would not fit (on a CPU host, running it could exhaust the machine; on a
                # GPU it would run out of memory)
                ps, psaved, ptrans = prev
                a_prev, a_now = analytic.layer_memory(st, shape, ps, b), analytic.layer_memory(st, shape, s, b)
                saved1 = psaved * a_now[0] / max(a_prev[0], 1.0)
                trans1 = ptrans * a_now[1] / max(a_prev[1], 1.0)
                if limit is not None:
                    guess = saved1 * shape.num_layers + trans1
                    if agree(guess > limit):
                        stop(st, s, b, f"memory limit {limit} bytes: {shape.num_layers} layers' saved + "
                                       f"transient predicted {guess:.0f} bytes from s={ps}")
                        break
                free = M.free_device_bytes()
                if agree(free is not None and saved1 + trans1 > free):
                    stop(st, s, b, f"predicted out of memory: one layer's saved + transient "
                                   f"{saved1 + trans1:.0f} bytes from s={ps} exceed a rank's free device memory")
                    break
            row = {"type": "layer", "strategy": st, "s": s, "b": b, "rank": rank}
            got, bad = attempt(lambda: runner.memory("layer", s, b), f"{st} s={s} b={b} (memory)")
            if bad:
                stop(st, s, b, oom_reason(bad), oom_ranks=bad)
                break
            saved, trans = got
            row.update(saved_bytes=saved, transient_bytes=trans, buffer_bytes=M.buffer_bytes())
            if agree(limit is not None and saved * shape.num_layers + trans > limit):
                stop(st, s, b, f"memory limit {limit} bytes: {shape.num_layers} layers' saved "
                               f"+ transient = {saved * shape.num_layers + trans:.0f} bytes")
                break
            _, bad = attempt(lambda: [runner.time(part, s, b, cfg["warmup"], 0) for part in cfg["parts"]],
                             f"{st} s={s} b={b} (warm-up)")
            if bad:
                stop(st, s, b, oom_reason(bad), oom_ranks=bad)
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
    # reclaims freed guest memory within seconds; docs/costmodel.md), after a larger one not.
    # A cell that runs out of memory here (on any rank) is dropped on every rank, with the
    # longer lengths of its strategy.
    reps = [repeats_for(cfg["repeats"], row["s"] * row["b"]) for row in cells]
    n_rounds = max(reps, default=0)
    dropped = set()
    current = None
    for rnd in range(n_rounds):
        for i in (range(len(cells)) if rnd % 2 == 0 else reversed(range(len(cells)))):
            row = cells[i]
            if rnd >= reps[i] or i in dropped:
                continue
            if row["strategy"] != current:
                current = row["strategy"]
                M.set_strategy(model, current)

            def visit(row=row):
                return [runner.time(part, row["s"], row["b"], 1 if j == 0 else 0, 1)
                        for j, part in enumerate(cfg["parts"])]

            got, bad = attempt(visit, f"{row['strategy']} s={row['s']} b={row['b']} (timed)")
            if bad:
                for j, other in enumerate(cells):
                    if (other["strategy"], other["b"]) == (row["strategy"], row["b"]) and other["s"] >= row["s"]:
                        dropped.add(j)
                stop(row["strategy"], row["s"], row["b"], oom_reason(bad), oom_ranks=bad)
                continue
            for part, times in zip(cfg["parts"], got):
                row[f"{part}_times"] += times
            done_w += weights[(row["strategy"], row["s"], row["b"])] / reps[i]
        progress(f"round {rnd + 1}/{n_rounds} of timed passes")
    for i, row in enumerate(cells):
        if i in dropped:
            continue
        rows.append(row)
        times = sorted(row["layer_times"])
        progress(f"{row['strategy']:8s} s={row['s']:5d} b={row['b']}: {times[len(times) // 2] * 1e3:8.1f} ms, saved "
                 f"{row['saved_bytes'] / 2**20:7.2f} MiB, transient {row['transient_bytes'] / 2**20:7.2f} MiB")
    if cfg.get("nonlayer", True):
        del runner, model
        M.free_after_oom()  # the one-layer model's memory back before the whole model is built
        spec, full = M.build(shape, num_layers=shape.num_layers, max_seq=max_seq, args=margs)
        nl = M.NonLayerRunner(full, spec, shape)
        for s, b in pool_points:
            got, bad = attempt(lambda: nl.pool(s, b), f"nonlayer pool s={s} b={b}", net_model=full)
            if bad:
                progress(f"nonlayer pool at s={s} b={b}: {oom_reason(bad)}, left out")
                continue
            rows.append({"type": "pool", "strategy": "nonlayer", "s": s, "b": b, "rank": rank, "buffers": got})
        if cfg.get("pool_only"):
            return rows
        for b in cfg["batches"]:
            for s in cfg["seqs"]:
                if s % shape.p:
                    continue
                got, bad = attempt(lambda: nl.measure(s, b, cfg["warmup"], cfg["repeats"]),
                                   f"nonlayer s={s} b={b}", net_model=full)
                if bad:
                    stop("nonlayer", s, b, oom_reason(bad), oom_ranks=bad)
                    break
                times, saved, trans = got
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


def profile_mode(cfg: dict, nproc: int | None = None) -> str:
    """``"fake"`` (one process, a fake group), ``"torchrun"`` (the launched ranks) or ``"spawn"``
    (gloo CPU ranks started here)."""
    if cfg.get("fake_world"):
        return "fake"
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ and nproc is None:
        return "torchrun"
    return "spawn"


def rank_backend(mode: str, cfg: dict) -> str:
    """The backend whose device the ranks compute on (``device.select``): spawned ranks are gloo
    (CPU); launched ranks and the single-device mode default to this machine's
    (``device.default_backend()``: NCCL and the GPU where there is one)."""
    from ..device import default_backend

    backend = cfg.get("backend")
    if mode == "spawn":
        if backend not in (None, "gloo"):
            raise ValueError(f"spawned ranks are gloo (CPU) ranks; launch with torchrun for {backend}")
        return "gloo"
    return backend or default_backend()


def unsupported(shape: ModelShape, cfg: dict, dev_type: str = "cpu") -> str | None:
    """Why this profile cannot run on ranks computing on ``dev_type`` (checked before any rank
    starts), or None."""
    if shape.dtype != "fp32" and cfg.get("nonlayer", True) and dev_type != "cuda":
        return (f"a {shape.dtype} profile measures a training step's update with megatron's mixed-precision "
                "optimizer, which needs CUDA tensors: on CPU profile fp32, or give --no-nonlayer to "
                "measure the layers alone")
    return None


def run_profile(shape: ModelShape, cfg: dict, nproc: int | None = None, out: str | None = None,
                timeout: float = 3600) -> list:
    """Profile ``shape``; returns the merged rows (header first) and writes ``out`` if given.

    ``cfg["model_args"]`` (optional): the model flags as parsed (``measure.add_model_flags``),
    which must describe ``shape``; default the profiler's flags for ``shape``."""
    import torch

    from . import measure as M
    from .ranks import run_ranks

    t0 = time.time()
    cfg = dict(cfg)
    mode = profile_mode(cfg, nproc)
    backend = rank_backend(mode, cfg)
    dev_type = "cuda" if backend == "nccl" else "cpu"
    why = unsupported(shape, cfg, dev_type)
    if why:
        raise ValueError(why)
    margs = cfg.get("model_args")
    if margs is None:
        margs = vars(M.model_args_for_shape(shape))
    cfg["model_args"] = dict(margs)
    done = M.complete(cfg["model_args"], shape.p, torch.device(dev_type), max_seq=max(cfg["seqs"]))
    if M.shape_of(done) != shape:
        raise ValueError(f"the model flags describe {M.shape_of(done).describe()}, not {shape.describe()}")
    if mode == "fake":
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            raise SystemExit("error: --fake-world runs in one process; do not launch it with torchrun")
        per_rank = run_ranks(rank_sweep, 1, shape.key(), cfg, timeout=timeout, backend="fake",
                             fake_device=backend)
    elif mode == "torchrun":
        import torch.distributed as dist

        from .. import device

        if not dist.is_initialized():
            device.select(backend)  # nccl: this rank's GPU, set before NCCL starts; gloo: the CPU
            dist.init_process_group(backend)
        elif dist.get_backend() != backend:
            raise ValueError(f"torch.distributed runs {dist.get_backend()}, not {backend}")
        rows = rank_sweep(dist.get_rank(), dist.get_world_size(), shape.key(), cfg)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, rows)
        if dist.get_rank() != 0:
            return []
    else:
        per_rank = run_ranks(rank_sweep, nproc or shape.p, shape.key(), cfg, timeout=timeout)
    rows = merge_ranks(per_rank)
    from ..cpu_compat import RANK_ENV

    header = {"type": "header", "format": FORMAT, "shape": shape.key(), "p": shape.p, "dtype": shape.dtype,
              "mode": mode, "fake_rank": cfg.get("fake_rank"), "interconnect": cfg.get("interconnect") if mode == "fake" else None,
              "hardware": hardware(None if mode == "torchrun" else RANK_ENV, dev_type),
              "versions": versions(), "model": M.describe_args(done),
              "warmup": cfg["warmup"], "repeats": cfg["repeats"],
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


def build_parser() -> argparse.ArgumentParser:
    """The profiler's command line: the trainer's model flags (``measure.add_model_flags``) and
    the sweep's."""
    import megatron_paradyse as mp

    from .measure import add_model_flags

    ap = argparse.ArgumentParser(prog="python -m megatron_paradyse.costmodel profile",
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
    return ap


def _command(argv) -> str:
    """How this profile was asked for, without the machine's absolute paths."""
    from ..paths import shown_argv

    return "python -m megatron_paradyse.costmodel profile " + shown_argv(sys.argv[1:] if argv is None else argv)


def main(argv=None):
    import torch

    import megatron_paradyse as mp

    from . import measure as M
    from ..model import ModelArgsError

    ap = build_parser()
    args = ap.parse_args(argv)
    if (args.fake_world is None) != (args.fake_rank is None):
        ap.error("--fake-world and --fake-rank go together")
    p = (args.fake_world or args.tensor_model_parallel_size or args.nproc
         or int(os.environ.get("WORLD_SIZE", 0)) or None)
    if p is None:
        ap.error("give --tensor-model-parallel-size (or --nproc / --fake-world)")
    if args.nproc and args.nproc != p:
        ap.error(f"--nproc {args.nproc} differs from p = {p}: the layer runs over the whole world")
    if (args.num_query_groups is not None and not args.group_query_attention
            and args.num_query_groups != args.num_attention_heads):
        ap.error(f"--num-query-groups {args.num_query_groups} without --group-query-attention: Megatron-LM "
                 "(and the trainer) would ignore it and build multi-head attention; add "
                 "--group-query-attention to profile grouped-query attention")
    strategies = [s for s in args.strategies.split(",") if s]
    bad = [s for s in strategies if s not in mp.STRATEGIES]
    if bad:
        ap.error(f"unknown strategies {bad}; known: {mp.STRATEGIES}")
    parts = [x for x in args.parts.split(",") if x]
    if "layer" not in parts or set(parts) - {"layer", "attn", "mlp"}:
        ap.error("--parts must include 'layer' and only name layer, attn, mlp")
    if args.fake_world is not None and not 0 <= args.fake_rank < args.fake_world:
        ap.error(f"--fake-rank {args.fake_rank} is outside 0..{args.fake_world - 1}")
    seqs, batches = parse_ints(args.seqs, "--seqs"), parse_ints(args.batches, "--batches")
    bad_s = [s for s in seqs if s % p]
    if bad_s:
        ap.error(f"sequence lengths {bad_s} are not divisible by p={p}")
    if (args.position_embedding_type == "learned_absolute" and args.max_position_embeddings is not None
            and max(seqs) > args.max_position_embeddings):
        ap.error(f"--seqs up to {max(seqs)} exceed --max-position-embeddings {args.max_position_embeddings}")
    model_args = {k: getattr(args, k) for k in M.model_flag_names()}
    nproc = None if args.fake_world else (args.nproc or (None if "WORLD_SIZE" in os.environ else p))
    cfg = dict(seqs=seqs, batches=batches,
               strategies=strategies, parts=parts, warmup=args.warmup, repeats=args.repeats,
               memory_limit=_bytes(args.memory_limit), nonlayer=not args.no_nonlayer,
               pool_only=args.pool_only, backend=args.backend,
               fake_world=args.fake_world, fake_rank=args.fake_rank, interconnect=args.interconnect,
               interconnect_path=args.interconnect_config, command=_command(argv),
               model_args=model_args)
    mode = profile_mode(cfg, nproc)
    try:
        backend = rank_backend(mode, cfg)
    except ValueError as e:
        ap.error(str(e))
    dev_type = "cuda" if backend == "nccl" else "cpu"
    if dev_type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--distributed-backend {backend} needs CUDA, which this machine does not have")
    try:  # completed as the ranks will complete them, for their device
        done = M.complete(model_args, p, torch.device(dev_type), max_seq=max(seqs))
        config = M.model_config(done)
    except (ModelArgsError, ValueError) as e:
        ap.error(str(e))
    shape = M.shape_of(done)
    for st in strategies:
        ok, why = mp.supports(st, config, p)
        if not ok:
            ap.error(f"strategy {st} cannot run this model at p={p}: {why}")
    from .analytic import load_config

    nets = load_config("interconnects.json", args.interconnect_config)
    if args.fake_world and args.interconnect not in nets:
        ap.error(f"unknown --interconnect {args.interconnect!r}; known: {sorted(k for k in nets if not k.startswith('_'))}")
    why = unsupported(shape, cfg, dev_type)
    if why:
        ap.error(why)
    t0 = time.time()
    rows = run_profile(shape, cfg, nproc=nproc, out=args.output, timeout=args.timeout)
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
