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

from .test_training import _cycling_plan_fn, _evaluated, _param_rel, _rel, _summary, _train

STEPS, SAVE_AT = 4, 2
PACK = ["--micro-batch-size", "1", "--global-batch-size", "8", "--paradyse-pack-tokens", "64"]


EVAL = ["--eval-iters", "1"]  # the final validation and test (TP = 4 only)


def _stock(tp, world, extra=()):
    hist, params, trainer = _train(tp, world, ["--micro-batch-size", "1", "--global-batch-size", "8"] + list(extra),
                                   paradyse=False, steps=STEPS)
    return _summary(hist), params, _evaluated(trainer) if extra else None


def _packed(tp, world, extra=(), evaluate=False):
    hist, params, trainer = _train(tp, world, PACK + ["--paradyse-pack", "balanced"] + list(extra),
                                   paradyse=True, plan_fn_factory=_cycling_plan_fn, steps=STEPS)
    counts = [len(trainer.packer.replica_packs(k, d)) for k in range(STEPS) for d in range(trainer.dp_size)]
    if evaluate:
        ev = _evaluated(trainer)
        ev["packs"] = [mb.cu_seqlens for mb in trainer.evaluation.iterators["validation"].current]
        return _summary(hist), params, counts, ev
    return _summary(hist), params, counts


def _world(rank, world, root):
    import torch.distributed as dist

    out = {}
    out["stock4"], params_s, out["stock_eval"] = _stock(4, world, EVAL)
    out["packed4"], params_p, out["counts4"], out["packed_eval"] = _packed(4, world, EVAL, evaluate=True)
    out["params4"] = _param_rel(params_p, params_s) if rank == 0 else None
    out["stock2"], params_s, _ = _stock(2, world)
    out["packed2"], params_p, out["counts2"] = _packed(2, world, ["--save", f"{root}/packed2",
                                                                  "--save-interval", str(SAVE_AT)])
    out["params2"] = _param_rel(params_p, params_s) if rank == 0 else None
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


def test_packed_validation_equals_stock_unpacked(packed_world):
    """--eval-iters 1 with --paradyse-pack: the final validation and test batches are packed as
    the training's (several documents per pack, cycling plans) and their losses equal stock's
    on the same documents unpacked (fp32, rel < 1e-5)."""
    r0 = packed_world[0]
    stock, packed = r0["stock_eval"]["results"], r0["packed_eval"]["results"]
    assert [x[:2] for x in stock] == [x[:2] for x in packed] == [
        (f"iteration {STEPS} on validation set", "validation"), (f"iteration {STEPS} on test set", "test")]
    worst = max(_rel(p[2], s[2]) for p, s in zip(packed, stock))
    print(f"\npacked validation: max rel err {worst:.2e}; {len(stock) + len(packed)} evaluations in "
          f"{sum(x[6] for x in stock + packed):.1f} s")
    assert worst < 1e-5
    assert any(len(cu) > 2 for cu in r0["packed_eval"]["packs"])  # several documents in a pack
    assert all(p is not None for p in r0["packed_eval"]["plans"])
