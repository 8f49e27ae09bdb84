"""The analytic memory model against the CPU live-bytes tracker, and the single-device mode.

One spawned world of 4 gloo ranks measures every strategy's per-rank saved and transient
bytes of one decoder layer for several shapes, first as one p = 4 group, then as two p = 2
groups (TP = 2, DP = 2); then rank 0 leaves the gloo group and plays rank 1 of a fake p-rank
group (torch's fake backend) for the same shapes. Checks:

* analytic saved bytes within 5% of the largest rank's, for every strategy, shape and p;
* a 4-layer stack's peak (4 x saved + transient) within 5%;
* the fake group's per-rank memory (saved, and saved + transient) within 5% of the real rank 1's;
* the communication pool's buffers (largest rank's, per name) equal to the analytic ones, and the
  pool of a mixed plan (each name once) equal to what the ranks hold after running it through
  the training ``forward_step`` right after a longer micro-batch (the pool is released).
"""
from __future__ import annotations

import pytest

from megatron_paradyse.costmodel.shape import ModelShape
from megatron_paradyse.testing.spawn import run_world

STRATS = ("tp_sp", "ulysses", "ring", "colossal", "metp")
BASE = dict(num_layers=1, vocab=512, dtype="fp32")
S, B = 96, 2  # not a power of two, b > 1


def shapes(p):
    return [
        dict(BASE, hidden=128, heads=8, query_groups=8, ffn=512, swiglu=False, bias=True),  # the demo's layer
        dict(BASE, hidden=64, heads=4, query_groups=p, ffn=160, swiglu=True, bias=False),   # GQA, SwiGLU, no bias
    ]


def _measure_all(p):
    from megatron_paradyse.costmodel import measure as M

    out, pool = {}, {}
    for i, sd in enumerate(shapes(p)):
        shape = ModelShape(**sd, p=p)
        spec, model = M.build(shape, num_layers=1, max_seq=S)
        runner = M.LayerRunner(model, shape)
        for st in STRATS:
            M.set_strategy(model, st)
            out[(p, i, st)] = runner.memory("layer", S, B)
            pool[(p, i, st)] = runner.pool(S, B)
        pool[(p, i, "nonlayer")] = M.NonLayerRunner(model, spec, shape).pool(S, B)
    return out, pool


MIXED = ("metp", "ulysses", "tp_sp", "ring")


def _mixed_plan_pool(p):
    """The pool a whole 4-layer model holds after a micro-batch of MIXED at s = S run through
    the training ``forward_step``, right after one at 2S (which grew the pool)."""
    import torch

    import megatron_paradyse as mp
    from megatron_paradyse.costmodel import measure as M
    from megatron_paradyse.parallel.buffers import pool_sizes
    from megatron_paradyse.testing import models as T
    from megatron_paradyse.training.forward_step import forward_step

    shape = ModelShape(**dict(shapes(p)[0], num_layers=4), p=p)
    spec, model = M.build(shape, max_seq=2 * S)

    class MB:
        def __init__(self, s):
            self.plan = list(MIXED)
            self.tokens, self.labels = T.make_batch(spec, B, s, seed=s)
            self.position_ids = torch.arange(s).unsqueeze(0).expand_as(self.tokens)
            self.loss_mask = torch.ones_like(self.tokens, dtype=torch.float)
            self.cu_seqlens = None  # one sequence per row, not a pack (forward_step reads it)

        def to(self, device):
            return self

    for s in (2 * S, S):
        out, loss_fn = forward_step(iter([MB(s)]), model)
        loss_fn(out)[0].backward()
    return pool_sizes()


