"""The benchmark's rank side: every system trains the same batches in one world, interleaved.

Each system is its own model (same seed, so the same initial weights), DDP wrapper and Adam
optimizer, built once over one megatron parallel state (TP = p = the world). Steps are
interleaved: for step k every system runs batch k, the systems' order rotating with k, so a
load change on the shared machine hits every system alike. The plugin is installed once; a
model without a plan runs stock megatron-core code (its unfused attention with ``s x s``
scores on CPU), which is the ``stock`` system.

Per step and system: wall time of the training step (max over ranks, measured without the
memory tracker), peak memory (max over ranks) = the peak live bytes above the start of a
second, tracked forward+backward of the same micro-batch
(:class:`~megatron_paradyse.memory.PeakMemory`) plus the static bytes (parameters, gradient buffers, optimizer state; measured after a
warm-up step), the plan, and the cost model's prediction for that plan.

With pipeline stages (``cfg.pp`` > 1, :func:`pipeline_world`): megatron's parallel state with
``pp`` stages of p ranks, each system builds its stage's model; a step is ``pp_microbatches``
documents run together under 1F1B (``training/p2p_shapes.py`` answers the p2p shape exchange for
planned steps; stock runs megatron's own); the peak is per stage (max over its ranks, static
bytes and the communication pool held at the step's start included), beside the predicted one.

With context parallelism (``cfg.cp`` > 1): megatron's parallel state with ``cp`` x p ranks;
micro-batches padded to 2 x cp x p, each CP rank runs its two chunks (``forward_step``), the
loss is summed over the CP ranks; the cost model is the in-node one under ``CPCostModel``.
Both (``pp`` x ``cp`` x p ranks): the pipeline world, each stage's layers under CP, the p2p
tensors of s / cp tokens per CP rank, the stage planners priced by ``CPCostModel``.
"""
from __future__ import annotations

import logging
import time
from functools import partial

import torch
import torch.distributed as dist

from .. import cpu_compat
from .. import data as pdata
from ..costmodel.ranks import init_parallel
from ..memory import PeakMemory, static_bytes
from ..parallel.buffers import release_pool
from ..parallel.dispatch import install
from ..parallel.plan_check import collective_device
from ..parallel.plans import describe
from ..training import p2p_shapes
from ..training.arguments import parse_args, transformer_config_from_args
from ..training.dims import dims_of
from ..training.forward_step import forward_step
from ..training.run_report import max_per_stage, pool_bytes
from ..training.trainer import build_optimizer, interleaved_inputs, model_chunks
from ..units import MiB
from .systems import build_systems

log = logging.getLogger(__name__)


