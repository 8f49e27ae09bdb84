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
from ..parallel.dispatch import install
from ..parallel.plans import describe
from ..training.arguments import parse_args, transformer_config_from_args
from ..training.forward_step import forward_step
from ..training.trainer import build_model, build_optimizer
from ..units import MiB
from .systems import build_systems

log = logging.getLogger(__name__)


class System:
    """One model + optimizer trained under one planning rule."""

    def __init__(self, name, args, plan_fn, config: dict | None = None):
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)

        self.name, self.args, self.plan_fn = name, args, plan_fn
        self.config = transformer_config_from_args(args, **(config or {}))
        model = build_model(args, self.config)
        self.model = DistributedDataParallel(config=self.config, ddp_config=DistributedDataParallelConfig(),
                                             module=model)
        self.optimizer, _ = build_optimizer(args, self.model)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.static = 0

    def step(self, mb, forward_only: bool = False, optimizer_step: bool = True):
        """One training step on micro-batch ``mb`` (its plan already set); returns the loss."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=partial(forward_step, paradyse=True), data_iterator=iter([mb]),
            model=[self.model], num_microbatches=1, seq_length=mb.seq_length,
            micro_batch_size=mb.tokens.shape[0], forward_only=forward_only)
        if not forward_only and optimizer_step:
            self.optimizer.step()
        r = reports[0]["lm loss"] if reports else None
        return None if r is None else float(r[0] / max(float(r[1]), 1.0))


def _measure(system, mb, memory_pass: str = "separate"):
    """``(seconds, peak bytes, loss)`` of one training step on ``mb``.

    ``memory_pass="separate"`` (default): the step is timed without the CPU memory tracker
    (whose per-op bookkeeping would slow op-heavy strategies more than others), and the peak
    is measured on a second, tracked forward+backward of the same micro-batch without the
    optimizer step (the optimizer's transient is small next to activations; its state is in the
    static bytes). ``"same"``: one tracked step gives both (half the cost, biased times).
    """
    dist.barrier()
    if memory_pass == "same":
        t0 = time.perf_counter()
        with PeakMemory() as m:
            loss = system.step(mb)
        return time.perf_counter() - t0, m.peak_bytes + system.static, loss
    t0 = time.perf_counter()
    loss = system.step(mb)
    seconds = time.perf_counter() - t0
    with PeakMemory() as m:
        system.step(mb, optimizer_step=False)
    return seconds, m.peak_bytes + system.static, loss


def _max_over_ranks(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def bench_world(rank, world, cfg):
    """Run in every rank: returns (on rank 0) the per-system, per-step records."""
    torch.set_num_threads(1)
    cpu_compat.apply()
    args = parse_args(cfg.argv, world_size=world)
    init_parallel(args.tensor_model_parallel_size, seed=args.seed)
    install()
    dataset = pdata.DocumentDataset(cfg.data_prefix, args.seq_length, seed=args.seed,
                                    long_docs=cfg.long_docs, vocab_size=args.vocab_size)
    mult = args.tensor_model_parallel_size
    # the documents: the dataset's seeded order, lengths in [min_len, seq_length]
    docs, g = [], cfg.first_sample
    while len(docs) < cfg.steps:
        if dataset.length(g) >= cfg.min_len:
            docs.append(g)
        g += 1
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
    if spec.pack_mode == "balanced":
        cost_fn, fits_fn = pdata.make_pack_fns(spec.planner)
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