def _world(rank, world):
    import torch.distributed as dist

    from megatron_paradyse.costmodel import measure as M
    from megatron_paradyse.testing import models as T

    real, pool = {}, {}
    for p in (4, 2):
        got = _measure_all(p)
        real.update(got[0])
        pool.update(got[1])
    mixed = _mixed_plan_pool(2)  # megatron is set up for p = 2 now
    dist.barrier()
    T.init_megatron(1)  # leave megatron's groups before the world goes
    fake = {}
    if rank == 0:
        for p in (2, 4):
            M.init_fake(1, p)
            fake.update(_measure_all(p)[0])
    return {"rank": rank, "tp_rank": {4: rank, 2: rank % 2}, "real": real, "fake": fake, "pool": pool,
            "mixed": mixed}


@pytest.fixture(scope="module")
def measured():
    return run_world(_world, 4, timeout=300)


def test_analytic_memory_matches_tracker(measured):
    from megatron_paradyse.costmodel import analytic

    fails, worst_saved, worst_stack = [], 0.0, 0.0
    for key in measured[0]["real"]:
        p, i, st = key
        shape = ModelShape(**shapes(p)[i], p=p)
        saved = max(r["real"][key][0] for r in measured)
        trans = max(r["real"][key][1] for r in measured)
        psaved, ptrans = analytic.layer_memory(st, shape, S, B)
        e_saved = abs(psaved - saved) / saved
        e_stack = abs(4 * psaved + ptrans - 4 * saved - trans) / (4 * saved + trans)
        worst_saved, worst_stack = max(worst_saved, e_saved), max(worst_stack, e_stack)
        if e_saved > 0.05 or e_stack > 0.05:
            fails.append(f"p={p} {shape.describe()} {st} s={S} b={B}: saved {saved} vs {psaved:.0f} ({e_saved:.1%}), "
                         f"4-layer peak {4 * saved + trans} vs {4 * psaved + ptrans:.0f} ({e_stack:.1%})")
    print(f"\nanalytic vs tracker: worst saved {worst_saved:.2%}, worst 4-layer peak {worst_stack:.2%}")
    assert not fails, "\n".join(fails)


def test_fake_group_memory_equals_real_rank(measured):
    fake = measured[0]["fake"]
    assert len(fake) == len(measured[0]["real"])
    fails, worst = [], 0.0
    for key, (fsaved, ftrans) in fake.items():
        p = key[0]
        rank1 = next(r for r in measured if r["tp_rank"][p] == 1)
        rsaved, rtrans = rank1["real"][key]
        for what, f, r in (("saved", fsaved, rsaved), ("peak", fsaved + ftrans, rsaved + rtrans)):
            e = abs(f - r) / r
            worst = max(worst, e)
            if e > 0.05:
                fails.append(f"p={p} shape {key[1]} {key[2]}: {what} fake {f} vs real {r} ({e:.1%})")
    print(f"\nfake group vs real rank 1: worst {worst:.2%}")
    assert not fails, "\n".join(fails)


def test_analytic_pool_equals_measured(measured):
    from megatron_paradyse.costmodel import analytic

    fails = []
    for key in measured[0]["pool"]:
        p, i, st = key
        shape = ModelShape(**shapes(p)[i], p=p)
        names = set().union(*[r["pool"][key] for r in measured])
        got = {n: max(r["pool"][key].get(n, 0) for r in measured) for n in names}
        want = analytic.pool_buffers(st, shape, S, B)
        if got != {n: int(v) for n, v in want.items()}:
            fails.append(f"p={p} {shape.describe()} {st}: measured {got}, analytic {want}")
    assert not fails, "\n".join(fails)


def test_mixed_plan_pool_counts_each_buffer_once(measured):
    from megatron_paradyse.costmodel.analytic import AnalyticCostModel

    shape = ModelShape(**dict(shapes(2)[0], num_layers=4), p=2)
    names = set().union(*[r["mixed"] for r in measured])
    got = sum(max(r["mixed"].get(n, 0) for r in measured) for n in names)
    cm = AnalyticCostModel(shape)
    want = cm.pool_bytes(MIXED, S, B)
    summed = sum(sum(cm.pool(n, S, B).values()) for n in list(MIXED) + ["nonlayer"])
    assert got == want < summed, (got, want, summed)