class System:
    """One model + optimizer trained under one planning rule."""

    def __init__(self, name, args, plan_fn, config: dict | None = None):
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

        self.name, self.args, self.plan_fn = name, args, plan_fn
        self.dims = dims_of(args)  # the layout parse_args built and checked
        self.config = transformer_config_from_args(args, **(config or {}))
        # the interleaved schedule (dims.vpp): its V model chunks, as the trainer builds them
        self.chunks = model_chunks(args, self.config, DistributedDataParallelConfig(), self.dims.vpp)
        self.model = self.chunks[0]
        self.whole_model = self.model if self.dims.vpp is None else torch.nn.ModuleList(self.chunks)
        self.optimizer, _ = build_optimizer(args, self.chunks)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync if self.dims.vpp is None else [c.no_sync for c in self.chunks]
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.static = 0

    def step(self, mb, forward_only: bool = False, optimizer_step: bool = True):
        """One training step on micro-batch ``mb`` (its plan already set), or on a list of them
        (pipeline stages: run in this order under 1F1B); returns the loss (summed over stages,
        and over CP ranks: each runs its chunks)."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mbs = mb if isinstance(mb, list) else [mb]
        staged = self.dims.pp_on
        if self.dims.vpp is not None:
            shapes = _expect_shapes(mbs, self.config.hidden_size, self.dims, queue=False)
            inputs = interleaved_inputs(self.config, self.chunks, iter(mbs), mbs, shapes,
                                        parallel_state.get_pipeline_model_parallel_rank(), self.dims, forward_only)
        else:
            if staged:
                _expect_shapes(mbs, self.config.hidden_size, self.dims)
            inputs = dict(model=[self.model], data_iterator=iter(mbs))
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=partial(forward_step, paradyse=True, cp=self.dims.cp),
            **inputs, num_microbatches=len(mbs), seq_length=max(m.seq_length for m in mbs),
            micro_batch_size=mbs[0].tokens.shape[0], forward_only=forward_only)
        if staged:
            p2p_shapes.clear()
            release_pool()  # as the trainer: nothing of the pool outlives the step
        if not forward_only and optimizer_step:
            self.optimizer.step()
        if not staged:
            r = reports[0]["lm loss"].detach().double() if reports else None
            if r is not None and self.dims.cp_on:
                dist.all_reduce(r, group=parallel_state.get_context_parallel_group())
            return None if r is None else float(r[0] / max(float(r[1]), 1.0))
        total = torch.zeros(2, dtype=torch.float64)
        for r in reports:  # the last stage's; summed over the stages below
            total += r["lm loss"].detach().double().cpu()
        total = p2p_shapes.sum_over_stages(total, collective_device())
        if self.dims.cp_on:  # each CP rank's losses are its own chunks'
            t = total.to(collective_device())
            dist.all_reduce(t, group=parallel_state.get_context_parallel_group())
            total = t.cpu()
        return float(total[0] / max(float(total[1]), 1.0))


def _expect_shapes(mbs, hidden: int, dims, queue: bool = True):
    """ParaDySe's p2p shapes for a step whose micro-batches all have plans (queued in their
    order unless ``queue`` is False: the interleaved schedule queues them in its own); stock
    (plan None) runs megatron's own shape exchange: None."""
    if any(m.plan is None for m in mbs):
        p2p_shapes.clear()
        return None
    shapes = [p2p_shapes.micro_batch_shape(m, hidden, dims) for m in mbs]
    if queue:
        p2p_shapes.expect(shapes)
    return shapes


def _measure(system, mb, memory_pass: str = "separate", count_pool: bool = False):
    """``(seconds, peak bytes, loss)`` of one training step on ``mb`` (a micro-batch, or a
    pipelined step's list of them).

    ``memory_pass="separate"`` (default): the step is timed without the CPU memory tracker
    (whose per-op bookkeeping would slow op-heavy strategies more than others), and the peak
    is measured on a second, tracked forward+backward of the same micro-batch without the
    optimizer step (the optimizer's transient is small next to activations; its state is in the
    static bytes). ``"same"``: one tracked step gives both (half the cost, biased times).
    ``count_pool``: also count the communication pool held when the tracker starts (as the
    trainer does; stock keeps megatron's gather buffer between steps).
    """
    dist.barrier()
    if memory_pass == "same":
        held = pool_bytes() if count_pool else 0
        t0 = time.perf_counter()
        with PeakMemory() as m:
            loss = system.step(mb)
        return time.perf_counter() - t0, m.peak_bytes + system.static + held, loss
    t0 = time.perf_counter()
    loss = system.step(mb)
    seconds = time.perf_counter() - t0
    held = pool_bytes() if count_pool else 0
    with PeakMemory() as m:
        system.step(mb, optimizer_step=False)
    return seconds, m.peak_bytes + system.static + held, loss


