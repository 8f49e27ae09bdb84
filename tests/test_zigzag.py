"""The balanced ring layout (``parallel/zigzag.py``) against brute force, without ranks.

Exactness of the strategies that use it is in test_strategies_exact.py and friends; here:
the layout is a permutation of the sequence, each rank holds s/p tokens, the blocks a ring
computes are exactly the causal mask, and the causal work per rank is balanced.
"""
import itertools

import pytest

from megatron_paradyse.parallel.zigzag import RingLayout

SIZES = [(p, L) for p in (1, 2, 3, 4, 5) for L in (1, 2, 7, 10)]


def _positions(layout, rank):
    return [t for g in layout.segments(rank) for t in range(g.start, g.stop)]


@pytest.mark.parametrize("p,L", SIZES)
@pytest.mark.parametrize("balanced", [True, False])
def test_layout_is_a_permutation_in_position_order(p, L, balanced):
    layout = RingLayout(p, L, balanced)
    seen = []
    for r in range(p):
        pos = _positions(layout, r)
        assert len(pos) == L and pos == sorted(pos)
        offsets = [g.offset for g in layout.segments(r)]
        assert offsets == sorted(offsets) and offsets[0] == 0
        seen += pos
    assert sorted(seen) == list(range(p * L))


@pytest.mark.parametrize("p,L", SIZES)
@pytest.mark.parametrize("balanced", [True, False])
def test_visible_blocks_are_the_causal_mask(p, L, balanced):
    """Every (query, key) pair a ring computes for a rank, from ``visible`` (diagonal masked)
    and from ``full_blocks`` (other ranks), is exactly the set with key <= query."""
    layout = RingLayout(p, L, balanced)
    for r in range(p):
        qpos = _positions(layout, r)
        want_all = {(qi, kj) for qi in qpos for kj in range(p * L) if kj <= qi}
        got_vis, got_full = set(), set()
        for src in range(p):
            kpos = _positions(layout, src)
            for row, seg in layout.visible(r, src):
                for qi in qpos[row:]:
                    got_vis.update((qi, kj) for kj in range(seg.start, seg.stop) if kj <= qi)
                    assert src == r or all(kj < qi for kj in range(seg.start, seg.stop))
            if src == r:
                got_full.update((qi, kj) for qi in qpos for kj in qpos if kj <= qi)
                continue
            for rows, keys in layout.full_blocks(r, src):
                pairs = set(itertools.product(qpos[rows], kpos[keys]))
                assert all(kj < qi for qi, kj in pairs), "a full block holds a masked pair"
                got_full |= pairs
        assert got_vis == want_all
        assert got_full == want_all


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_balanced_layout_balances_causal_work(p):
    """Query-key pairs under the causal mask per rank: max/mean is 1 up to the halves' one-token
    difference with the balanced layout, and grows toward 2 with p with the contiguous one."""
    L = 64

    def work(layout, r):
        return sum(q + 1 for q in _positions(layout, r))

    for balanced, bound in ((True, 1.01), (False, None)):
        layout = RingLayout(p, L, balanced)
        w = [work(layout, r) for r in range(p)]
        ratio = max(w) / (sum(w) / p)
        if balanced:
            assert ratio <= bound, w
        else:
            assert ratio >= 2 * p / (p + 1) - 0.01, w


def test_only_partners_move():
    layout = RingLayout(5, 6)
    assert [layout.moves(r) for r in range(5)] == [True, True, False, True, True]
    assert not RingLayout(4, 1).moves(0)  # a single token has no second half to swap
    assert not RingLayout(4, 6, balanced=False).moves(0)


def _cores_match_full_attention(rank, world, cases):
    """In each rank: the ring cores (``ring``, ``colossal``) under the balanced layout, and the
    re-layout round trip, against causal attention of the whole sequence computed locally."""
    import torch
    import torch.distributed as dist

    from megatron_paradyse.parallel import zigzag
    from megatron_paradyse.parallel.attention_kernels import causal_attention
    from megatron_paradyse.parallel.ring_comm import FlatRing
    from megatron_paradyse.parallel.strategies.colossal import rsa_attention
    from megatron_paradyse.parallel.strategies.ring import ring_attention
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    group = dist.group.WORLD
    worst = 0.0
    for L, heads, groups in cases:
        layout = zigzag.RingLayout(world, L)
        s, d = world * L, 8
        g = torch.Generator().manual_seed(L)
        q = torch.randn(1, heads, s, d, generator=g, dtype=torch.float64).float()
        k, v = (torch.randn(1, groups, s, d, generator=g, dtype=torch.float64).float() for _ in range(2))
        dout = torch.randn(1, heads, s, d, generator=g)
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = causal_attention(*full, d ** -0.5)
        ref.backward(dout)
        idx = torch.tensor([t for a, b in layout.ranges(rank) for t in range(a, b)])
        for core in (ring_attention, rsa_attention):
            mine = [t[:, :, idx].clone().requires_grad_(True) for t in (q, k, v)]
            out = core(*mine, FlatRing(group), d ** -0.5, layout)
            out.backward(dout[:, :, idx])
            pairs = [(out, ref)] + [(m.grad, f.grad) for m, f in zip(mine, full)]
            for got, want in pairs:
                # relative to the whole sequence's tensor: with one token per rank, rank 0's dq
                # is zero up to rounding (a softmax over one key)
                err = ((got - want[:, :, idx]).norm() / want.norm()).item()
                worst = max(worst, err)
                assert err < 1e-5, (core.__name__, L, err)
        x = torch.randn(L, 2, 3, generator=g).requires_grad_(True)
        y = zigzag.to_balanced(x, layout, group)
        back = zigzag.from_balanced(y * 2.0, layout, group)
        assert torch.equal(back, 2.0 * x)
        back.backward(torch.ones_like(back))
        assert torch.equal(x.grad, torch.full_like(x, 2.0))
    return worst


@pytest.mark.parametrize("p", [3])
def test_ring_cores_exact_with_a_middle_rank_and_short_chunks(p):
    """p = 3 (the middle rank swaps nothing), odd and single-token chunks, GQA: the balanced
    ring cores equal whole-sequence causal attention, output and q/k/v gradients."""
    from megatron_paradyse.testing.spawn import run_world

    cases = [(5, 4, 2), (1, 2, 2), (8, 4, 4)]
    worst = max(run_world(_cores_match_full_attention, p, cases, timeout=180))
    print(f"p={p}: worst rel. error {worst:.2e}")
