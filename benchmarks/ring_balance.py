"""Per-rank attention time inside a real ring pass: contiguous split against the balanced one.

    python -m benchmarks.ring_balance --p 4 --seq 16384 [--heads 8 --head-dim 32 --repeats 3]

On p gloo ranks, runs ``ring.RingAttention`` forward + backward over one causal sequence of
``--seq`` tokens (``[1, heads, s/p, head_dim]`` per rank, fp32) with each layout of
``zigzag.RingLayout``: ``contiguous`` (rank r holds the r-th chunk: the split before the
balanced layout landed) and ``balanced`` (half-chunks c and 2p-1-c). Every call of the block
kernels (``attn_forward`` / ``attn_backward``) inside the pass is timed on the rank that makes
it, in thread CPU time (the compute the rank itself does, so oversubscribed cores, p ranks
on fewer cores, do not inflate it) and in wall time. Prints each rank's median kernel time
over ``--repeats`` passes, max/mean over ranks, and the pass's wall time (slowest rank).

Also times what the balanced layout adds per layer (the layer-level re-layout of the
in-layer design): ``to_balanced`` + ``from_balanced`` of an ``[s/p, 1, hidden]`` activation,
forward and backward (4 exchanges of half a rank's tokens with its partner).
"""
from __future__ import annotations

import argparse
import statistics
import time


def measure(rank, world, seq, heads, head_dim, hidden, repeats):
    import torch
    import torch.distributed as dist

    from megatron_paradyse.parallel import zigzag
    from megatron_paradyse.parallel.strategies import ring as ring_mod
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    group = dist.group.WORLD
    length = seq // world
    scale = head_dim ** -0.5
    spent = {"cpu": 0.0, "wall": 0.0}

    def timed(fn):
        def wrapper(*args, **kwargs):
            c0, w0 = time.thread_time(), time.perf_counter()
            out = fn(*args, **kwargs)
            spent["cpu"] += time.thread_time() - c0
            spent["wall"] += time.perf_counter() - w0
            return out
        return wrapper

    ring_mod.attn_forward = timed(ring_mod.attn_forward)
    ring_mod.attn_backward = timed(ring_mod.attn_backward)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=g).requires_grad_(True) for _ in range(3))
    rows = {}
    for name, balanced in (("contiguous", False), ("balanced", True)):
        layout = zigzag.RingLayout(world, length, balanced=balanced)
        cpus, walls, passes = [], [], []
        for i in range(1 + repeats):
            spent.update(cpu=0.0, wall=0.0)
            dist.barrier()
            t0 = time.perf_counter()
            out = ring_mod.RingAttention.apply(q, k, v, group, scale, layout)
            out.backward(torch.ones_like(out))
            dist.barrier()
            if i:
                cpus.append(spent["cpu"])
                walls.append(spent["wall"])
                passes.append(time.perf_counter() - t0)
        rows[name] = {"cpu": statistics.median(cpus), "wall": statistics.median(walls),
                      "pass": statistics.median(passes)}
    layout = zigzag.RingLayout(world, length)
    x = torch.randn(length, 1, hidden, generator=g).requires_grad_(True)
    times = []
    for i in range(1 + repeats):
        dist.barrier()
        t0 = time.perf_counter()
        y = zigzag.from_balanced(zigzag.to_balanced(x, layout, group) * 1.0, layout, group)
        y.backward(torch.ones_like(y))
        if i:
            times.append(time.perf_counter() - t0)
    rows["relayout"] = statistics.median(times)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256, help="width of the re-laid-out activation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    from megatron_paradyse.testing.spawn import run_world

    per_rank = run_world(measure, args.p, args.seq, args.heads, args.head_dim, args.hidden, args.repeats,
                         timeout=args.timeout)
    print(f"p={args.p} s={args.seq} heads={args.heads} head_dim={args.head_dim} fp32: one RingAttention "
          f"forward+backward, median of {args.repeats} passes, kernel time per rank in ms")
    print("| layout | kind | " + " | ".join(f"rank {r}" for r in range(args.p)) + " | max/mean | pass wall s |")
    print("|---|---|" + "---:|" * args.p + "---:|---:|")
    for name in ("contiguous", "balanced"):
        for kind in ("cpu", "wall"):
            vals = [1e3 * r[name][kind] for r in per_rank]
            mean = sum(vals) / len(vals)
            pass_s = max(r[name]["pass"] for r in per_rank)
            print(f"| {name} | {'thread CPU' if kind == 'cpu' else 'wall'} | "
                  + " | ".join(f"{x:.0f}" for x in vals) + f" | {max(vals) / mean:.2f} | {pass_s:.2f} |")
    relayout = max(r["relayout"] for r in per_rank)
    print(f"re-layout of [s/p, 1, {args.hidden}] to balanced and back, fwd+bwd: {1e3 * relayout:.1f} ms "
          "(slowest rank)")


if __name__ == "__main__":
    main()