def _max_over_ranks(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _documents(dataset, cfg) -> list:
    """The run's documents: the dataset's seeded order from ``cfg.first_sample``, lengths in
    [min_len, seq_length], ``cfg.documents`` of them."""
    docs, g = [], cfg.first_sample
    while len(docs) < cfg.documents:
        if dataset.length(g) >= cfg.min_len:
            docs.append(g)
        g += 1
    return docs


def bench_world(rank, world, cfg):
    """Run in every rank: returns (on rank 0) the per-system, per-step records (pipeline
    stages: :func:`pipeline_world`)."""
    if cfg.dims.pp_on:
        return pipeline_world(rank, world, cfg)
    torch.set_num_threads(1)
    cpu_compat.apply()
    args = parse_args(cfg.argv, world_size=world)
    dims = dims_of(args)
    init_parallel(dims.tp, seed=args.seed, context_parallel_size=dims.cp)
    install()
    dataset = pdata.DocumentDataset(cfg.data_prefix, args.seq_length, seed=args.seed,
                                    long_docs=cfg.long_docs, vocab_size=args.vocab_size)
    mult = args.paradyse_pad_multiple
    docs = _documents(dataset, cfg)
    batches = [pdata.pad_to_multiple([dataset[g]], mult) for g in docs]
    specs, notes = build_systems(cfg, args)
    systems = []
    for spec in specs:
        systems.append((spec, System(spec.name, args, spec.plan_for, spec.config)))
    steps_of = {spec.name: _packed_steps(spec, docs, dataset, cfg, args, mult) if spec.packed else batches
                for spec in specs}
    warm = pdata.pad_to_multiple([dataset[0][:65]], mult)
    for spec, sysm in systems:  # warm-up: creates optimizer state, communication pools
        warm.plan = spec.plan_for(warm.seq_length, 1)
        sysm.step(warm)
        sysm.static = static_bytes(sysm.model, sysm.optimizer)
    records = {spec.name: [] for spec, _ in systems}
    t_start = time.perf_counter()
    for k in range(max(len(v) for v in steps_of.values())):
        order = systems[k % len(systems):] + systems[:k % len(systems)]
        for spec, sysm in order:
            if k < len(steps_of[spec.name]):
                records[spec.name].append(_record(spec, sysm, steps_of[spec.name][k], k, cfg))
        if rank == 0 and cfg.verbose:
            line = "  ".join(f"{spec.name}={records[spec.name][-1]['seconds']:.2f}s" for spec, _ in systems
                             if k < len(steps_of[spec.name]))
            log.info(f"  step {k + 1:3d} | {line}")
    out = {"records": records, "static_bytes": {spec.name: s.static for spec, s in systems},
           "notes": notes, "seconds": time.perf_counter() - t_start,
           "systems": [spec.describe() for spec, _ in systems]}
    if cfg.search:
        out["search"] = {}
        for spec, sysm in systems:
            if spec.packed:  # the search is over single sequences
                continue
            try:
                out["search"][spec.name] = _search(spec, sysm, cfg, args, dataset, mult, rank)
            except Exception as e:  # noqa: BLE001 - same on every rank (deterministic); keep the rest
                out["search"][spec.name] = {"longest_fitting": None, "error": f"{type(e).__name__}: {e}"}
    for spec, _ in systems:
        out["notes"].extend(dict.fromkeys(spec.errors))
    return out if rank == 0 else None


def _record(spec, sysm, mb, k, cfg) -> dict:
    """One measured step of ``spec`` on micro-batch ``mb`` (its plan set here)."""
    mb.plan = spec.plan_for(mb.plan_length, 1)
    sec, peak, loss = _measure(sysm, mb, cfg.memory_pass)
    sec, peak = _max_over_ranks([sec, peak])
    pred = spec.predict(mb.plan, mb.plan_length, 1)
    return dict(step=k, length=int(sum(mb.lengths)), padded=mb.seq_length, documents=len(mb.lengths),
                seconds=sec, peak_bytes=peak, loss=loss, plan=None if mb.plan is None else describe(mb.plan),
                plan_layers=None if mb.plan is None else list(mb.plan),
                predicted_seconds=None if pred is None else pred[0],
                predicted_peak_bytes=None if pred is None else pred[1], planner_fits=spec.last_fits)


def _packed_steps(spec, docs, dataset, cfg, args, mult) -> list:
    """The packed system's micro-batches over ``docs``: one step per pack
    (``data.PackScheduler`` with every document in one step: greedy token-cap packing for a
    static strategy, balanced packing with the planner's fit and cost for a planner)."""
    lengths = [dataset.length(g) for g in docs]
    cost_fn = fits_fn = None
    if spec.pack_mode == "balanced":  # every pack a step of its own: each pays an optimizer update
        cost_fn, fits_fn = pdata.make_pack_fns(spec.planner, per_pack_seconds=spec.planner.update_seconds())
    sched = pdata.PackScheduler(lambda i: lengths[i], len(docs), 1, token_cap=cfg.pack_tokens or args.seq_length,
                                seed=args.seed, mode=spec.pack_mode, cost_fn=cost_fn, fits_fn=fits_fn)
    return [pdata.pack_documents([dataset[docs[i]] for i in pack], mult) for pack in sched.step_packs(0)[0]]


def _probe(spec, sysm, s, mult, vocab):
    doc = (torch.arange(s + 1) * 7 % min(vocab, 256)).numpy()
    mb = pdata.pad_to_multiple([doc], mult)
    mb.plan = spec.plan_for(mb.seq_length, 1)
    sec, peak, _ = _measure(sysm, mb, "same")  # the search needs the peak only
    sec, peak = _max_over_ranks([sec, peak])
    return peak, sec


def _search(spec, sysm, cfg, args, dataset, mult, rank):
    """The longest length (multiple of ``resolution``) whose measured step peak fits the budget.

    Starts from the cost model's prediction where there is one (``spec.predicted_max``), else
    from ``seq_length / 4``; doubles or halves to bracket, then bisects; at most
    ``cfg.search_probes`` measured steps; lengths above ``cfg.search_cap`` are not tried.
    """
    budget, res, cap = cfg.budget_bytes, cfg.search_resolution, cfg.search_cap
    probes = []
    guess = spec.predicted_max(cap, res) or args.seq_length // 4
    s = max(res, min(cap, guess // res * res))
    lo, hi = 0, None  # lo fits (measured), hi does not

    def fits(n):
        peak, sec = _probe(spec, sysm, n, mult, args.vocab_size)
        probes.append({"length": n, "peak_bytes": peak, "seconds": sec, "fits": peak <= budget})
        if rank == 0 and cfg.verbose:
            log.info(f"  search {spec.name}: s={n} peak {peak / MiB:.1f} MiB "
                     f"{'fits' if peak <= budget else 'over'} ({sec:.1f} s)")
        return peak <= budget
    for _ in range(cfg.search_probes):
        if fits(s):
            lo = s
        else:
            hi = s
        if hi is None:
            if lo >= cap:
                break
            s = min(cap, lo * 2)
        elif lo == 0:
            if hi <= res:
                break
            s = max(res, hi // 2 // res * res)
        else:
            if hi - lo <= res:
                break
            s = (lo + hi) // 2 // res * res
    return {"longest_fitting": lo, "shortest_over": hi, "capped": hi is None and lo >= cap,
            "probes": probes}


# ------------------------------------------------------------------------------ pipeline stages


def pipeline_world(rank, world, cfg):
    """:func:`bench_world` with ``cfg.pp`` pipeline stages (world = pp x cp x p, megatron's
    rank order: TP fastest, then CP): step k is documents ``k*M .. k*M+M-1`` (M = ``cfg.pp_microbatches``),
    one micro-batch each, run under 1F1B in the system's run order; every system trains the
    same steps, interleaved with rotating order. Returns (rank 0) the records, each with the
    step's per-stage measured peaks (max over the stage's ranks) and predicted peaks."""
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    cpu_compat.apply()
    args = parse_args(cfg.argv, world_size=world)
    dims = dims_of(args)
    init_parallel(dims.tp, seed=args.seed, pipeline_model_parallel_size=dims.pp, context_parallel_size=dims.cp,
                  virtual_pipeline_model_parallel_size=dims.vpp)
    install()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    dataset = pdata.DocumentDataset(cfg.data_prefix, args.seq_length, seed=args.seed,
                                    long_docs=cfg.long_docs, vocab_size=args.vocab_size)
    mult, M = dims.seq_divisor, cfg.pp_microbatches
    mbs = [pdata.pad_to_multiple([dataset[g]], mult) for g in _documents(dataset, cfg)]
    steps = [mbs[k * M:(k + 1) * M] for k in range(cfg.steps)]
    specs, notes = build_systems(cfg, args)
    systems = [(spec, System(spec.name, args, spec.plan_for, spec.config)) for spec in specs]
    warm = [pdata.pad_to_multiple([dataset[0][:65]], mult) for _ in range(M)]
    static = {}
    for spec, sysm in systems:  # warm-up: optimizer state, communication pools
        sysm.step(_planned(spec, warm)[0])
        sysm.static = static_bytes(sysm.whole_model, sysm.optimizer)
        static[spec.name] = max_per_stage(sysm.static, stage, cfg.pp)
    records = {spec.name: [] for spec, _ in systems}
    t_start = time.perf_counter()
    for k, step in enumerate(steps):
        order = systems[k % len(systems):] + systems[:k % len(systems)]
        for spec, sysm in order:
            records[spec.name].append(_staged_record(spec, sysm, step, k, cfg, stage))
        if rank == 0 and cfg.verbose:
            line = "  ".join(f"{spec.name}={records[spec.name][-1]['seconds']:.2f}s" for spec, _ in systems)
            log.info(f"  step {k + 1:3d} | {line}")
    for spec, _ in systems:
        notes.extend(dict.fromkeys(spec.errors))
    out = {"records": records, "static_bytes": {n: max(v) for n, v in static.items()},
           "stage_static_bytes": static, "notes": notes, "seconds": time.perf_counter() - t_start,
           "systems": [spec.describe() for spec, _ in systems]}
    return out if rank == 0 else None


def _planned(spec, mbs) -> tuple:
    """``(micro-batches in run order with their plans set, step plan)`` of ``spec`` on ``mbs``."""
    sp = spec.step_plan([(m.seq_length, m.tokens.shape[0]) for m in mbs])
    for j, m in enumerate(mbs):
        m.plan = sp["plans"][j]
    return [mbs[j] for j in sp["order"]], sp


def _staged_record(spec, sysm, mbs, k, cfg, stage) -> dict:
    """One measured pipelined step of ``spec`` on the step's micro-batches ``mbs``."""
    t0 = time.perf_counter()
    run, sp = _planned(spec, mbs)
    plan_seconds = time.perf_counter() - t0
    sec, peak, loss = _measure(sysm, run, cfg.memory_pass, count_pool=True)
    sec = _max_over_ranks([sec])[0]
    stages = max_per_stage(peak, stage, cfg.pp)
    pred = sp["stage_peaks"]
    plans = [m.plan for m in run]
    return dict(step=k, length=int(sum(sum(m.lengths) for m in mbs)), padded=sum(m.seq_length for m in mbs),
                documents=len(mbs), lengths=[int(sum(m.lengths)) for m in mbs], order=list(sp["order"]),
                seconds=sec, peak_bytes=max(stages), stage_peak_bytes=stages, loss=loss,
                plan=None if plans[0] is None else "; ".join(describe(p) for p in plans),
                plan_layers=None if plans[0] is None else [list(p) for p in plans],
                predicted_seconds=sp["seconds"], predicted_peak_bytes=None if pred is None else max(pred),
                predicted_stage_peak_bytes=pred, planner_fits=sp["fits"], plan_seconds=plan_seconds)
