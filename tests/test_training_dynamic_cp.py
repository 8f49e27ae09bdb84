"""Training with Dynamic CP: ``pretrain_gpt_paradyse.py --dynamic-context-parallel --paradyse``
on 8 gloo ranks (a pool of 4 nodes x TP = 2) trains equal to stock megatron-core TP = 2 x DP = 4
on the same global batches: per step the loss and the gradient norm, and the final weights
(relative error < 1e-5). Documents run at c = 1, 2 and 4 within a step (the placeholder
schedule with ``--max-seqlen-per-dp-cp-rank 16``: 6 .. 64 tokens), plans cycling per step,
micro-batch and layer over every strategy; the validation after step 3 (every micro-batch at
c = 1) equals stock's. The schedule's cheap properties are checked
without ranks. The training world is slow (``-m slow``); the runtime's exactness, on every c
within a step, is ``tests/test_dynamic_cp_exact.py``'s, in the default suite.
"""
from __future__ import annotations

import re

import pytest

from megatron_paradyse.testing.spawn import run_world

from .test_training import _cycling_plan_fn, _param_rel, _rel, _summary, _train

STEPS = 3
BATCH = ["--micro-batch-size", "1", "--global-batch-size", "8", "--eval-interval", "3", "--eval-iters", "1"]
DCP = ["--dynamic-context-parallel", "--max-seqlen-per-dp-cp-rank", "16", "--paradyse-plan", "tp_sp"]


def _world(rank, world):
    out = {}
    hist, out["stock_params"], trainer = _train(2, world, BATCH, paradyse=False, steps=STEPS)
    out["stock"], out["stock_eval"] = _summary(hist), [r.loss for r in trainer.evaluation.results]
    hist, out["dcp_params"], trainer = _train(2, world, BATCH + DCP, paradyse=True,
                                              plan_fn_factory=_cycling_plan_fn, steps=STEPS)
    out["dcp"], out["dcp_eval"] = _summary(hist), [r.loss for r in trainer.evaluation.results]
    loader = trainer.data_iterator.source
    out["rounds"] = [[tuple((a.first, a.size) for a in r) for r in loader.schedule(s)[0]] for s in range(STEPS)]
    return out if rank == 0 else None


@pytest.mark.slow(reason="two 8-rank trainings (20-60 s here); the Dynamic CP runtime's exactness is "
                        "tests/test_dynamic_cp_exact.py's, the trainer's schedule the test below")
def test_dynamic_cp_training_equals_stock_tp2_dp4():
    out = run_world(_world, 8, timeout=400)[0]
    got, ref = out["dcp"], out["stock"]
    assert len(got) == len(ref) == STEPS
    worst = max(_rel(x["loss"], y["loss"]) for x, y in zip(got, ref))
    worst_gn = max(_rel(x["gn"], y["gn"]) for x, y in zip(got, ref))
    prel = _param_rel(out["dcp_params"], out["stock_params"])
    sizes = [{c for r in rounds for _, c in r} for rounds in out["rounds"]]
    print(f"\nDynamic CP: max rel loss err {worst:.2e}, grad-norm {worst_gn:.2e}, final weights {prel:.2e}; "
          f"rounds {out['rounds']}")
    assert worst < 1e-5 and worst_gn < 1e-5 and prel < 1e-5
    # validation (each micro-batch at c = 1: no CP block) equals stock's as well
    assert len(out["dcp_eval"]) == len(out["stock_eval"]) == 1
    assert _rel(out["dcp_eval"][0], out["stock_eval"][0]) < 1e-5, (out["dcp_eval"], out["stock_eval"])
    assert all(len(s) > 1 for s in sizes) and set().union(*sizes) == {1, 2, 4}, sizes


PLANNED = ["--dynamic-context-parallel", "--max-seqlen-per-dp-cp-rank", "32", "--paradyse-memory-budget", "0.5"]
PLANNED_BATCH = ["--micro-batch-size", "1", "--global-batch-size", "6"]


