"""Per-rank causal attention work of a ring under the contiguous and the zig-zag split (estimated).

    python -m benchmarks.ring_balance --p 4 --seq 8192

Times, in one process, one attention block of each kind (full / causal diagonal, forward +
backward, the plugin's CPU flash kernel) and estimates each rank's time as the number of
blocks of each kind that rank computes in a causal ring times the block's median time:
contiguous chunks (rank r attends r full blocks and one causal diagonal block) against
Megatron CP's zig-zag (2p chunks, rank r holds chunks r and 2p-1-r). No ring runs and no
communication is timed. Prints each rank's estimate and the max/mean imbalance; the ring's
step time is set by the slowest rank.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_paradyse.parallel.attention_kernels import attn_backward, attn_forward


def _block(q, k, v, causal, scale):
    out, lse = attn_forward(q, k, v, causal, scale)
    attn_backward(torch.ones_like(out), q, k, v, out, lse, causal, scale)


def rank_blocks(layout, p, r):
    """(number of full blocks, number of causal diagonal blocks, chunk length in units of s/2p)."""
    if layout == "contiguous":
        return r, 1, 2
    return 2 * p - 1, 2, 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    unit = args.seq // (2 * args.p)
    scale = args.head_dim ** -0.5

    def t(n, causal):
        q, k, v = (torch.randn(1, args.heads, n, args.head_dim) for _ in range(3))
        _block(q, k, v, causal, scale)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            _block(q, k, v, causal, scale)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    cost = {(n, c): t(n * unit, c) for n in (1, 2) for c in (False, True)}
    print(f"p={args.p} s={args.seq} heads={args.heads} d={args.head_dim}: "
          f"estimated ms per rank = blocks x median of {args.repeats} fwd+bwd per block")
    for layout in ("contiguous", "zigzag"):
        per_rank = []
        for r in range(args.p):
            full, diag, n = rank_blocks(layout, args.p, r)
            per_rank.append(1e3 * (full * cost[(n, False)] + diag * cost[(n, True)]))
        mean = sum(per_rank) / len(per_rank)
        print(f"{layout:>10}: " + " ".join(f"{x:8.1f}" for x in per_rank)
              + f"   max/mean = {max(per_rank) / mean:.2f}")


if __name__ == "__main__":
    main()
