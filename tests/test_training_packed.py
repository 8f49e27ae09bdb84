"""Training on packed micro-batches (issue 25, item 5) equals stock megatron-core on the same
documents unpacked, with plans changing per micro-batch, at p = 4 and at dp = 2 x p = 2.

One 4-rank gloo world trains a small GPT four times the same 4 steps: stock megatron-core
TP+SP (one document per micro-batch: ``--micro-batch-size 1``) and ParaDySe with
``--paradyse-pack balanced`` (each replica runs its packs, replicas different numbers of
them), at TP = 4 and at TP = 2 x DP = 2. Step ``k`` reads the same documents in both (the
scheduler's step ``k`` is Megatron's global batch ``k``) and the loss is per token, so losses,
gradient norms and final weights agree. The packed TP = 2 run also saves at step 2 and a
fresh trainer resumes from it: its steps 3-4 are the uninterrupted run's.
"""
from __future__ import annotations

import pytest

from megatron_paradyse.testing.spawn import run_world

from .test_training import _cycling_plan_fn, _param_rel, _rel, _summary, _train

STEPS, SAVE_AT = 4, 2
PACK = ["--micro-batch-size", "1", "--global-batch-size", "8", "--paradyse-pack-tokens", "64"]


def _stock(tp, world):
    hist, params, _ = _train(tp, world, ["--micro-batch-size", "1", "--global-batch-size", "8"], paradyse=False,
                             steps=STEPS)
    return _summary(hist), params


def _packed(tp, world, extra=()):
    hist, params, trainer = _train(tp, world, PACK + ["--paradyse-pack", "balanced"] + list(extra),
                                   paradyse=True, plan_fn_factory=_cycling_plan_fn, steps=STEPS)
    counts = [len(trainer.packer.replica_packs(k, d)) for k in range(STEPS) for d in range(trainer.dp_size)]
    return _summary(hist), params, counts


def _world(rank, world, root):
    import torch.distributed as dist

    out = {}
    for tp in (4, 2):
        out[f"stock{tp}"], params_s = _stock(tp, world)
        extra = ["--save", f"{root}/packed{tp}", "--save-interval", str(SAVE_AT)] if tp == 2 else []
        out[f"packed{tp}"], params_p, out[f"counts{tp}"] = _packed(tp, world, extra)
        out[f"params{tp}"] = _param_rel(params_p, params_s) if rank == 0 else None
    resumed, _, _ = _packed(2, world, ["--load", f"{root}/packed2", "--ckpt-step", str(SAVE_AT)])
    out["resumed"] = resumed
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def packed_world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("packed"))
    return run_world(_world, 4, root, timeout=300, trace=True)


@pytest.mark.parametrize("tp", [4, 2])
def test_packed_training_equals_stock_unpacked(packed_world, tp):
    r0 = packed_world[0]
    stock, packed = r0[f"stock{tp}"], r0[f"packed{tp}"]
    assert len(stock) == len(packed) == STEPS
    assert [s["tokens"] for s in stock] == [s["tokens"] for s in packed]  # the same documents
    worst = max(_rel(p["loss"], s["loss"]) for p, s in zip(packed, stock))
    worst_gn = max(_rel(p["gn"], s["gn"]) for p, s in zip(packed, stock))
    print(f"\ntp={tp}: loss {worst:.2e}, grad norm {worst_gn:.2e}, params {r0[f'params{tp}']:.2e}; "
          f"packs per replica per step {r0[f'counts{tp}']}")
    assert worst < 1e-5 and worst_gn < 1e-4 and r0[f"params{tp}"] < 1e-5
    # several documents per micro-batch, and plans that change per micro-batch and layer
    assert sum(len(s["s"]) for s in packed) < sum(len(s["s"]) for s in stock)
    plans = [p for step in packed for p in step["plans"]]
    assert len(set(plans)) > 1 and any(len(set(p)) > 1 for p in plans)
    assert packed[-1]["loss"] < packed[0]["loss"]


def test_packed_replicas_run_different_counts_and_resume(packed_world):
    r0 = packed_world[0]
    counts = r0["counts2"]
    assert len(set(counts)) > 1  # replicas (and steps) ran different numbers of packs
    resumed = r0["resumed"]
    assert [s["it"] for s in resumed] == list(range(SAVE_AT + 1, STEPS + 1))
    for a, b in zip(resumed, r0["packed2"][SAVE_AT:]):
        assert _rel(a["loss"], b["loss"]) < 1e-6 and a["plans"] == b["plans"]
