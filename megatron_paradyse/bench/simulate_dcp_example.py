"""A SIMULATION (no GPU ran): megatron's own Dynamic CP example, reproduced on the roofline.

``python -m megatron_paradyse.bench.simulate_dcp_example`` prices megatron-core's example
``examples/dynamic_context_parallel`` (``benchmark_dcp.sh``, dev branch) with the in-node
roofline of the other simulations (``simulate.datasheet_rates``: FLOPs at a fixed fraction of
bf16 peak, bytes at a fixed fraction of the link, no fixed cost) and ``costmodel.cp``'s CP ring,
and sets the predicted speedup of Dynamic CP over ``dp_balanced`` beside the published one.

What the example runs (read from megatron-core, not copied): a GPT of 12 layers, hidden 2048,
16 heads, ffn 8192 (GELU), vocabulary 131072, bf16, TP 1, CP 4, PP 1, micro-batch 1, 8
micro-batches per DP rank (global batch = 8 x DP sequences), 30 iterations of which the first
10 are dropped, 10%-trimmed mean of the rest. Its mock sequences: log-normal with mean 1024 and
sigma 1.5 (mu = ln 1024 - sigma^2 / 2), clipped to [128, 8192], drawn from a seeded NumPy
generator; each sequence is ``length - 1`` tokens padded to the data path's divisor (2 CP, or
2 DP CP under Dynamic CP). The two schedulers (:func:`dp_balanced_groups`,
:func:`dcp_groups`), as megatron-core implements them:

* ``dp_balanced``: the global batch's sequences in order, packed next-fit into packs of at
  most ``max_seqlen_per_dp_cp_rank x CP`` tokens, the last packs split until their number is a
  multiple of DP; pack ``i DP + j`` is DP rank j's micro-batch i, on its fixed CP group of 4;
* Dynamic CP: the sequences longest first, in rounds (micro-batches) over the whole DP x CP
  pool; each sequence's CP size at least the power of two that keeps it under the per-rank cap
  (``2 ** ceil(log2(s / cap))``), then the CP size and group (an existing one of that size, or
  new free ranks) of the smallest projected per-rank workload ``s^2 / c`` under the round's cap
  (the longest sequence x the per-rank cap x 1.05); what fits no group waits for the next
  round; empty ranks are filled by doubling the smallest group, or else the round falls back to
  one group of every rank.

A micro-batch's seconds on a rank of a CP group of c (:class:`ExampleCost`): its tokens' GEMM
FLOPs / c, its documents' causal attention FLOPs (sum of s^2) / c, the output layer's
6 T h V / c, at the roofline's rates; plus, for c > 1, ``CPCostModel.ring_seconds`` of its
tokens on the link the group uses (NVLink inside a node of 4 GPUs, the scale-out link across
nodes). A step: each group starts when all its ranks are free (ranks run their micro-batches in
order; a group waits for its slowest member), step = the last rank's end + the update
(the fp32 gradient all-reduce over the DP x CP ranks, then Adam at HBM bandwidth: the same for
both schedulers). Every number is a model output, not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import types

import numpy as np

from ..costmodel.analytic import flops_parts, load_config, param_counts
from ..costmodel.cp import CPCostModel, Links
from ..costmodel.shape import ModelShape
from ..errors import ArgumentParser, UserError, command
from .simulate import Hardware, datasheet_rates
from .simulate_pipeline import ADAM_BYTES_PER_PARAM

# the example's README: 10%-trimmed-mean speedup of Dynamic CP over dp_balanced per GPU count,
# and its trimmed-mean iteration ms (dp_balanced, Dynamic CP)
PUBLISHED = types.MappingProxyType({4: (1.285, 195.269, 151.906), 8: (1.412, 220.119, 155.850),
                                    16: (1.212, 226.775, 187.125), 32: (1.375, 286.206, 208.088),
                                    64: (1.495, 271.988, 181.912)})
AIM = 0.15                       # the aim: within 15% of each published speedup
WORKLOAD_CAP_SLACK = 0.05        # megatron's Dynamic CP: a round's cap is 5% over tallest x per-rank cap
SCALE_OUT = ("ib_ndr", "nvlink")  # the link between nodes: NDR InfiniBand, or one NVLink domain


@dataclasses.dataclass(frozen=True)
class ExampleModel:
    """``benchmark_dcp.sh``'s GPT: GELU MLP, tied embeddings (its defaults)."""

    name: str = "megatron's Dynamic CP example GPT"
    num_layers: int = 12
    hidden: int = 2048
    heads: int = 16
    ffn: int = 8192
    vocab: int = 131072

    def shape(self) -> ModelShape:
        return ModelShape(num_layers=self.num_layers, hidden=self.hidden, heads=self.heads,
                          query_groups=self.heads, ffn=self.ffn, swiglu=False, bias=True, vocab=self.vocab,
                          p=1, dtype="bf16")


