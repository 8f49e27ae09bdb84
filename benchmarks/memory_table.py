"""Per-rank memory of each strategy on one long sequence (CPU: deterministic live-tensor bytes).

    python -m benchmarks.memory_table --p 4 --seq 8192

Prints a markdown table: activation memory (what the forward keeps for the backward), the
step's peak, and the communication buffers each strategy needs (megatron's global memory
buffer, which holds both megatron's own SP gather buffer and the plugin's pool). Numbers are
the maximum over ranks. Parameters and their gradients (identical for every strategy) are
not included.
"""
from __future__ import annotations

import argparse
import gc

from megatron_paradyse.units import MiB


def measure(rank, world, spec_kw, batch, seq, names):
    import torch
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    import megatron_paradyse as mp
    from megatron_paradyse.testing import models as T
    from megatron_paradyse.memory import pass_memory

    T.init_megatron(world)
    mp.install()
    spec = T.TinyGPT(**spec_kw)
    model = T.build_gpt(spec, world)
    tok, lab = T.make_batch(spec, batch, seq, seed=0)
    pos = torch.arange(seq).unsqueeze(0).expand_as(tok)

    def forward():
        return model(tok, pos, None, labels=lab).float().mean()

    def backward(loss):
        loss.backward()

    rows = {}
    for name in names:
        mp.set_plan(model, name)
        parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
        backward(forward())  # warm-up: fills this strategy's buffers
        buffers = sum(t.numel() * t.element_size()
                      for t in parallel_state.get_global_memory_buffer().buffer.values())
        model.zero_grad(set_to_none=True)
        gc.collect()
        mem = pass_memory(forward, backward)
        model.zero_grad(set_to_none=True)
        rows[name] = dict(mem, buffers=buffers)
    return rows


def table(spec_kw, batch, seq, p, names, timeout=900):
    from megatron_paradyse.testing.spawn import run_world

    per_rank = run_world(measure, p, spec_kw, batch, seq, names, timeout=timeout)
    return {n: {k: max(r[n][k] for r in per_rank) for k in per_rank[0][n]} for n in names}


def main():
    import megatron_paradyse as mp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    args = ap.parse_args()
    spec_kw = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                   vocab_size=args.vocab, max_seq_length=args.seq)
    res = table(spec_kw, args.batch, args.seq, args.p, list(mp.STRATEGIES))
    print(f"p={args.p} s={args.seq} b={args.batch} h={args.hidden} heads={args.heads} "
          f"layers={args.layers} fp32; MiB per rank (max over ranks)\n")
    base = res["tp_sp"]
    print("| strategy | activations | vs tp_sp | step peak | comm buffers | peak + buffers | vs tp_sp |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n, r in res.items():
        total, base_total = r["peak"] + r["buffers"], base["peak"] + base["buffers"]
        print(f"| {n} | {r['activations'] / MiB:.1f} | {r['activations'] / base['activations']:.2f}x | "
              f"{r['peak'] / MiB:.1f} | {r['buffers'] / MiB:.1f} | {total / MiB:.1f} | "
              f"{total / base_total:.2f}x |")


if __name__ == "__main__":
    main()
