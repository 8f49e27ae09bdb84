"""A SIMULATION (no GPU ran): a 7B-like model on 8 H100s, analytic roofline costs per strategy.

``python -m megatron_paradyse.bench --simulate`` prints its assumptions, then for a seeded
long-tailed length distribution up to 624K tokens: each static strategy's predicted time,
out-of-memory steps and longest trainable sequence against ParaDySe (the repository's
planners, heuristic and optimal), written as ``simulation.json`` (and ``simulation.png``) in ``--out``.

The cost model (:class:`H100Roofline`, a :class:`~megatron_paradyse.costmodel.base.CostModel`)
is first-order. Its layer time is the fitted cost model's time model
(``costmodel.analytic.time_features``: GEMM and attention FLOPs, wire bytes per collective
class; ``costmodel.fitted.rates_predict``) with datasheet rates in place of fitted ones
(:func:`datasheet_rates`: FLOPs at a fixed fraction of bf16 peak, bytes at a fixed fraction of
NVLink bandwidth, no fixed cost per layer), so a GPU profile's fit is a calibration of this
model; like the fitted model it adds the terms (no overlap of communication with compute).
Memory comes from per-token activation counts; the per-strategy activation factors are the
ratios measured on CPU in this repository (docs/strategies.md). Every number is a model
output, not a measurement.
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
    """Per-layer fwd+bwd seconds and bytes of each strategy (see the module docstring)."""

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

    def layer(self, strategy, s, b):
        saved, transient = self._memory(strategy, s, b)
        seconds = rates_predict(self.rates, analytic.time_features(strategy, self.shape, s, b))
        return LayerCost(float(seconds), saved, transient)

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


def simulate(out_dir: str) -> dict:
    hw, m = Hardware(), Model7B()
    cm = H100Roofline(hw, m)
    budget = hw.memory_bytes
    lens = lengths_distribution()
    planners = {}
    for kind in ("heuristic", "optimal"):
        pl = build_planner(kind, cm, budget)
        planners[f"paradyse_{kind}"] = (lambda pl: lambda s, b: (lambda c: (tuple(c.layers), c.seconds, c.peak_bytes) if c.fits else None)(pl.plan(s, b)))(pl)
    source = "megatron_paradyse.planner (heuristic and optimal)"
    systems = {n: (lambda n: lambda s, b: (lambda st: ((n,) * m.num_layers, st.seconds, st.peak_bytes)
                                                       if st.peak_bytes <= budget else None)(cm.step({n: m.num_layers}, s, b)))(n)
               for n in cm.strategies}
    systems.update(planners)
    long_cut = int(np.percentile(lens, 90))
    rows, per_step = {}, {}
    for name, fn in systems.items():
        t, toks, oom, t_long, n_long_ok, plans = 0.0, 0, 0, 0.0, 0, {}
        per_step[name] = []
        for s in lens:
            r = fn(s, 1)
            per_step[name].append(None if r is None else r[1])
            if r is None:
                oom += 1
                continue
            t += r[1]
            toks += s
            if s >= long_cut:
                t_long += r[1]
                n_long_ok += 1
            key = "+".join(f"{k}*{r[0].count(k)}" for k in dict.fromkeys(r[0]))
            plans[key] = plans.get(key, 0) + 1
        lo, hi = 0, 4 * max(lens) // 1024
        while lo < hi:  # longest trainable (multiple of 1K)
            mid = (lo + hi + 1) // 2
            if fn(mid * 1024, 1) is not None:
                lo = mid
            else:
                hi = mid - 1
        rows[name] = dict(seconds_fitting_steps=t, tokens_trained=toks, oom_steps=oom,
                          throughput_tokens_per_s=toks / t if t else 0.0,
                          long_steps_seconds=t_long, long_steps_fitting=n_long_ok,
                          longest_trainable=lo * 1024, plans=dict(sorted(plans.items(), key=lambda kv: -kv[1])[:6]))
    n_long = sum(1 for s in lens if s >= long_cut)
    result = dict(label="SIMULATION (analytic roofline, no GPU ran)", hardware=dataclasses.asdict(hw),
                  model=dataclasses.asdict(m), budget_bytes=budget, planner_source=source,
                  distribution=dict(n=len(lens), median=float(np.median(lens)), p90=long_cut,
                                    max=max(lens), long_steps=n_long), systems=rows)
    para = [n for n in rows if n.startswith("paradyse")]
    h = {}
    for pn in para:
        pr = rows[pn]
        for ref in cm.strategies:
            both = [k for k, s in enumerate(lens) if per_step[ref][k] is not None and per_step[pn][k] is not None]
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
    result["headline"] = h
    with open(os.path.join(out_dir, "simulation.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    return result


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
    out.append(f"  ParaDySe: {r['planner_source']}")
    out.append(f"  {'system':20s} {'OOM steps':>9s} {'tokens/s':>10s} {'long-step s':>12s} {'longest':>9s}  plans")
    for n, s in r["systems"].items():
        long = f"{s['long_steps_seconds']:.0f}" if s["long_steps_fitting"] == d["long_steps"] else \
            f"{s['long_steps_fitting']}/{d['long_steps']} fit"
        out.append(f"  {n:20s} {s['oom_steps']:9d} {s['throughput_tokens_per_s']:10.0f} {long:>12s} "
                   f"{s['longest_trainable']:9d}  {s['plans']}")
    for k, v in r["headline"].items():
        out.append(f"  {k}: {v:.3f}")
    out.append("=" * 100)
    return "\n".join(out)


def main(a) -> int:
    print(summary(simulate(a.out)))
    return 0