@dataclasses.dataclass(frozen=True)
class ExampleSetup:
    """The example's run (``benchmark_dcp.sh``'s defaults) and this model's own settings."""

    gpus: tuple = (4, 8, 16, 32, 64)
    cp: int = 4
    gpus_per_node: int = 4          # the README's cluster: four GPUs per node
    micro_batches: int = 8          # per DP rank: global batch = 8 x DP sequences
    max_seqlen_per_rank: int = 2048
    min_dcp: int = 1
    min_len: int = 128
    max_len: int = 8192
    mean_len: int = 1024
    sigma: float = 1.5
    iterations: int = 30
    warmup: int = 10
    trim: float = 0.1
    seed: int = 0                   # the mock dataset's NumPy seed
    overlap: float = 0.0            # fraction of the CP ring hidden behind attention
    scale_out: str = "nvlink"
    hop_ms: float = 0.0             # a fixed cost per CP ring hop (kernel launches, P2P sync); the roofline's: 0
    layer_ms: float = 0.0           # a fixed cost per layer and micro-batch; the roofline's: 0
    rate_scale: float = 1.0         # seconds x this (1 / the achieved fraction of the roofline's rates)


def example_lengths(n: int, st: ExampleSetup) -> list:
    """``n`` sequence lengths as megatron's mock varlen dataset draws them (log-normal of mean
    ``mean_len``, clipped, truncated to int), in the order drawn."""
    mu = math.log(st.mean_len) - st.sigma ** 2 / 2
    x = np.random.RandomState(st.seed).lognormal(mu, st.sigma, n)
    return np.clip(x, st.min_len, st.max_len).astype(int).tolist()


