"""One rank's profiling sweep (``profile.rank_sweep``): the rows of every (strategy, s, b) that
this rank measured, the same sequence on every rank.

Phases: the communication pool at three (s, b) per strategy; then, per (strategy, b), memory
and a warm-up at every length up to the memory limit, and per strategy on every pack of the
profile (``--packs``: ``pack`` rows, none longer than the strategy's longest length that fit);
then the timed repeats in rounds over every cell (packs among them); then the attention kernel
classes alone at the lengths their strategies measured (``kernel`` rows, ``kernels.py``); then
the recompute phase (``recompute`` rows: per strategy at a few of its lengths, the layer plain
and checkpointed, ``st:rc``, timed in the same rounds; ``--recompute-only`` runs this phase
alone); then the non-layer part and the step's update. Whether a cell fits is decided by
all ranks together (each reports, one all-reduce MAX): a cell that ran out of memory on any
rank is skipped on every rank, with a ``limit`` row, and its strategy goes no longer.
"""
from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist

from .. import device
from ..parallel.plans import RC, RC_ATTN, RC_MLP
from . import analytic, kernels
from . import measure as M
from .packs import PackShape
from .shape import ModelShape

log = logging.getLogger(__name__)


def repeats_for(repeats: int, tokens: int) -> int:
    """More repeats for short passes (the same on every rank: collectives stay in step): 4x up
    to 1024 tokens, 2x to 2048. Short passes are cheap and noisy (on this 2-core VM single
    passes of 10-60 ms spread 2x; at 4096 and beyond within 10%), and the time model's rates
    are fitted on them."""
    return repeats * max(1, min(4, 4096 // max(tokens, 1)))


def pool_lengths(seqs, p: int) -> list:
    """The (s, b) at which the pool is measured: the two shortest profiled lengths at b = 1, the
    shortest at b = 2 (pool buffers are deterministic: constant or proportional to b * s)."""
    ok = [s for s in sorted(seqs) if s % p == 0]
    if not ok:
        return []
    two = ok[:2] if len(ok) > 1 else [ok[0], 2 * ok[0]]
    return [(two[0], 1), (two[1], 1), (two[0], 2)]


def oom_reason(bad: list) -> str:
    """A ``limit`` row's reason for an out-of-memory pass on the ranks ``bad``."""
    return f"out of memory on rank(s) {bad}"


class Sweep:
    """One rank's sweep: the one-layer model and its runner, the rows so far, progress (rank 0
    logs it), and the decisions every rank takes together (one all-reduce each)."""

    def __init__(self, rank: int, shape: ModelShape, cfg):
        self.logs_progress = rank == 0  # the process that logs it (also in fake mode)
        if cfg.fake_world:
            M.init_fake(cfg.fake_rank, cfg.fake_world)
            rank = cfg.fake_rank
        self.rank, self.shape, self.cfg = rank, shape, cfg
        self.fake = M.is_fake()
        self.dev = device.current()
        torch.manual_seed(0)
        _, self.model = M.build(shape, num_layers=1, max_seq=max(cfg.seqs), model_args=cfg.model_args)
        self.runner = M.LayerRunner(self.model, shape)
        self.net = (analytic.load_config("interconnects.json", cfg.interconnect_path)[cfg.interconnect]
                    if self.fake else None)
        self.rows = []
        self.groups = [(st, b) for st in cfg.strategies for b in cfg.batches]
        # rough cost of a cell, once for its memory passes and warm-up and once for its timed passes
        self.weights = {(st, s, b): s * b * (1 + s / 2048) for st, b in self.groups for s in cfg.seqs}
        self.total_w, self.done_w, self.t0 = 2 * sum(self.weights.values()), 0.0, time.time()
        self.collective = dist.is_initialized() and not self.fake
        self.me, self.n_ranks = (dist.get_rank(), dist.get_world_size()) if self.collective else (0, 1)

    def progress(self, msg: str) -> None:
        """A progress line with the time spent and the estimated time left (rank 0)."""
        if self.logs_progress:
            el = time.time() - self.t0
            eta = el / self.done_w * (self.total_w - self.done_w) if self.done_w else float("nan")
            log.info(f"[profile {el:6.0f}s, ETA {eta:5.0f}s] {msg}")

    def failed_ranks(self, failed: bool) -> list:
        """The ranks on which ``failed`` is true, known to every rank: one all-reduce (MAX) of a
        one-hot vector on this rank's device (every rank calls it at the same point)."""
        flags = torch.zeros(self.n_ranks, device=self.dev)
        if failed:
            flags[self.me] = 1.0
        if self.collective:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [i for i, v in enumerate(flags.tolist()) if v > 0]

    def agree(self, over: bool) -> bool:
        """True on every rank if it is true on any (every rank must stop at the same length)."""
        return bool(self.failed_ranks(over))

    def attempt(self, fn, what: str, net_model=None):
        """``fn()`` on every rank; ``(result, [])`` where it fit on all of them, else ``(None,
        ranks that ran out of memory)`` on every rank, the failed pass's memory freed first."""
        err, out = None, None
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - only an OOM is agreed on; anything else is raised
            if not M.is_oom(exc):
                raise
            err = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            # leaving this block drops the exception and its traceback: the frames that held
            # the failed pass's inputs, outputs and gradients
        if err is not None:
            log.warning(f"[profile rank {self.me}] out of memory at {what}: {err}")
            M.free_after_oom(net_model if net_model is not None else self.model)
        bad = self.failed_ranks(err is not None)
        if bad:
            out = None
            if err is None:  # a peer failed: this rank's pass succeeded, start the next cell alike
                M.free_after_oom(net_model if net_model is not None else self.model)
        return out, bad

    def stop(self, st: str, s: int, b: int, reason: str, **extra) -> None:
        """A ``limit`` row: ``st`` at ``b`` goes no longer than ``s`` (its cells from ``s`` on
        count as done)."""
        self.done_w += 2 * sum(w for (st_, s_, b_), w in self.weights.items() if st_ == st and b_ == b and s_ >= s)
        self.rows.append({"type": "limit", "strategy": st, "s": s, "b": b, "rank": self.rank, "reason": reason,
                          **extra})
        self.progress(f"{st} s={s} b={b}: {reason.split(':')[0]}, sweep stops")


def rank_sweep(rank, world, shape_d, cfg):
    """Runs on every rank: the whole sweep; returns the per-rank rows (rank 0 prints progress).

    ``cfg`` (a ``profile.ProfileConfig``): ``cfg.model_args`` are the model flags (uncompleted;
    completed here for this rank's device), default the profiler's flags for the shape. Every
    rank returns the same sequence of rows: each skip (memory limit, out of memory) is agreed by
    all of them."""
    sw = Sweep(rank, ModelShape(**shape_d), cfg)
    if cfg.cells:  # a calibration to this host: its cells timed alone
        _calibration_rows(sw)
        return sw.rows
    if cfg.recompute_only:
        sw.total_w = sw.done_w = 0.0  # the estimate counts this phase's cells only
        _recompute_rows(sw, None)
        return sw.rows
    pool_points = pool_lengths(cfg.seqs, sw.shape.p)
    _pool_rows(sw, pool_points)
    cells = [] if cfg.pool_only else [row for st, b in sw.groups for row in _memory_cells(sw, st, b)]
    if not cfg.pool_only:
        cells += [row for st in cfg.strategies for row in _pack_cells(sw, st, cells)]
    dropped = _timed_rounds(sw, cells)
    kept = [row for i, row in enumerate(cells) if i not in dropped]
    _layer_rows(sw, kept)
    if cfg.kernels and not cfg.pool_only:
        _kernel_rows(sw, kept)
    if cfg.recompute and not cfg.pool_only:
        _recompute_rows(sw, kept)
    if cfg.nonlayer:
        _nonlayer_rows(sw, pool_points)
    return sw.rows


def settled(history: list, tol: float, least: int) -> bool:
    """Whether a cell's timed passes may stop: ``history`` holds its statistic after each timed
    pass (the same on every rank); at least ``least`` passes, and the last pass moved it by less
    than ``tol`` (relative)."""
    if len(history) < max(least, 2):
        return False
    return abs(history[-1] - history[-2]) <= tol * abs(history[-2])


def pass_statistic(per_rank: list, stat: str = "median") -> float:
    """A cell's time from every rank's passes so far, as ``profile.merge_ranks`` and
    ``calibrate.factors`` read it: the max over ranks of each rank's median (``stat ==
    "min"``: the least pass of any rank)."""
    if stat == "min":
        return min(t for times in per_rank for t in times)
    return max(statistics.median(times) for times in per_rank)


def _calibration_rows(sw: Sweep) -> None:
    """A calibration's cells (``cfg.cells``: (strategy, s) at b = 1, the layer alone): one
    warm-up pass per strategy, at its longest cell, then timed passes in rounds, as the
    profiler times its cells (``_timed_rounds``): each round visits every cell still open once,
    longest first, so that each timed pass follows another cell's, not its own, and runs in the
    state a layer meets inside a model (other layers' passes between, caches not its own);
    with each cell timed back to back, the demo's steps took 1.17-1.20x the calibrated
    predictions (docs/costmodel.md, "Calibrating to this host"). A cell
    closes once :func:`settled` (``cfg.stable``; at least ``cfg.repeats`` passes, at most
    :func:`calibration_repeats`). After the warm-ups every pass follows one at least its size
    or a longer warm-up of the allocator's pool, which is all the profile's untimed pass is for.
    Every pass's time is shared by all ranks (one all-reduce), so every rank closes a cell at the
    same pass. No pool, memory or kernel phase. A cell out of memory on any rank drops it and
    its strategy's other cells (a ``limit`` row)."""
    cfg, longest = sw.cfg, {}
    for st, s in cfg.cells:
        longest[st] = max(longest.get(st, 0), s)
    warmed = {st for st, s in longest.items() if _calibration_warm_up(sw, st, s)}
    cells = [c for c in cfg.cells if c[0] in warmed]
    per_rank = {c: [[] for _ in range(sw.n_ranks)] for c in cells}
    history = {c: [] for c in cells}
    open_cells = sorted(dict.fromkeys(cells), key=lambda c: -c[1])
    while open_cells:
        for st, s in list(open_cells):
            if (st, s) not in open_cells:  # dropped this round with its strategy
                continue
            M.set_strategy(sw.model, st)
            got, bad = sw.attempt(lambda: sw.runner.time("layer", s, 1, 0, 1), f"{st} s={s} (timed)")
            if bad:
                sw.stop(st, s, 1, oom_reason(bad), oom_ranks=bad)
                open_cells = [c for c in open_cells if c[0] != st]
                per_rank = {c: v for c, v in per_rank.items() if c[0] != st}
                continue
            for r, t in enumerate(_shared(sw, got[0])):
                per_rank[(st, s)][r].append(t)
            history[(st, s)].append(pass_statistic(per_rank[(st, s)], cfg.time_stat))
            if settled(history[(st, s)], cfg.stable, cfg.repeats) or \
                    len(history[(st, s)]) >= calibration_repeats(cfg.repeats, s):
                open_cells.remove((st, s))
    for st, s in cells:
        if (st, s) in per_rank:
            times = per_rank[(st, s)][sw.me]
            sw.rows.append({"type": "calibration", "strategy": st, "s": s, "b": 1, "rank": sw.rank, "layer_times": times})
            sw.progress(f"{st:8s} s={s:5d}: {statistics.median(times) * 1e3:8.1f} ms after {len(times)} timed passes")


def calibration_repeats(repeats: int, tokens: int) -> int:
    """The most timed passes of a calibration cell: twice ``repeats``, more for short passes
    (:func:`repeats_for`), which are noisier."""
    return max(2 * repeats, repeats_for(repeats, tokens))


def _calibration_warm_up(sw: Sweep, st: str, s: int) -> bool:
    """``st``'s warm-up pass at ``s`` (its longest cell); False where any rank ran out of memory
    (the strategy's cells are dropped, a ``limit`` row)."""
    M.set_strategy(sw.model, st)
    _, bad = sw.attempt(lambda: sw.runner.time("layer", s, 1, 1, 0), f"{st} s={s} (warm-up)")
    if bad:
        sw.stop(st, s, 1, oom_reason(bad), oom_ranks=bad)
    return not bad


def _shared(sw: Sweep, seconds: float) -> list:
    """Every rank's ``seconds`` (one all-reduce of a vector on this rank's device)."""
    vals = torch.zeros(sw.n_ranks, device=sw.dev, dtype=torch.float64)
    vals[sw.me] = seconds
    if sw.collective:
        dist.all_reduce(vals)
    return vals.tolist()


def _pool_rows(sw: Sweep, points: list) -> None:
    """The communication pool (released before every micro-batch in training): per strategy,
    its buffers at three (s, b), enough to fit each buffer as c0 + c1 * b * s and to check that
    form on a third point. A point that runs out of memory on any rank is left out on every
    rank: its layer pass does not fit, and the memory phase finds that length's limit."""
    for st in sw.cfg.strategies:
        M.set_strategy(sw.model, st)
        for s, b in points:
            got, bad = sw.attempt(lambda: sw.runner.pool(s, b), f"{st} pool s={s} b={b}")
            if bad:
                sw.progress(f"{st} pool at s={s} b={b}: {oom_reason(bad)}, left out")
                continue
            sw.rows.append({"type": "pool", "strategy": st, "s": s, "b": b, "rank": sw.rank, "buffers": got})
    sw.progress(f"communication pool measured at (s, b) = {points}")


def _memory_cells(sw: Sweep, st: str, b: int) -> list:
    """Memory and warm-up of ``st`` at every length, up to the memory limit; the rows to time."""
    cfg, shape, limit = sw.cfg, sw.shape, sw.cfg.memory_limit
    M.set_strategy(sw.model, st)
    todo, prev = [], None
    for s in cfg.seqs:
        if s % shape.p:
            continue
        if prev is not None and _predicted_stop(sw, st, s, b, prev):
            break
        row = {"type": "layer", "strategy": st, "s": s, "b": b, "rank": sw.rank}
        got, bad = sw.attempt(lambda: sw.runner.memory("layer", s, b), f"{st} s={s} b={b} (memory)")
        if bad:
            sw.stop(st, s, b, oom_reason(bad), oom_ranks=bad)
            break
        saved, trans = got
        row.update(saved_bytes=saved, transient_bytes=trans, buffer_bytes=M.buffer_bytes())
        if sw.agree(limit is not None and saved * shape.num_layers + trans > limit):
            sw.stop(st, s, b, f"memory limit {limit} bytes: {shape.num_layers} layers' saved "
                              f"+ transient = {saved * shape.num_layers + trans:.0f} bytes")
            break
        _, bad = sw.attempt(lambda: [sw.runner.time(part, s, b, cfg.warmup, 0) for part in cfg.parts],
                            f"{st} s={s} b={b} (warm-up)")
        if bad:
            sw.stop(st, s, b, oom_reason(bad), oom_ranks=bad)
            break
        for part in cfg.parts:
            row[f"{part}_times"] = []
        if sw.fake:
            row["comm_seconds"] = analytic.comm_seconds(st, shape, s, b, sw.net)
        todo.append(row)
        prev = (s, saved, trans)
        sw.done_w += sw.weights[(st, s, b)]
    sw.progress(f"{st} b={b}: memory measured at {len(todo)} lengths")
    return todo


def length_of(row):
    """What a cell runs: its length, or its pack (``PackShape``)."""
    return PackShape(tuple(row["lengths"])) if row.get("type") == "pack" else row["s"]


def _pack_cells(sw: Sweep, st: str, singles: list) -> list:
    """Memory and warm-up of ``st`` on every pack of the profile (``cfg.pack_shapes()``), up to
    the longest single length of ``st`` that fit (b = 1; none longer than that is run): the
    ``pack`` rows to time."""
    fit = [r["s"] for r in singles if r["strategy"] == st and r["b"] == 1]
    top = max(fit) if fit else None
    M.set_strategy(sw.model, st)
    todo = []
    for i, pk in enumerate(sw.cfg.pack_shapes(sw.shape.p)):
        T = pk.padded(sw.shape.p).tokens
        if top is not None and T > top:
            continue
        got, bad = sw.attempt(lambda: sw.runner.memory("layer", pk, 1), f"{st} pack {i} (memory)")
        if bad:
            sw.progress(f"{st} pack {i}: {oom_reason(bad)}, left out")
            continue
        _, bad = sw.attempt(lambda: [sw.runner.time(part, pk, 1, sw.cfg.warmup, 0) for part in sw.cfg.parts],
                            f"{st} pack {i} (warm-up)")
        if bad:
            continue
        row = {"type": "pack", "strategy": st, "s": T, "b": 1, "pack": i, "lengths": list(pk.lengths),
               "rank": sw.rank, "saved_bytes": got[0], "transient_bytes": got[1], "buffer_bytes": M.buffer_bytes()}
        row.update({f"{part}_times": [] for part in sw.cfg.parts})
        w = sw.weights.setdefault((st, T, 1), T * (1 + T / 2048))
        sw.total_w += w  # its timed passes (the memory pass is not counted in the estimate)
        if sw.fake:
            row["comm_seconds"] = analytic.comm_seconds(st, sw.shape, pk, 1, sw.net)
        todo.append(row)
    sw.progress(f"{st}: memory measured on {len(todo)} packs")
    return todo


def _predicted_stop(sw: Sweep, st: str, s: int, b: int, prev: tuple) -> bool:
    """Whether ``s`` is not even run (a ``limit`` row then): the analytic form scaled to the
    last measured length predicts it over the memory limit, or over a rank's free device
    memory (on a CPU host running it could exhaust the machine; on a GPU it would run out of
    memory)."""
    shape, limit = sw.shape, sw.cfg.memory_limit
    ps, psaved, ptrans = prev
    a_prev, a_now = analytic.layer_memory(st, shape, ps, b), analytic.layer_memory(st, shape, s, b)
    saved1 = psaved * a_now[0] / max(a_prev[0], 1.0)
    trans1 = ptrans * a_now[1] / max(a_prev[1], 1.0)
    if limit is not None:
        guess = saved1 * shape.num_layers + trans1
        if sw.agree(guess > limit):
            sw.stop(st, s, b, f"memory limit {limit} bytes: {shape.num_layers} layers' saved + "
                              f"transient predicted {guess:.0f} bytes from s={ps}")
            return True
    free = M.free_device_bytes()
    if sw.agree(free is not None and saved1 + trans1 > free):
        sw.stop(st, s, b, f"predicted out of memory: one layer's saved + transient "
                          f"{saved1 + trans1:.0f} bytes from s={ps} exceed a rank's free device memory")
        return True
    return False


def round_visits(reps: list, rnd: int, dropped: set):
    """The cells visited in round ``rnd``: every cell still in its first ``reps[i]`` rounds and
    not ``dropped`` (read at each visit), in alternating direction from round to round."""
    for i in (range(len(reps)) if rnd % 2 == 0 else reversed(range(len(reps)))):
        if rnd < reps[i] and i not in dropped:
            yield i


def _timed_rounds(sw: Sweep, cells: list) -> set:
    """The timed passes, in rounds over every (strategy, s, b), alternating direction; returns
    the indices of the cells dropped (out of memory, with the longer lengths of their strategy).

    On a shared machine whose speed drifts over minutes, each cell's repeats spread over the
    whole sweep instead of one strategy's stretch of it (the pool is reset at each switch, as
    in the memory phase, so a GPU holds no other strategy's buffers beside the one being
    timed). Each visit first runs one untimed pass of its cell, so the timed one follows a
    pass of its own size, as a training step's layers and micro-batches do: without it a pass
    after a smaller cell paid for memory the machine had handed back (on this VM the
    hypervisor reclaims freed guest memory within seconds; docs/costmodel.md), after a larger
    one not."""
    cfg = sw.cfg
    reps = [repeats_for(cfg.repeats, row["s"] * row["b"]) for row in cells]
    n_rounds = max(reps, default=0)
    dropped, current = set(), None
    for rnd in range(n_rounds):
        for i in round_visits(reps, rnd, dropped):
            row = cells[i]
            if row["strategy"] != current:
                current = row["strategy"]
                M.set_strategy(sw.model, current)
            if not _timed_visit(sw, cells, i, dropped):
                continue
            sw.done_w += sw.weights[(row["strategy"], row["s"], row["b"])] / reps[i]
        sw.progress(f"round {rnd + 1}/{n_rounds} of timed passes")
    return dropped


def _timed_visit(sw: Sweep, cells: list, i: int, dropped: set) -> bool:
    """One untimed and one timed pass of ``cells[i]``, its times appended; False (and the cell
    and its strategy's longer ones dropped, a ``limit`` row) where any rank ran out of memory."""
    row, parts = cells[i], sw.cfg.parts
    got, bad = sw.attempt(lambda: [sw.runner.time(part, length_of(row), row["b"], 1 if j == 0 else 0, 1)
                                   for j, part in enumerate(parts)],
                          f"{row['strategy']} s={row['s']} b={row['b']} (timed)")
    if bad:
        for j, other in enumerate(cells):
            if (other["strategy"], other["b"]) == (row["strategy"], row["b"]) and other["s"] >= row["s"]:
                dropped.add(j)
        sw.stop(row["strategy"], row["s"], row["b"], oom_reason(bad), oom_ranks=bad)
        return False
    for part, times in zip(parts, got):
        row[f"{part}_times"] += times
    return True


def _layer_rows(sw: Sweep, cells: list) -> None:
    """The timed cells as ``layer`` rows, each with a progress line."""
    for row in cells:
        sw.rows.append(row)
        times = sorted(row["layer_times"])
        what = f"pack {row['pack']:2d} T={row['s']:5d}" if row["type"] == "pack" else f"s={row['s']:5d} b={row['b']}"
        sw.progress(f"{row['strategy']:8s} {what}: {times[len(times) // 2] * 1e3:8.1f} ms, "
                    f"saved {row['saved_bytes'] / 2**20:7.2f} MiB, transient {row['transient_bytes'] / 2**20:7.2f} MiB")


def kernel_cells(sw: Sweep, layers: list) -> list:
    """The ``kernel`` rows to time: each attention kernel class of the profiled strategies at
    every length one of its strategies measured (b = the smallest profiled micro-batch size;
    none longer, so the class's memory stays within what its strategies' layers used)."""
    b = min(sw.cfg.batches)
    out = []
    for kernel in kernels.KERNELS:
        lens = sorted({r["s"] for r in layers if r["type"] == "layer" and r["b"] == b
                       and kernels.kernel_of(r["strategy"]) == kernel})
        out += [{"type": "kernel", "kernel": kernel, "s": s, "b": b, "rank": sw.rank, "kernel_times": []}
                for s in lens]
    return out


def _kernel_rows(sw: Sweep, layers: list) -> None:
    """The attention kernel calibration (``kernels``): per class and length, a warm-up, then the
    timed passes in rounds over all of them (alternating direction, each after an untimed pass,
    as the layers'); a length out of memory on any rank drops it and the class's longer ones."""
    cells = kernel_cells(sw, layers)
    shape, cfg = sw.shape, sw.cfg
    reps = [repeats_for(cfg.repeats, c["s"] * c["b"]) for c in cells]
    dropped = set()
    for rnd in range(max(reps, default=0)):
        for i in round_visits(reps, rnd, dropped):
            c = cells[i]
            got, bad = sw.attempt(lambda: M.time_kernel(c["kernel"], shape, c["s"], c["b"], 1, 1),
                                  f"kernel {c['kernel']} s={c['s']}")
            if bad:
                dropped |= {j for j, o in enumerate(cells) if o["kernel"] == c["kernel"] and o["s"] >= c["s"]}
                sw.progress(f"kernel {c['kernel']} s={c['s']}: {oom_reason(bad)}, it and longer left out")
                continue
            c["kernel_times"] += got
    for i, c in enumerate(cells):
        if i not in dropped:
            sw.rows.append(c)
            times = sorted(c["kernel_times"])
            sw.progress(f"kernel {c['kernel']:5s} s={c['s']:5d} b={c['b']}: {times[len(times) // 2] * 1e3:8.1f} ms")


def spread(lengths, k: int) -> list:
    """Up to ``k`` of ``lengths`` (ascending), spread over them evenly by rank: the shortest and
    the longest among them."""
    lengths = sorted(set(lengths))
    if len(lengths) <= k:
        return lengths
    if k <= 1:
        return lengths[-1:]
    return sorted({lengths[round(i * (len(lengths) - 1) / (k - 1))] for i in range(k)})


def recompute_lengths(cfg, p: int, fit: list) -> list:
    """The lengths of the recompute phase for a strategy whose layer fit at ``fit`` (a full
    profile: the lengths its memory phase kept; ``--recompute-only``: every ``--seqs`` divisible
    by p, the memory limit then decides as the phase goes): ``cfg.recompute_seqs`` among them
    where given, else up to ``cfg.recompute_points`` spread over them (:func:`spread`)."""
    fit = sorted(s for s in set(fit) if s % p == 0)
    if cfg.recompute_seqs:
        return [s for s in sorted(set(cfg.recompute_seqs)) if s in fit]
    return spread(fit, cfg.recompute_points)


def _recompute_rows(sw: Sweep, layers) -> None:
    """The recompute phase: per strategy, at a few of its lengths (:func:`recompute_lengths`,
    the smallest micro-batch size), the layer under ``st`` and under ``st:rc`` (checkpointed:
    its input saved, the layer run again inside the backward; ``parallel/recompute.py``): the
    memory of both (saved, transient), a warm-up of both, then the timed passes in rounds over
    every cell (alternating direction), each visit one untimed and one timed pass of each
    entry, in alternating order, so that a cell's two times share the machine's state of that
    moment: their ratio is what the fit reads. ``recompute`` rows; a cell over the memory limit
    (the plain layer's ``num_layers`` saved + transient, as the memory phase decides) or out of
    memory on any rank ends its strategy's phase on every rank (a ``recompute_limit`` row;
    ``limit`` rows are the layer sweep's)."""
    cfg, p = sw.cfg, sw.shape.p
    b = min(cfg.batches)
    cells = []
    for st in cfg.strategies:
        if layers is None:
            fit = list(cfg.seqs)
        else:
            fit = [r["s"] for r in layers if r["type"] == "layer" and r["strategy"] == st and r["b"] == b]
        lens = recompute_lengths(cfg, p, fit)
        for s in lens:
            w = 2 * s * b * (1 + s / 2048)
            sw.weights[("rc:" + st, s, b)] = w
            sw.total_w += 2 * w
        prev = None
        for s in lens:
            row = None if _recompute_over(sw, st, s, b, prev) else _recompute_memory(sw, st, s, b)
            if row is None:
                break
            cells.append(row)
            prev = (s, row["plain_saved_bytes"], row["plain_transient_bytes"])
        sw.progress(f"{st}{RC}: memory measured at {sum(1 for c in cells if c['strategy'] == st)} lengths")
    reps = [repeats_for(cfg.repeats, c["s"] * c["b"]) for c in cells]
    dropped = set()
    for rnd in range(max(reps, default=0)):
        for i in round_visits(reps, rnd, dropped):
            c = cells[i]
            entries = recompute_entries(c["strategy"])
            order = entries if (rnd + i) % 2 == 0 else entries[::-1]

            def visit():
                out = {}
                for entry in order:
                    M.set_strategy(sw.model, entry)
                    out[entry] = sw.runner.time("layer", c["s"], c["b"], 1, 1)
                return out

            got, bad = sw.attempt(visit, f"{c['strategy']}{RC} s={c['s']} b={c['b']} (timed)")
            if bad:
                dropped |= {j for j, o in enumerate(cells) if o["strategy"] == c["strategy"] and o["s"] >= c["s"]}
                _recompute_stop(sw, c["strategy"], c["s"], c["b"], oom_reason(bad), oom_ranks=bad)
                continue
            for entry, key in zip(entries, TIME_KEYS):
                c[key] += got[entry]
            sw.done_w += sw.weights[("rc:" + c["strategy"], c["s"], c["b"])] / reps[i]
        sw.progress(f"round {rnd + 1}/{max(reps)} of the recompute phase's timed passes")
    for i, c in enumerate(cells):
        if i in dropped:
            continue
        sw.rows.append(c)
        rc, pl = sorted(c["rc_times"]), sorted(c["plain_times"])
        sw.progress(f"{c['strategy'] + RC:11s} s={c['s']:5d} b={c['b']}: {rc[len(rc) // 2] * 1e3:8.1f} ms "
                    f"(plain {pl[len(pl) // 2] * 1e3:8.1f} ms), saved {c['saved_bytes'] / 2**20:7.2f} MiB "
                    f"(plain {c['plain_saved_bytes'] / 2**20:7.2f}), transient {c['transient_bytes'] / 2**20:7.2f} "
                    f"MiB (plain {c['plain_transient_bytes'] / 2**20:7.2f})")


# a recompute cell's entries: the plain layer, the layer recomputed, its attention block, its
# MLP block recomputed; the row's keys of each one's memory and times
MEMORY_KEYS = ("plain_", "", "attn_", "mlp_")
TIME_KEYS = ("plain_times", "rc_times", "attn_times", "mlp_times")


def recompute_entries(st: str) -> tuple:
    return (st, st + RC, st + RC_ATTN, st + RC_MLP)


def _recompute_over(sw: Sweep, st: str, s: int, b: int, prev) -> bool:
    """Whether the plain layer of ``st`` at ``s`` is predicted over the memory limit (its
    ``num_layers`` saved + transient) or a rank's free device memory, from the analytic form
    scaled to the last cell measured (``prev``: ``(s, saved, transient)``; the first cell: the
    analytic form alone), so that ``--recompute-only`` at lengths the layer sweep stopped
    before does not start them; a ``recompute_limit`` row then (decided by all ranks)."""
    shape, limit = sw.shape, sw.cfg.memory_limit
    now = analytic.layer_memory(st, shape, s, b)
    if prev is None:
        saved1, trans1 = now
    else:
        was = analytic.layer_memory(st, shape, prev[0], b)
        saved1, trans1 = prev[1] * now[0] / max(was[0], 1.0), prev[2] * now[1] / max(was[1], 1.0)
    guess = saved1 * shape.num_layers + trans1
    if sw.agree(limit is not None and guess > limit):
        _recompute_stop(sw, st, s, b, f"memory limit {limit} bytes: {shape.num_layers} layers' saved + transient "
                                      f"predicted {guess:.0f} bytes")
        return True
    free = M.free_device_bytes()
    if sw.agree(free is not None and saved1 + trans1 > free):
        _recompute_stop(sw, st, s, b, f"predicted out of memory: one layer's saved + transient {saved1 + trans1:.0f} "
                                      "bytes exceed a rank's free device memory")
        return True
    return False


def _recompute_memory(sw: Sweep, st: str, s: int, b: int) -> dict | None:
    """One cell of the recompute phase: the memory of ``st`` and ``st:rc``, and a warm-up of
    both; None (and a ``recompute_limit`` row) where it is over the memory limit or out of
    memory on any rank."""
    limit, L = sw.cfg.memory_limit, sw.shape.num_layers
    row = {"type": "recompute", "strategy": st, "s": s, "b": b, "rank": sw.rank}
    for entry, key in zip(recompute_entries(st), MEMORY_KEYS):
        M.set_strategy(sw.model, entry)
        got, bad = sw.attempt(lambda: sw.runner.memory("layer", s, b), f"{entry} s={s} b={b} (memory)")
        if bad:
            _recompute_stop(sw, st, s, b, oom_reason(bad), oom_ranks=bad)
            return None
        row[key + "saved_bytes"], row[key + "transient_bytes"] = got
        if key == "" and sw.agree(limit is not None and got[0] * L + got[1] > limit):
            _recompute_stop(sw, st, s, b, f"memory limit {limit} bytes: {L} layers' saved + transient = "
                                          f"{got[0] * L + got[1]:.0f} bytes")
            return None
    for entry in recompute_entries(st):
        M.set_strategy(sw.model, entry)
        _, bad = sw.attempt(lambda: sw.runner.time("layer", s, b, sw.cfg.warmup, 0), f"{entry} s={s} b={b} (warm-up)")
        if bad:
            _recompute_stop(sw, st, s, b, oom_reason(bad), oom_ranks=bad)
            return None
    row.update({key: [] for key in TIME_KEYS})
    sw.done_w += sw.weights[("rc:" + st, s, b)]
    return row


def _recompute_stop(sw: Sweep, st: str, s: int, b: int, reason: str, **extra) -> None:
    """A ``recompute_limit`` row: the recompute phase of ``st`` goes no longer than ``s``."""
    sw.rows.append({"type": "recompute_limit", "strategy": st, "s": s, "b": b, "rank": sw.rank, "reason": reason,
                    **extra})
    sw.progress(f"{st}{RC} s={s} b={b}: {reason.split(':')[0]}, its recompute phase stops")


def _nonlayer_rows(sw: Sweep, pool_points: list) -> None:
    """The whole model's non-layer part (embedding, output layer, loss): its pool at
    ``pool_points``, then (unless pool-only) its time and memory per (s, b) and the step's
    update."""
    cfg, shape = sw.cfg, sw.shape
    sw.runner = sw.model = None
    M.free_after_oom()  # the one-layer model's memory back before the whole model is built
    spec, full = M.build(shape, num_layers=shape.num_layers, max_seq=max(cfg.seqs), model_args=cfg.model_args)
    nl = M.NonLayerRunner(full, spec, shape)
    for s, b in pool_points:
        got, bad = sw.attempt(lambda: nl.pool(s, b), f"nonlayer pool s={s} b={b}", net_model=full)
        if bad:
            sw.progress(f"nonlayer pool at s={s} b={b}: {oom_reason(bad)}, left out")
            continue
        sw.rows.append({"type": "pool", "strategy": "nonlayer", "s": s, "b": b, "rank": sw.rank, "buffers": got})
    if cfg.pool_only:
        return
    for b in cfg.batches:
        for s in cfg.seqs:
            if s % shape.p:
                continue
            got, bad = sw.attempt(lambda: nl.measure(s, b, cfg.warmup, cfg.repeats),
                                  f"nonlayer s={s} b={b}", net_model=full)
            if bad:
                sw.stop("nonlayer", s, b, oom_reason(bad), oom_ranks=bad)
                break
            times, saved, trans = got
            sw.rows.append({"type": "nonlayer", "s": s, "b": b, "rank": sw.rank, "nonlayer_times": times,
                            "saved_bytes": saved, "transient_bytes": trans})
    sw.rows.append(_update_row(sw, nl, full))
    sw.progress("non-layer costs done")


def _update_row(sw: Sweep, nl, full) -> dict:
    """The ``optimizer`` row: a training step's gradient reduction and optimizer step."""
    upd = nl.update_times(sw.cfg.warmup, sw.cfg.repeats)
    row = {"type": "optimizer", "rank": sw.rank, "grad_sync_times": upd["grad_sync"],
           "optimizer_times": upd["optimizer"], "param_bytes": M.param_bytes(full)}
    if sw.fake:
        row["comm_seconds"] = analytic.update_comm_seconds(sw.shape, sw.net)
    return row
