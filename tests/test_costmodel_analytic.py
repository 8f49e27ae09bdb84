"""The analytic memory model against the CPU live-bytes tracker, and the single-device mode.

One spawned world of 4 gloo ranks measures every strategy's per-rank saved and transient
bytes of one decoder layer for several shapes, first as one p = 4 group, then as two p = 2
groups (TP = 2, DP = 2); then rank 0 leaves the gloo group and plays rank 1 of a fake p-rank
group (torch's fake backend) for the same shapes. Checks:

* analytic saved bytes within 5% of the largest rank's, for every strategy, shape and p;
* a 4-layer stack's peak (4 x saved + transient) within 5%;
* the fake group's per-rank memory (saved, and saved + transient) within 5% of the real rank 1's.
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

    out = {}
    for i, sd in enumerate(shapes(p)):
        shape = ModelShape(**sd, p=p)
        _, model = M.build(shape, num_layers=1, max_seq=S)
        runner = M.LayerRunner(model, shape)
        for st in STRATS:
            M.set_strategy(model, st)
            out[(p, i, st)] = runner.memory("layer", S, B)
    return out


def _world(rank, world):
    import torch.distributed as dist

    from megatron_paradyse.costmodel import measure as M
    from megatron_paradyse.testing import models as T

    real = {}
    for p in (4, 2):
        real.update(_measure_all(p))
    dist.barrier()
    T.init_megatron(1)  # leave megatron's groups before the world goes
    fake = {}
    if rank == 0:
        for p in (2, 4):
            M.init_fake(1, p)
            fake.update(_measure_all(p))
    return {"rank": rank, "tp_rank": {4: rank, 2: rank % 2}, "real": real, "fake": fake}


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
