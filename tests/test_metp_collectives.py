"""METP's collectives per layer (``parallel/strategies/metp.py``), counted in the collective trace.

Per layer, forward and backward: one flat broadcast of each head group's attention shards
(W_qkv, W_proj and the QKV bias together) in forward and again in backward, 2p broadcasts in
all, where each shard had its own broadcast (2-3 per head group); one reduce-scatter of the
attention weight gradients, where each shard of each head group had its own reduce onto its
owner (2p-3p reduces). The count is the difference between a 2-layer and a 1-layer model, so
megatron's own collectives (embedding, output layer) cancel out. Exactness is
``test_metp_exact.py``'s and ``test_strategies_exact.py``'s.
"""
from __future__ import annotations

import collections

import pytest

from megatron_paradyse.testing.spawn import run_world


def _world(rank, world):
    import megatron_paradyse as mp
    from megatron_paradyse import trace
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    mp.install()
    counts = {}
    for layers in (1, 2):
        spec = T.TinyGPT(num_layers=layers, hidden_size=64, num_attention_heads=4, bias=True)
        model = T.build_gpt(spec, world)
        mp.set_plan(model, "metp")
        with trace.recording() as ops:
            T.forward_backward(model, *T.make_batch(spec, 1, 32, seed=3))
        counts[layers] = collections.Counter(op.op for op in ops if len(op.members) == world)
    return counts


@pytest.mark.parametrize("p", [2, 4])
def test_metp_posts_one_broadcast_per_head_group_and_one_reduce_scatter(p):
    counts = run_world(_world, p, timeout=300)[0]
    per_layer = counts[2] - counts[1]
    assert per_layer["broadcast"] == 2 * p, per_layer     # one per head group, forward and backward
    assert per_layer["reduce"] == 0, per_layer             # was 3p (W_qkv, W_proj, b_qkv per group)
    assert per_layer["reduce_scatter_single"] == 1, per_layer
    print(f"\np = {p}, one METP layer (QKV bias), fwd + bwd: {dict(per_layer)} "
          f"(before: {6 * p} broadcasts, {3 * p} reduces)")
