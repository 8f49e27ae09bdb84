"""A SIMULATION (no GPU ran): a 7B-like model on 8 H100s, analytic roofline costs per strategy.

``python -m megatron_paradyse.bench --simulate`` prints its assumptions, then for a seeded
long-tailed length distribution up to 624K tokens: each static system's predicted time,
skipped (out-of-memory) sequences and longest trainable sequence against ParaDySe (the
repository's planners, heuristic and optimal), written as ``simulation.json`` in ``--out``.
The static systems are every strategy on every layer, plain and recomputed (``<strategy>+rc``:
every layer ``<strategy>:rc``, recomputed in backward); the planners choose strategy and
recompute per layer (``recompute="auto"``).

One rule judges every system (:func:`fits`): a sequence is trained when ``CostModel.step`` on
the system's per-layer plan peaks at most ``budget - margin`` (the same margin for all:
``margin_fraction`` of the budget, default none, the hardware's reserved bytes being every
system's allowance for what the model does not see), and the planners plan under that limit.
Every uniform plan, plain or recomputed, is one of the planners' candidates, so they train
every sequence some static system trains and reach at least the longest length any does.

The cost model (:class:`H100Roofline`, a :class:`~megatron_paradyse.costmodel.base.CostModel`)
is first-order. Its layer time is the fitted cost model's time model
(``costmodel.analytic.time_features``: GEMM and attention FLOPs, wire bytes per collective
class; ``costmodel.fitted.rates_predict``) with datasheet rates in place of fitted ones
(:func:`datasheet_rates`: FLOPs at a fixed fraction of bf16 peak, bytes at a fixed fraction of
NVLink bandwidth, no fixed cost per layer), so a GPU profile's fit is a calibration of this
model; like the fitted model it adds the terms (no overlap of communication with compute).
Memory comes from per-token activation counts; the per-strategy activation factors are the
ratios measured on CPU in this repository (docs/strategies.md). A recomputed layer's cost is
assumed (:meth:`H100Roofline.layer`). Every number is a model output, not a measurement.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from ..costmodel import analytic
from ..costmodel.base import CostModel, LayerCost
from ..costmodel.fit import COMM_FEATURES
from ..costmodel.fitted import rates_predict
from ..costmodel.shape import ModelShape
from ..parallel.plans import make_entry, split_entry
from ..planner import build_planner

GB = 1e9


@dataclasses.dataclass
class Hardware:
    name: str = "NVIDIA H100 SXM 80GB (datasheet)"
    bf16_flops: float = 989e12          # dense bf16 tensor-core peak
    hbm_bytes_per_s: float = 3.35e12
    nvlink_bytes_per_s: float = 450e9   # per direction (900 GB/s bidirectional)
    memory_bytes: float = 80e9
    mfu_matmul: float = 0.55            # achieved fraction of peak in GEMMs
    mfu_attention: float = 0.40         # flash attention fwd+bwd
    comm_efficiency: float = 0.70       # achieved fraction of NVLink bandwidth
    reserved_bytes: float = 4e9         # CUDA context, allocator fragmentation, NCCL buffers


@dataclasses.dataclass
class Model7B:
    name: str = "7B-like (Llama-2-7B shape)"
    num_layers: int = 32
    hidden: int = 4096
    heads: int = 32
    ffn: int = 11008
    vocab: int = 32000
    p: int = 8
    bytes_per_param_state: int = 18     # bf16 param + fp32 main grad, master, Adam m and v


# activation memory kept for backward, relative to tp_sp (measured on CPU at p=4, s=8192:
# docs/strategies.md); colossal's score rows are modelled explicitly instead
# (METP's CPU ratio is 0.25 at h=128; at h=4096 it keeps only layer inputs: modelled below)
SAVED_FACTOR = {"tp_sp": 1.0, "ulysses": 0.88, "ring": 0.84, "colossal": 0.84, "metp": 0.25}


def datasheet_rates(hw: Hardware) -> dict:
    """Seconds per unit of each feature of the fitted time model (``costmodel.fit.RATE_FEATURES``)
    from the datasheet: what a profile on the GPU would fit in their place."""
    link = 1.0 / (hw.nvlink_bytes_per_s * hw.comm_efficiency)
    return {"layer": 0.0, "gemm_flops": 1.0 / (hw.bf16_flops * hw.mfu_matmul),
            "attn_flops": 1.0 / (hw.bf16_flops * hw.mfu_attention), **{k: link for k in COMM_FEATURES}}




class H100Roofline(CostModel):
    """Per-layer fwd+bwd seconds and bytes of each strategy (see the module docstring), plain
    or recomputed in backward (plan entry ``st:rc``, :meth:`recomputes`).

    A recomputed layer is *assumed*, not measured: its time is the plain layer's plus its
    forward once more, the forward being ``1 / analytic.forward_passes`` of the layer (the roofline's own
    split, ``analytic.flops_parts``: a third, a fourth for ``metp``; the roofline assumes the
    same share of the layer's communication, as it has no forward/backward split of its own);
    it keeps one ``[s/p, b, h]`` bf16 tensor (its input); its transient is the plain layer's
    saved + transient (the recompute rebuilds what the plain layer keeps, then its backward
    runs as the plain one's). Its pool is its strategy's (this model has none).
    """

    strategies = ("tp_sp", "ulysses", "ring", "colossal", "metp")

    def __init__(self, hw: Hardware | None = None, m: Model7B | None = None):
        self.hw, self.m = hw or Hardware(), m or Model7B()
        self.num_layers = self.m.num_layers
        h, f = self.m.hidden, self.m.ffn
        self.layer_params = 4 * h * h + 3 * h * f + 2 * h  # QKV+O, SwiGLU MLP, norms
        self.shape = ModelShape(num_layers=self.m.num_layers, hidden=h, heads=self.m.heads,
                                query_groups=self.m.heads, ffn=f, swiglu=True, bias=False,
                                vocab=self.m.vocab, p=self.m.p, dtype="bf16")
        self.rates = datasheet_rates(self.hw)

    def recomputes(self) -> bool:
        return True

    def layer(self, entry, s, b):
        strategy, rc = split_entry(entry)
        saved, transient = self._memory(strategy, s, b)
        seconds = float(rates_predict(self.rates, analytic.time_features(strategy, self.shape, s, b)))
        plain = LayerCost(seconds, saved, transient)
        if rc == "layer":  # the class docstring
            return analytic.assumed_recompute(strategy, plain, s * b * self.m.hidden * 2 / self.m.p)
        if rc:  # one block recomputed (st:rc-attn, st:rc-mlp): assumed as the analytic model does
            return analytic.assumed_block_recompute(strategy, self.shape, s, b, plain, rc)
        return plain

    def recompute_kinds(self) -> tuple:
        return ("layer", "attn", "mlp")

    def _memory(self, strategy, s, b):
        """``(saved, transient)`` bytes of one layer on one rank."""
        m, p, e = self.m, self.m.p, 2
        act = s * b * m.hidden * e                                    # one [s, h] bf16 tensor
        tp_sp_saved = 34 * s * b * m.hidden / p                       # Korthikanti et al., SP, flash
        w_layer = self.layer_params * e                               # one layer's bf16 weights
        mlp_hidden = 3 * s * b * m.ffn * e / p
        saved = SAVED_FACTOR[strategy] * tp_sp_saved
        if strategy == "tp_sp":
            return saved, act + mlp_hidden                            # gathered input, MLP hidden
        if strategy in ("ulysses", "ring"):
            return saved, w_layer + 4 * act / p + mlp_hidden
        if strategy == "colossal":
            rows = m.heads * (s / p) * s * b * e                      # materialised score rows
            return saved + rows, w_layer + rows + mlp_hidden
        if strategy == "metp":  # keeps each layer's input and residual only, recomputes the rest
            return 2 * act / p, tp_sp_saved + 2 * w_layer / p         # one layer's recompute
        raise KeyError(strategy)

    def static_bytes(self):
        m = self.m
        params = m.num_layers * self.layer_params + 2 * m.vocab * m.hidden
        return params / m.p * m.bytes_per_param_state + self.hw.reserved_bytes

    def nonlayer(self, s, b):
        m = self.m
        logits = s * b * m.vocab / m.p * (2 + 4)                      # bf16 logits + fp32 softmax
        flops = 2 * b * s * 2 * m.vocab * m.hidden * 3 / m.p
        t = flops / (self.hw.bf16_flops * self.hw.mfu_matmul)
        return LayerCost(t, s * b * m.hidden * 2 / m.p * 2, logits)


def lengths_distribution(n=600, seed=0, max_len=624 * 1024, min_len=1024):
    """Seeded long-tailed lengths (log-normal, median 16K) clipped to [min_len, max_len]; the longest is max_len."""
    rng = np.random.default_rng(seed)
    x = np.exp(rng.normal(math.log(16384), 1.5, size=n)).astype(np.int64)
    x = np.clip(x, min_len, max_len)
    x[int(np.argmax(x))] = max_len
    return (x // 64 * 64).tolist()


def static_systems(cm: H100Roofline) -> dict:
    """``{name: per-layer plan}`` of the static systems: every strategy on every layer, plain
    (``tp_sp``), recomputed (``tp_sp+rc``: every layer ``tp_sp:rc``) and with the MLP block
    recomputed (``tp_sp+rc-mlp``: every layer ``tp_sp:rc-mlp``, what megatron's selective
    ``--recompute-modules mlp`` runs)."""
    out = {}
    for rc, suffix in ((None, ""), ("layer", "+rc"), ("mlp", "+rc-mlp")):
        for n in cm.strategies:
            out[n + suffix] = (make_entry(n, rc),) * cm.num_layers
    return out


def fits(cm: CostModel, layers, s: int, b: int, limit: float):
    """The one rule every system is judged by: ``(layers, seconds, peak)`` of ``CostModel.step``
    on the per-layer plan when it peaks at most ``limit`` (budget - margin), else None."""
    st = cm.step(tuple(layers), s, b)
    return (tuple(layers), st.seconds, st.peak_bytes) if st.peak_bytes <= limit else None


def simulate(out_dir: str, margin_fraction: float = 0.0, n: int = 600) -> dict:
    """Run the simulation on ``n`` sequences (:func:`lengths_distribution`) under one limit for
    every system, ``budget * (1 - margin_fraction)``, and write ``simulation.json``."""
    hw, m = Hardware(), Model7B()
    cm = H100Roofline(hw, m)
    budget = hw.memory_bytes
    margin = margin_fraction * budget
    limit = budget - margin
    lens = lengths_distribution(n)
    plans = static_systems(cm)
    systems, statics = _systems(cm, plans, budget, margin, limit), list(plans)
    source = ("megatron_paradyse.planner (heuristic and optimal), strategy and recompute per layer, "
              f"under the same limit as every system (margin {margin / GB:g} GB)")
    long_cut = int(np.percentile(lens, 90))
    rows, per_step = {}, {}
    for name, fn in systems.items():
        rows[name], per_step[name] = _run_system(fn, lens, long_cut)
    n_long = sum(1 for s in lens if s >= long_cut)
    result = dict(label="SIMULATION (analytic roofline, no GPU ran)", hardware=dataclasses.asdict(hw),
                  model=dataclasses.asdict(m), budget_bytes=budget, margin_bytes=margin, limit_bytes=limit,
                  fit_rule="a system trains a sequence when CostModel.step on its per-layer plan peaks at "
                           "most budget - margin; the planners plan under that limit",
                  recompute_assumption="st:rc = the plain layer's time x (1 + its forward's share: 1/3, "
                                       "metp 1/4); saved one [s/p, b, h] bf16 tensor; transient the plain "
                                       "layer's saved + transient",
                  planner_source=source, static_systems=statics, references=_references(rows, statics),
                  distribution=dict(n=len(lens), median=float(np.median(lens)), p90=long_cut,
                                    max=max(lens), long_steps=n_long), systems=rows)
    result["headline"] = _headline(rows, per_step, lens, statics, long_cut)
    with open(os.path.join(out_dir, "simulation.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    return result


def _systems(cm, plans: dict, budget: float, margin: float, limit: float) -> dict:
    """``{name: fn(s, b) -> (plan, seconds) or None}``: every static plan of ``plans``, then the
    planners (``paradyse_heuristic``, ``paradyse_optimal``), each judged by :func:`fits` under
    ``limit``."""
    systems = {name: (lambda plan: lambda s, b: fits(cm, plan, s, b, limit))(plan)
               for name, plan in plans.items()}
    for kind in ("heuristic", "optimal"):
        pl = build_planner(kind, cm, budget, margin_bytes=margin)  # recompute="auto": strategy x recompute per layer
        # the planner's choice, judged by the same rule as the static plans
        systems[f"paradyse_{kind}"] = (lambda pl: lambda s, b: (lambda c: fits(cm, c.layers, s, b, limit)
                                                                 if c.fits else None)(pl.plan(s, b)))(pl)
    return systems


def _run_system(fn, lens, long_cut: int) -> tuple:
    """(row, per-sequence seconds or None) of one system over the sequences ``lens``: what it
    trains and skips, its time (on the sequences of at least ``long_cut`` tokens too), its
    most used plans, its longest trainable length."""
    t, toks, oom, t_long, n_long_ok, plans, skipped, per_step = 0.0, 0, 0, 0.0, 0, {}, [], []
    for k, s in enumerate(lens):
        r = fn(s, 1)
        per_step.append(None if r is None else r[1])
        if r is None:
            oom += 1
            skipped.append(k)
            continue
        t += r[1]
        toks += s
        if s >= long_cut:
            t_long += r[1]
            n_long_ok += 1
        key = "+".join(f"{e}*{r[0].count(e)}" for e in dict.fromkeys(r[0]))
        plans[key] = plans.get(key, 0) + 1
    lo, hi = 0, 4 * max(lens) // 1024
    while lo < hi:  # longest trainable (multiple of 1K); what fits shrinks with the length
        mid = (lo + hi + 1) // 2
        if fn(mid * 1024, 1) is not None:
            lo = mid
        else:
            hi = mid - 1
    trained = [s for k, s in enumerate(lens) if per_step[k] is not None]
    row = dict(seconds_fitting_steps=t, tokens_trained=toks, oom_steps=oom,
               sequences_trained=len(lens) - oom, skipped_sequences=skipped,
               longest_trained=max(trained, default=0),
               throughput_tokens_per_s=toks / t if t else 0.0,
               long_steps_seconds=t_long, long_steps_fitting=n_long_ok,
               longest_trainable=lo * 1024, plans=dict(sorted(plans.items(), key=lambda kv: -kv[1])[:6]))
    return row, per_step


def _references(rows: dict, statics: list) -> dict:
    """The leanest static system (longest trainable, then fewest skipped, then fastest) and the
    fastest static system that trains every sequence (None if none does)."""
    leanest = max(statics, key=lambda x: (rows[x]["longest_trainable"], -rows[x]["oom_steps"],
                                          rows[x]["throughput_tokens_per_s"]))
    every = [x for x in statics if rows[x]["oom_steps"] == 0]
    fastest = max(every, key=lambda x: rows[x]["throughput_tokens_per_s"]) if every else None
    return dict(leanest_static=leanest, fastest_static_training_every_sequence=fastest)


def _headline(rows: dict, per_step: dict, lens, statics: list, long_cut: int) -> dict:
    """Each planner against each static system: time saved on the sequences both train (and on
    the long ones among them), how much longer its longest trainable sequence is."""
    h = {}
    for pn in [x for x in rows if x.startswith("paradyse")]:
        pr = rows[pn]
        for ref in statics:
            both = [k for k in range(len(lens)) if per_step[ref][k] is not None and per_step[pn][k] is not None]
            longb = [k for k in both if lens[k] >= long_cut]
            if both:
                h[f"{pn}_time_reduction_vs_{ref}_on_steps_both_fit"] = \
                    1 - sum(per_step[pn][k] for k in both) / sum(per_step[ref][k] for k in both)
            if longb:
                h[f"{pn}_time_reduction_vs_{ref}_on_long_steps_both_fit ({len(longb)})"] = \
                    1 - sum(per_step[pn][k] for k in longb) / sum(per_step[ref][k] for k in longb)
            if rows[ref]["longest_trainable"]:
                h[f"{pn}_longest_vs_{ref}_percent_longer"] = \
                    100 * (pr["longest_trainable"] / rows[ref]["longest_trainable"] - 1)
    return h


def summary(r) -> str:
    """The simulation's result as the command prints it."""
    out = []
    hw, m = r["hardware"], r["model"]
    out.append("=" * 100)
    out.append(f"{r['label']}")
    out.append(f"  hardware: {m['p']} x {hw['name']}: {hw['bf16_flops'] / 1e12:.0f} TFLOP/s bf16 "
               f"(x{hw['mfu_matmul']} GEMM, x{hw['mfu_attention']} attention), NVLink "
               f"{hw['nvlink_bytes_per_s'] / GB:.0f} GB/s per direction (x{hw['comm_efficiency']}), "
               f"{hw['memory_bytes'] / GB:.0f} GB (minus {hw['reserved_bytes'] / GB:.0f} GB reserved)")
    out.append(f"  model: {m['name']}: {m['num_layers']} layers, h {m['hidden']}, {m['heads']} heads, "
               f"SwiGLU ffn {m['ffn']}, vocab {m['vocab']}, bf16, one switching group of p = {m['p']}, "
               f"micro-batch 1, {m['bytes_per_param_state']} bytes of state per parameter")
    d = r["distribution"]
    out.append(f"  lengths: {d['n']} sequences, log-normal, median {d['median']:.0f}, p90 {d['p90']}, max {d['max']}")
    out.append(f"  one rule for every system: {r['fit_rule']} ({r['budget_bytes'] / GB:.0f} GB - "
               f"{r['margin_bytes'] / GB:g} GB = {r['limit_bytes'] / GB:g} GB)")
    out.append(f"  recomputed layers (assumed): {r['recompute_assumption']}")
    out.append(f"  ParaDySe: {r['planner_source']}")
    out.append(f"  {'system':20s} {'skipped':>9s} {'tokens/s':>10s} {'long-step s':>12s} {'longest':>9s}  plans")
    for n, s in r["systems"].items():
        long = f"{s['long_steps_seconds']:.0f}" if s["long_steps_fitting"] == d["long_steps"] else \
            f"{s['long_steps_fitting']}/{d['long_steps']} fit"
        out.append(f"  {n:20s} {s['oom_steps']:9d} {s['throughput_tokens_per_s']:10.0f} {long:>12s} "
                   f"{s['longest_trainable']:9d}  {s['plans']}")
    ref = r["references"]
    out.append(f"  leanest static system: {ref['leanest_static']}; fastest static system that trains every "
               f"sequence: {ref['fastest_static_training_every_sequence']}")
    for k, v in r["headline"].items():
        out.append(f"  {k}: {v:.3f}")
    out.append("=" * 100)
    return "\n".join(out)


def main(a) -> int:
    print(summary(simulate(a.out)))
    return 0


def run_and_report(simulate_fn, setup, summary_fn, json_path=None) -> dict:
    """A simulation command's ending (``simulate_cp``, ``simulate_pipeline``,
    ``simulate_every_dim``): run it, print its summary and its wall time, write the result as
    JSON where asked."""
    import json
    import time

    t0 = time.perf_counter()
    r = simulate_fn(setup)
    print(summary_fn(r))
    print(f"({time.perf_counter() - t0:.1f} s)")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(r, fh, indent=1)
    return r
