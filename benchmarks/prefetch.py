"""Forward + backward time and peak memory of the ZeRO strategies with and without prefetched
weight gathers (``megatron_paradyse.parallel.prefetch``), whole model, p gloo ranks.

    python -m benchmarks.prefetch --p 2 --seq 2048 [--strategies ulysses,ring,colossal] [--repeats 7]

Builds a stock megatron-core GPT (default: 4 layers, h = 256, 8 heads, ffn 1024, fp32) and, per
strategy, runs one warm-up and ``--repeats`` timed passes with prefetch on and off alternately
(ranks aligned by a barrier before each), then one pass of each from a released pool under the
memory tracker. Prints the median wall time of each, their ratio, the peak (largest rank,
communication pool included) and the difference against the cost model's
(``costmodel.analytic.zero_weight_pool``). On CPU gloo ranks sharing cores there is little to
overlap: the numbers show the cost of the mechanism, not a GPU's gain.
"""
from __future__ import annotations

import argparse
import statistics
import time

from megatron_paradyse.units import MiB


def _pass(model, tok, lab, T, dist):
    model.zero_grad(set_to_none=True)
    dist.barrier()
    t0 = time.perf_counter()
    T.forward_backward(model, tok, lab)
    return time.perf_counter() - t0


def _peak(model, tok, lab, T):
    from megatron_paradyse.memory import PeakMemory
    from megatron_paradyse.parallel.buffers import release_pool

    model.zero_grad(set_to_none=True)
    release_pool()
    with PeakMemory() as mem:
        T.forward_backward(model, tok, lab)
    return mem.peak_bytes


def measure(rank, world, spec_kw, batch, seq, names, repeats):
    import torch.distributed as dist

    import megatron_paradyse as mp
    from megatron_paradyse.parallel import prefetch
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    mp.install()
    spec = T.TinyGPT(**spec_kw)
    model = T.build_gpt(spec, world)
    tok, lab = T.make_batch(spec, batch, seq, seed=seq)
    rows = {}
    for name in names:
        mp.set_plan(model, name)
        times = {True: [], False: []}
        for i in range(1 + repeats):
            for on in (True, False) if i % 2 == 0 else (False, True):
                prefetch.set_enabled(on)
                wall = _pass(model, tok, lab, T, dist)
                if i:
                    times[on].append(wall)
        peaks = {}
        for on in (True, False):
            prefetch.set_enabled(on)
            peaks[on] = _peak(model, tok, lab, T)
        prefetch.set_enabled(True)
        rows[name] = {"times": times, "peaks": peaks}
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--strategies", default="ulysses,ring,colossal")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-attention-heads", type=int, default=8)
    ap.add_argument("--ffn-hidden-size", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=3000)
    args = ap.parse_args()
    from megatron_paradyse.costmodel import analytic
    from megatron_paradyse.costmodel.shape import ModelShape
    from megatron_paradyse.testing.spawn import run_world

    spec_kw = dict(num_layers=args.layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                   ffn_hidden_size=args.ffn_hidden_size, max_seq_length=args.seq)
    names = args.strategies.split(",")
    res = run_world(measure, args.p, spec_kw, args.batch, args.seq, names, args.repeats, timeout=args.timeout)
    shape = ModelShape(num_layers=args.layers, hidden=args.hidden_size, heads=args.num_attention_heads,
                       query_groups=args.num_attention_heads, ffn=args.ffn_hidden_size, swiglu=False, bias=True,
                       vocab=128, dtype="fp32", p=args.p)
    pool = {on: sum(analytic.zero_weight_pool(shape, on).values()) for on in (True, False)}
    print(f"p = {args.p} gloo ranks, {args.layers} layers, h = {args.hidden_size}, s = {args.seq}, b = {args.batch}, "
          f"fp32; median of {args.repeats} fwd+bwd passes each, on/off alternating")
    print("| strategy | prefetch on | off | on / off | peak on | peak off | on - off | model on - off |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        on = statistics.median(max(r[name]["times"][True][i] for r in res) for i in range(args.repeats))
        off = statistics.median(max(r[name]["times"][False][i] for r in res) for i in range(args.repeats))
        pk = {k: max(r[name]["peaks"][k] for r in res) for k in (True, False)}
        print(f"| {name} | {on * 1e3:.0f} ms | {off * 1e3:.0f} ms | {on / off:.3f} | {pk[True] / MiB:.2f} MiB | "
              f"{pk[False] / MiB:.2f} MiB | {(pk[True] - pk[False]) / MiB:+.3f} MiB | "
              f"{(pool[True] - pool[False]) / MiB:+.3f} MiB |")


if __name__ == "__main__":
    main()