def _planned_world(rank, world):
    """Stock TP = 2 x DP = 2, then the Dynamic CP planner on the same 4 ranks (a pool of 2 nodes)."""
    out = {}
    hist, out["stock_params"], _ = _train(2, world, PLANNED_BATCH, paradyse=False, steps=2)
    out["stock"] = _summary(hist)
    out["lines"] = []
    hist, out["dcp_params"], trainer = _train(2, world, PLANNED_BATCH + PLANNED, paradyse=True, steps=2,
                                              lines=out["lines"])
    out["dcp"] = _summary(hist)
    out["seconds"] = [h.seconds for h in hist]
    loader = trainer.data_iterator.source
    out["schedules"] = [loader.schedule(s)[0] for s in range(2)]
    out["budget"] = trainer.planner.budget
    return out if rank == 0 else None


def test_the_dynamic_cp_planner_trains_equal_to_stock():
    """The trainer with the Dynamic CP planner (no --paradyse-plan): each step's schedule is
    planner/dynamic_cp.py's (every micro-batch at a c of 1 or 2, with its own plan predicted
    within the budget), and the training equals stock TP = 2 x DP = 2 on the same batches."""
    out = run_world(_planned_world, 4, timeout=300)[0]
    got, ref = out["dcp"], out["stock"]
    assert len(got) == len(ref) == 2
    assert max(_rel(x["loss"], y["loss"]) for x, y in zip(got, ref)) < 1e-5
    assert max(_rel(x["gn"], y["gn"]) for x, y in zip(got, ref)) < 1e-5
    assert _param_rel(out["dcp_params"], out["stock_params"]) < 1e-5
    blocks = [a for rounds in out["schedules"] for r in rounds for a in r]
    assert {a.size for a in blocks if a.documents} == {1, 2}  # documents over 32 tokens need both nodes
    assert all(a.plan and a.peak_bytes <= out["budget"] for a in blocks)
    # the planner's plans ran: each step's plans are its schedule's, not one rule
    ran = {tuple(p) for h in got for p in h["plans"]}
    assert ran <= {tuple(a.plan) for a in blocks}
    # each step's log line: its schedule's predicted time and peak beside the measured ones
    steps = [ln for ln in out["lines"] if "Dynamic CP:" in ln]
    assert len(steps) == 2, out["lines"]
    for k, (ln, rounds) in enumerate(zip(steps, out["schedules"])):
        pred = sum(max(a.seconds for a in r) for r in rounds)
        m = re.search(r"time pred/meas: ([0-9.]+)/([0-9.]+) s \| peak pred/meas: ([0-9.]+)/([0-9.]+) MiB", ln)
        assert m, ln
        assert float(m.group(1)) >= round(pred, 3) - 1e-3 and abs(float(m.group(2)) - out["seconds"][k]) < 2e-3
        assert float(m.group(3)) == round(max(a.peak_bytes for r in rounds for a in r) / 2**20, 1)
        assert 0 < float(m.group(4)) <= 2 * out["budget"] / 2**20


def test_placeholder_schedule_partitions_the_pool():
    """Every round's blocks partition the pool, every document runs once, at the smallest c whose
    tokens per node fit the cap; the smallest size is kept; a document that fits nowhere is refused."""
    from megatron_paradyse.errors import UserError
    from megatron_paradyse.parallel.dynamic_cp import check_round
    from megatron_paradyse.training.dynamic_cp import placeholder_schedule

    lengths = [64, 10, 33, 17, 16, 5, 60, 31, 2]
    rounds = placeholder_schedule(lengths, 4, max_seqlen=16)
    for r in rounds:
        check_round(r, 4)
    ran = sorted((d, a.size) for r in rounds for a in r for d in a.documents)
    assert ran == sorted(enumerate([4, 1, 4, 2, 1, 1, 4, 2, 1]))
    assert len(rounds) == 5  # three at c = 4, the two at c = 2 side by side, the four at c = 1 side by side
    assert all(a.size == 2 for r in placeholder_schedule(lengths, 4, min_size=2, max_seqlen=16)[3:] for a in r)
    with pytest.raises(UserError, match="does not fit"):
        placeholder_schedule([65], 4, max_seqlen=16)