def padded(length: int, divisor: int) -> int:
    """A mock sample's tokens (``length - 1``) padded to a multiple of ``divisor``."""
    return -(-(length - 1) // divisor) * divisor


# ------------------------------------------------------------------------------------------
# the costs


class ExampleCost:
    """Seconds of one micro-batch on one rank of a CP group (the module docstring), and of the
    update; the roofline's rates (``datasheet_rates``) on the example's shape at p = 1."""

    def __init__(self, m: ExampleModel, hw: Hardware, st: ExampleSetup):
        self.shape, self.hw, self.st = m.shape(), hw, st
        rates = datasheet_rates(hw)
        gemm, att = flops_parts("tp_sp", self.shape, 1, 1)     # per token; per token^2
        L, h, V = m.num_layers, m.hidden, m.vocab
        self.per_token = rates["gemm_flops"] * (L * gemm + 6.0 * h * V)
        self.per_square = rates["attn_flops"] * L * att
        nvlink = hw.nvlink_bytes_per_s * hw.comm_efficiency
        net = load_config("interconnects.json")["ib_ndr"]
        hop = st.hop_ms / 1e3
        far = (nvlink, hop) if st.scale_out == "nvlink" else (float(net["bandwidth"]), max(hop, float(net["alpha"])))
        self.links = {False: Links(nvlink, hop, nvlink, hop, "nvlink (roofline)", "nvlink (roofline)"),
                      True: Links(nvlink, hop, far[0], far[1], "nvlink (roofline)", st.scale_out)}
        self.sync = {False: (nvlink, 0.0), True: (far[0], 0.0 if st.scale_out == "nvlink" else float(net["alpha"]))}
        self.rings: dict = {}

    def seconds(self, lens, c: int, across: bool) -> float:
        """One rank's seconds for a micro-batch of the documents ``lens`` on a CP group of ``c``
        ranks (``across``: the group spans nodes)."""
        T, sq = float(sum(lens)), float(sum(x * x for x in lens))
        t = self.st.rate_scale * (self.per_token * T + self.per_square * sq) / c \
            + self.shape.num_layers * self.st.layer_ms / 1e3
        if c > 1:
            key = (c, across)
            if key not in self.rings:
                self.rings[key] = CPCostModel(_RingBase(self.shape), c, self.links[across], shape=self.shape,
                                              overlap=self.st.overlap, hardware="h100")
            cm = self.rings[key]
            t += self.shape.num_layers * (1 - cm.overlap) * cm.ring_seconds("tp_sp", -(-int(T) // c) * c, 1)
        return t

    def update_seconds(self, ranks: int) -> float:
        """The fp32 gradient all-reduce over ``ranks`` (ring; NVLink inside a node, else the
        scale-out link) and Adam over every parameter at HBM bandwidth."""
        pc = param_counts(self.shape)
        P = pc["layers"] + pc["embedding"] + pc["final_norm"]   # tied output layer
        bw, alpha = self.sync[ranks > self.st.gpus_per_node]   # the link's own alpha: no CP hop cost
        sync = 0.0 if ranks == 1 else 2 * (ranks - 1) * (alpha + 4 * P / ranks / bw)
        return sync + P * ADAM_BYTES_PER_PARAM / self.hw.hbm_bytes_per_s


class _RingBase:
    """What ``CPCostModel`` asks of its base when only its ring is priced."""

    strategies = ("tp_sp",)

    def __init__(self, shape: ModelShape):
        self.shape, self.num_layers = shape, shape.num_layers

    def device_kind(self) -> str:
        return "cuda"


# ------------------------------------------------------------------------------------------
# the schedulers: [(ranks, documents)] per micro-batch, in run order


def dp_balanced_groups(lens: list, dp: int, st: ExampleSetup) -> list:
    """megatron's ``dp_balanced``: next-fit packs of at most cap x CP tokens in the data's
    order, the last ones split until their number is a multiple of DP; pack ``i dp + j`` on
    DP rank j's CP group (ranks ``j CP`` to ``j CP + CP - 1``) as its micro-batch i."""
    cap, packs_, cur = st.max_seqlen_per_rank * st.cp, [], []
    for s in lens:
        if cur and sum(cur) + s > cap:
            packs_.append(cur)
            cur = []
        cur.append(s)
    packs_.append(cur)
    i = len(packs_) - 1
    while len(packs_) % dp:
        if len(packs_[i]) > 1:
            packs_.append([packs_[i].pop()])
        else:
            i -= 1
    return [(tuple(range(j * st.cp, (j + 1) * st.cp)), packs_[k]) for k in range(len(packs_)) for j in [k % dp]]


def dcp_needed(s: int, st: ExampleSetup) -> int:
    """Dynamic CP's smallest CP size of a sequence: a power of two, at least ``min_dcp``."""
    return max(st.min_dcp, 1 << max(0, math.ceil(math.log2(s / st.max_seqlen_per_rank))))


def dcp_groups(lens: list, ranks: int, st: ExampleSetup) -> list:
    """megatron's Dynamic CP: rounds over the DP x CP pool until every sequence is placed."""
    rest, out = sorted(lens, reverse=True), []
    while rest:
        groups, rest = dcp_round(rest, ranks, st)
        start = 0
        for size, docs in groups:
            out.append((tuple(range(start, start + size)), docs))
            start += size
    return out


def dcp_round(seqs: list, ranks: int, st: ExampleSetup) -> tuple:
    """One round (``seqs`` longest first): ``([(size, documents)] in rank order, leftovers)``."""
    cap_rank, slack = st.max_seqlen_per_rank, 1 + WORKLOAD_CAP_SLACK
    cap = seqs[0] * cap_rank * slack
    first = dcp_needed(seqs[0], st)
    if first > ranks:
        raise UserError(f"a sequence of {seqs[0]} tokens needs CP {first}, more than the {ranks} ranks")
    groups = [[first, [seqs[0]], seqs[0] / first, seqs[0] ** 2 / first]]  # size, docs, tokens/rank, load/rank
    used, leftovers = first, []
    for s in seqs[1:]:
        best, c = None, dcp_needed(s, st)
        top = max(g[3] for g in groups)
        while c <= ranks:
            load = s * s / c
            for g in groups:      # into an existing group of size c
                if g[0] == c and g[2] + s / c <= cap_rank and max(top, g[3] + load) <= cap:
                    proj = max(top, g[3] + load)
                    if best is None or proj < best[0]:
                        best = (proj, c, g)
            if ranks - used >= c and max(top, load) <= cap and (best is None or max(top, load) < best[0]):
                best = (max(top, load), c, None)   # a new group on free ranks
            c *= 2
        if best is None:
            leftovers.append(s)
        elif best[2] is not None:
            g = best[2]
            g[1].append(s)
            g[2] += s / g[0]
            g[3] += s * s / g[0]
        else:
            groups.append([best[1], [s], s / best[1], s * s / best[1]])
            used += best[1]
    return _fill(groups, used, ranks, seqs, leftovers, st)


def _fill(groups: list, used: int, ranks: int, seqs: list, leftovers: list, st: ExampleSetup) -> tuple:
    """Empty ranks filled by doubling the smallest group, or the round as one group of every rank."""
    while used < ranks:
        small = min(g[0] for g in groups)
        g = next((g for g in groups if g[0] == small and used + small <= ranks), None)
        if g is None:
            docs, per, rest = [], 0.0, []
            for s in seqs:
                if per + s / ranks <= st.max_seqlen_per_rank:
                    docs.append(s)
                    per += s / ranks
                else:
                    rest.append(s)
            return [(ranks, docs)], rest
        g[0] *= 2
        used += small
    return [(g[0], g[1]) for g in groups], leftovers


# ------------------------------------------------------------------------------------------
# the steps


def step_seconds(groups: list, cost: ExampleCost, st: ExampleSetup, ranks: int) -> float:
    """The step: each group starts when its ranks are free (run order), then the update."""
    free = [0.0] * ranks
    node = st.gpus_per_node
    for members, docs in groups:
        start = max(free[r] for r in members)
        end = start + cost.seconds(docs, len(members), members[0] // node != members[-1] // node)
        for r in members:
            free[r] = end
    return max(free) + cost.update_seconds(ranks)


def trimmed_mean(xs: list, trim: float) -> float:
    """The example's statistic: the mean without the ``int(n trim)`` lowest and highest."""
    k = int(len(xs) * trim)
    ys = sorted(xs)
    if len(ys) - 2 * k > 0:
        ys = ys[k:len(ys) - k]
    return sum(ys) / len(ys)


def simulate_size(gpus: int, lens: list, cost: ExampleCost, st: ExampleSetup) -> dict:
    """Both schedulers at ``gpus`` GPUs over the example's iterations."""
    dp = gpus // st.cp
    batch = st.micro_batches * dp
    base, dyn, mbs = [], [], {"dp_balanced": [], "dynamic_cp": []}
    widths: dict = {}
    for it in range(st.iterations):
        raw = lens[it * batch:(it + 1) * batch]
        g1 = dp_balanced_groups([padded(x, 2 * st.cp) for x in raw], dp, st)
        g2 = dcp_groups([padded(x, 2 * st.cp * dp) for x in raw], gpus, st)
        base.append(step_seconds(g1, cost, st, gpus))
        dyn.append(step_seconds(g2, cost, st, gpus))
        if it >= st.warmup:
            mbs["dp_balanced"].append(len(g1) // dp)
            mbs["dynamic_cp"].append(_rounds(g2))
            for members, _ in g2:
                widths[len(members)] = widths.get(len(members), 0) + 1
    b, d = base[st.warmup:], dyn[st.warmup:]
    tb, td = trimmed_mean(b, st.trim), trimmed_mean(d, st.trim)
    pub = PUBLISHED.get(gpus)
    out = dict(gpus=gpus, dp=dp, global_batch=batch, dp_balanced_ms=1e3 * tb, dynamic_cp_ms=1e3 * td,
               speedup=tb / td, mean_speedup=float(np.mean(b) / np.mean(d)),
               per_step_speedup=dict(min=float(min(x / y for x, y in zip(b, d))),
                                     max=float(max(x / y for x, y in zip(b, d)))),
               update_ms=1e3 * cost.update_seconds(gpus), micro_batches={k: float(np.mean(v)) for k, v in mbs.items()},
               dcp_group_sizes=dict(sorted(widths.items())))
    if pub:
        out.update(published=pub[0], published_ms=pub[1:], error=tb / td / pub[0] - 1,
                   within_aim=abs(tb / td / pub[0] - 1) <= AIM)
    return out


def _rounds(groups: list) -> int:
    """Dynamic CP's rounds in a step: a round's groups start again at rank 0."""
    return sum(1 for members, _ in groups if members[0] == 0)


def simulate_example(st: ExampleSetup | None = None, hw: Hardware | None = None) -> dict:
    """Every size of ``st`` (the module docstring)."""
    st, hw = check(st or ExampleSetup()), hw or Hardware()
    cost = ExampleCost(ExampleModel(), hw, st)
    need = st.iterations * st.micro_batches * max(st.gpus) // st.cp
    lens = example_lengths(max(need, 1_000_000), st)[:need]
    sizes = [simulate_size(g, lens, cost, st) for g in st.gpus]
    return dict(label="SIMULATION (analytic roofline, megatron's Dynamic CP example; no GPU ran)",
                hardware=dataclasses.asdict(hw), setup=dataclasses.asdict(st),
                model=dataclasses.asdict(ExampleModel()), sizes=sizes,
                lengths=dict(n=len(lens), mean=float(np.mean(lens)), median=float(np.median(lens)),
                             at_min=float(np.mean(np.array(lens) == st.min_len)),
                             at_max=float(np.mean(np.array(lens) == st.max_len))))


# ------------------------------------------------------------------------------------------
# the roofline beside the H200 check's timing section (p = 1)

H200_TIMING = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "results", "gpu", "h200", "fast_paths", "final_check.json")
CHECK_SHAPE = ModelShape(num_layers=4, hidden=1024, heads=16, query_groups=8, ffn=2688, swiglu=True, bias=False,
                         vocab=32000, p=1, dtype="bf16")   # the check's GPU model (its ffn: megatron's SwiGLU default)
HOP_MS_FIT = 0.3   # the CP hop's fixed cost that brings the 4-GPU case (DP 1: no balancing) to its published speedup


def roofline_seconds(shape: ModelShape, s: int, layers: int, hw: Hardware) -> float:
    """The roofline's forward + backward seconds of ``layers`` tp_sp layers and the output layer at
    ``s`` tokens, p = 1 (what the check's timing section measures)."""
    rates = datasheet_rates(hw)
    gemm, att = flops_parts("tp_sp", shape, s, 1)
    return layers * (rates["gemm_flops"] * gemm + rates["attn_flops"] * att) \
        + rates["gemm_flops"] * 6.0 * s * shape.hidden * shape.vocab


def h200_fit(path: str = H200_TIMING, hw: Hardware | None = None) -> dict:
    """The check's tp_sp timings on one sequence (4096, 8192 tokens) beside the roofline's
    seconds, and the line through them: measured = scale x roofline + fixed (per micro-batch of
    the check's 4 layers; ``layer_ms`` = fixed / 4)."""
    with open(path) as fh:
        lines = json.load(fh)["lines"]
    rows = []
    for ln in lines:
        d = ln.get("data") or {}
        if ln.get("section") == "timing" and d.get("strategy") == "tp_sp" and "pack" not in ln["name"]:
            pred = roofline_seconds(CHECK_SHAPE, d["tokens"], CHECK_SHAPE.num_layers, hw or Hardware())
            rows.append(dict(tokens=d["tokens"], measured_ms=d["ms"]["default"], roofline_ms=1e3 * pred,
                             flops=d["flops"], measured_tflops=d["flops"] / d["ms"]["default"] / 1e9))
    (a, b) = sorted(rows, key=lambda r: r["tokens"])[:2]
    scale = (b["measured_ms"] - a["measured_ms"]) / (b["roofline_ms"] - a["roofline_ms"])
    fixed = a["measured_ms"] - scale * a["roofline_ms"]
    return dict(rows=rows, rate_scale=scale, fixed_ms=fixed, layer_ms=fixed / CHECK_SHAPE.num_layers, path=path)


def variants(st: ExampleSetup, fit: dict) -> dict:
    """The example under the roofline as it is, with the H200 fit (rates and a fixed cost per
    layer), and with the fit and a fixed cost per CP hop (:data:`HOP_MS_FIT`)."""
    grounded = dataclasses.replace(st, rate_scale=fit["rate_scale"], layer_ms=fit["layer_ms"])
    return {"roofline": st, "roofline + H200 fit": grounded,
            f"roofline + H200 fit + {HOP_MS_FIT} ms per CP hop": dataclasses.replace(grounded, hop_ms=HOP_MS_FIT)}


# ------------------------------------------------------------------------------------------
# the report


def table(res: dict) -> str:
    """The predicted speedups beside the published ones, as a Markdown table."""
    out = ["| GPUs | DP | global batch | micro-batches per step (dp_balanced / DCP rounds) | DCP group sizes | "
           "predicted ms (dp_balanced / DCP) | predicted speedup (per step) | published speedup | "
           "published ms (dp_balanced / DCP) | error |",
           "|---:|---:|---:|---|---|---|---|---:|---|---:|"]
    for r in res["sizes"]:
        mb = r["micro_batches"]
        ps = r["per_step_speedup"]
        pub = (f"{r['published']:.3f}x", f"{r['published_ms'][0]:.0f} / {r['published_ms'][1]:.0f}",
               f"{100 * r['error']:+.1f}%") if "published" in r else ("-", "-", "-")
        sizes = ", ".join(f"{c}: {n}" for c, n in r["dcp_group_sizes"].items())
        out.append(f"| {r['gpus']} | {r['dp']} | {r['global_batch']} | {mb['dp_balanced']:.2f} / {mb['dynamic_cp']:.2f}"
                   f" | {sizes} | {r['dp_balanced_ms']:.1f} / {r['dynamic_cp_ms']:.1f} | {r['speedup']:.3f}x "
                   f"({ps['min']:.2f}-{ps['max']:.2f}) | {pub[0]} | {pub[1]} | {pub[2]} |")
    return "\n".join(out)


def h200_table(fit: dict) -> str:
    """The roofline beside the H200 check's timings, and the fitted line."""
    out = ["| tokens | H200 measured ms (TFLOP/s) | roofline ms | measured / roofline |", "|---:|---:|---:|---:|"]
    for r in fit["rows"]:
        out.append(f"| {r['tokens']} | {r['measured_ms']:.1f} ({r['measured_tflops']:.0f}) | {r['roofline_ms']:.2f} | "
                   f"{r['measured_ms'] / r['roofline_ms']:.2f} |")
    out.append(f"\nmeasured = {fit['rate_scale']:.3f} x roofline + {fit['fixed_ms']:.2f} ms "
               f"({fit['layer_ms']:.2f} ms per layer of the check's 4)")
    return "\n".join(out)


def aim_line(res: dict) -> str:
    """How many sizes are within the aim, and the worst error."""
    met = [r for r in res["sizes"] if "published" in r]
    ok = sum(r["within_aim"] for r in met)
    worst = max(met, key=lambda r: abs(r["error"]), default=None)
    return (f"within {100 * AIM:.0f}% of the published speedup: {ok} of {len(met)} sizes"
            + (f" (worst {worst['gpus']} GPUs, {100 * worst['error']:+.1f}%)" if worst else ""))


def summary(res: dict) -> str:
    """The simulation's result as the command prints it."""
    hw, st, m, ln = res["hardware"], res["setup"], res["model"], res["lengths"]
    return "\n".join([
        "=" * 100, res["label"],
        f"  model: {m['num_layers']} layers, h {m['hidden']}, {m['heads']} heads, GELU ffn {m['ffn']}, vocab "
        f"{m['vocab']} (tied), bf16; TP 1, CP {st['cp']}, PP 1, {st['gpus_per_node']} GPUs per node",
        f"  hardware: {hw['name']}: x{hw['mfu_matmul']} GEMM, x{hw['mfu_attention']} attention of "
        f"{hw['bf16_flops'] / 1e12:.0f} TFLOP/s; NVLink x{hw['comm_efficiency']}; between nodes {st['scale_out']}; "
        f"CP ring overlap {st['overlap']:g}",
        f"  data: megatron's mock lengths (log-normal mean {st['mean_len']}, sigma {st['sigma']}, clipped to "
        f"[{st['min_len']}, {st['max_len']}], seed {st['seed']}): mean {ln['mean']:.0f}, median {ln['median']:.0f}, "
        f"{100 * ln['at_min']:.0f}% at {st['min_len']}, {100 * ln['at_max']:.1f}% at {st['max_len']}",
        f"  run: {st['micro_batches']} micro-batches per DP rank, max {st['max_seqlen_per_rank']} tokens per rank, "
        f"{st['iterations']} iterations, the first {st['warmup']} dropped, {100 * st['trim']:.0f}%-trimmed mean",
        f"  fixed costs: {st['layer_ms']:g} ms per layer and micro-batch, {st['hop_ms']:g} ms per CP hop; "
        f"rates x{st['rate_scale']:.3f}", "", table(res), "", "  " + aim_line(res), "=" * 100])


def build_parser():
    ap = ArgumentParser(prog="python -m megatron_paradyse.bench.simulate_dcp_example", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    d = ExampleSetup()
    ap.add_argument("--gpus", default=",".join(map(str, d.gpus)), help="GPU counts, multiples of CP (4)")
    ap.add_argument("--overlap", type=float, default=d.overlap, help="fraction of the CP ring hidden, [0, 1]")
    ap.add_argument("--scale-out", choices=SCALE_OUT, default=d.scale_out,
                    help="the link between nodes: NDR InfiniBand (ib_ndr) or one NVLink domain (nvlink)")
    ap.add_argument("--json", default=None, help="also write the result here")
    return ap


def check(st: ExampleSetup) -> ExampleSetup:
    """``st``, or a UserError naming what cannot be simulated."""
    if not st.gpus or any(g < st.cp or g % st.cp or (g // st.cp) & (g // st.cp - 1) for g in st.gpus):
        raise UserError(f"--gpus must each be {st.cp} x a power of two, got {','.join(map(str, st.gpus))}")
    if not 0 <= st.overlap <= 1 or st.scale_out not in SCALE_OUT:
        raise UserError(f"--overlap must be in [0, 1] and --scale-out one of {', '.join(SCALE_OUT)}")
    return st


@command("python -m megatron_paradyse.bench.simulate_dcp_example")
def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        gpus = tuple(int(x) for x in a.gpus.split(","))
    except ValueError:
        raise UserError(f"--gpus takes integers separated by commas, got {a.gpus!r}") from None
    t0 = time.perf_counter()
    fit = h200_fit()
    print("The roofline beside the H200 check's timing section (tp_sp, p = 1, bf16; " + os.path.relpath(fit["path"])
          + "):\n" + h200_table(fit) + "\n")
    st = check(ExampleSetup(gpus=gpus, overlap=a.overlap, scale_out=a.scale_out))
    out = {}
    for name, v in variants(st, fit).items():
        out[name] = simulate_example(v)
        print(f"### {name}\n" + summary(out[name]) + "\n")
    print(f"({time.perf_counter() - t0:.1f} s)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(h200=fit, variants=out), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
