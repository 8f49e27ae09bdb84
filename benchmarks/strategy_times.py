"""fwd+bwd time of each strategy relative to ``tp_sp``, whole model, one world per p.

    python -m benchmarks.strategy_times --p 2 --seqs 4096,16384 [--strategies ...] [--repeats 3]

Builds a stock megatron-core GPT (default: 2 layers, h = 256, 8 heads, ffn 1024, fp32) on p gloo
ranks, and for each length and strategy runs one warm-up and ``--repeats`` timed passes of the
whole model (embedding, every layer on the strategy, output layer and loss, backward), ranks
aligned by a barrier before each. Prints, per length and strategy, the median wall time, its
ratio to ``tp_sp``'s median in the same run, and the median over passes of the slowest rank's
thread CPU time (the compute a rank does itself: with more ranks than cores, wall time also
holds the time a rank waits for a core). A strategy whose estimated per-rank memory exceeds
``--max-gib`` (``colossal``'s score rows grow with s^2) is skipped with the estimate printed.
"""
from __future__ import annotations

import argparse
import statistics
import time

from megatron_paradyse.units import GiB


def _colossal_gib(layers, heads, seq, p, batch):
    """Score rows ``[b, heads, s/p, s]`` in fp32: saved per layer, plus two more in a backward."""
    rows = batch * heads * (seq // p) * seq * 4
    return (layers + 2) * rows / GiB


def measure(rank, world, spec_kw, batch, seqs, names, repeats, max_gib):
    import torch
    import torch.distributed as dist

    import megatron_paradyse as mp
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    mp.install()
    spec = T.TinyGPT(**spec_kw)
    model = T.build_gpt(spec, world)
    rows = {}
    for seq in seqs:
        tok, lab = T.make_batch(spec, batch, seq, seed=seq)
        for name in names:
            if name == "colossal":
                est = _colossal_gib(spec.num_layers, spec.num_attention_heads, seq, world, batch)
                if est > max_gib:
                    rows[(seq, name)] = {"skipped": f"~{est:.1f} GiB per rank of score rows > --max-gib {max_gib}"}
                    continue
            mp.set_plan(model, name)
            walls, cpus = [], []
            for i in range(1 + repeats):
                model.zero_grad(set_to_none=True)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                T.forward_backward(model, tok, lab)
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                if i:
                    walls.append(wall)
                    cpus.append(cpu)
            rows[(seq, name)] = {"walls": walls, "cpus": cpus}
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=2)
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--strategies", default="tp_sp,ulysses,ring,colossal,metp")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-attention-heads", type=int, default=8)
    ap.add_argument("--ffn-hidden-size", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-gib", type=float, default=4.0)
    ap.add_argument("--timeout", type=float, default=3000)
    args = ap.parse_args()
    from megatron_paradyse.testing.spawn import run_world

    seqs = [int(s) for s in args.seqs.split(",")]
    names = args.strategies.split(",")
    if "tp_sp" not in names:
        names.insert(0, "tp_sp")
    spec_kw = dict(num_layers=args.layers, hidden_size=args.hidden_size,
                   num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                   vocab_size=256, max_seq_length=max(seqs), bias=True)
    per_rank = run_world(measure, args.p, spec_kw, args.batch, seqs, names, args.repeats, args.max_gib,
                         timeout=args.timeout)
    print(f"p={args.p} layers={args.layers} h={args.hidden_size} heads={args.num_attention_heads} "
          f"ffn={args.ffn_hidden_size} b={args.batch} fp32, median of {args.repeats} fwd+bwd passes")
    print("| s | strategy | wall s | x tp_sp | slowest rank CPU s | x tp_sp |")
    print("|---:|---|---:|---:|---:|---:|")
    for seq in seqs:
        base = None
        for name in names:
            r0 = per_rank[0][(seq, name)]
            if "skipped" in r0:
                print(f"| {seq} | {name} | skipped: {r0['skipped']} | | | |")
                continue
            wall = statistics.median(r0["walls"])
            cpu = statistics.median(max(r[(seq, name)]["cpus"][i] for r in per_rank)
                                    for i in range(args.repeats))
            if name == "tp_sp":
                base = (wall, cpu)
            print(f"| {seq} | {name} | {wall:.2f} | {wall / base[0]:.2f} | {cpu:.2f} | {cpu / base[1]:.2f} |")


if __name__ == "__main__":
    main()
