"""The pipeline simulation (``bench/simulate_pipeline.py``) on a small configuration (8 layers over
4 stages, 8 steps of 8 micro-batches, lengths to 256K, 6 GB GPUs): one rule judges every
system, the planner trains every step the best static system trains, the run is deterministic
(about a second)."""
from __future__ import annotations

import pytest

from megatron_paradyse.bench.simulate import Hardware
from megatron_paradyse.bench.simulate_pipeline import (Judge, Model70B, PipelineRoofline, PipelineSetup, main,
                                                       simulate_pipeline, step_shapes)
from megatron_paradyse.planner import PipelinePlanner

SMALL = dict(setup=PipelineSetup(stages=4, microbatches=8, steps=8, max_len=256 * 1024),
             model=Model70B(name="small", num_layers=8, hidden=1024, heads=16, query_groups=4, ffn=2816),
             hw=Hardware(memory_bytes=6e9, reserved_bytes=1e9))


@pytest.fixture(scope="module")
def result():
    return simulate_pipeline(**SMALL)


def test_every_trained_step_is_within_the_limit_on_every_stage(result):
    """The rule: a step is trained exactly when every stage's peak over the 1F1B schedule is
    within budget - margin; and then each micro-batch alone fits on every stage
    (``CostModel.step`` of the stage, a lower bound the rule must respect)."""
    limit = result["limit_bytes"]
    cm = PipelineRoofline(SMALL["hw"], SMALL["model"])
    judge = Judge(cm, SMALL["setup"].stages, limit)
    steps = step_shapes(SMALL["setup"])
    per_stage = {n: (n.replace("+rc", ":rc"),) * judge.per for n in result["static_systems"]}
    for name, s in result["systems"].items():
        assert s["steps_trained"] + s["steps_failed"] == len(steps)
        for k, st in enumerate(s["per_step"]):
            assert st["fits"] == all(x <= limit for x in st["stage_peaks"]), (name, k)
            if st["fits"] and name in per_stage:
                for m in judge.stages:
                    for sh in steps[k]:
                        assert m.step(per_stage[name], *sh).peak_bytes <= limit, (name, k)
    # something is trained and something is not: the configuration tests the rule both ways
    assert any(s["steps_trained"] for s in result["systems"].values())
    assert result["steps_no_system_trains"]


def test_the_planner_trains_every_step_the_best_static_system_trains(result):
    rows = result["systems"]
    best = max(result["static_systems"], key=lambda n: rows[n]["steps_trained"])
    for pn in ("paradyse", "paradyse_data_order"):
        mine = {k for k, st in enumerate(rows[pn]["per_step"]) if st["fits"]}
        theirs = {k for k, st in enumerate(rows[best]["per_step"]) if st["fits"]}
        assert theirs <= mine, (pn, best)
        assert not rows[pn]["planner_disagrees_on_steps"]  # its own verdict is the rule's
        h = result["headline"][f"{pn} vs {best}"]
        assert h["time_saved_on_steps_both"] >= 0
    assert rows["paradyse"]["seconds"] <= rows["paradyse_data_order"]["seconds"] * (1 + 1e-12)


def test_the_rule_is_the_planners_formula():
    """The judge gives the planner's own stage peaks and step time for its plans."""
    cm = PipelineRoofline(SMALL["hw"], SMALL["model"])
    budget = SMALL["hw"].memory_bytes - SMALL["hw"].reserved_bytes
    judge = Judge(cm, 4, budget)
    pp = PipelinePlanner("optimal", cm, budget, 4, margin_bytes=0.0)
    for shapes in step_shapes(SMALL["setup"])[:5]:
        sp = pp.plan_step(shapes)
        j = judge(shapes, sp.plans, sp.order)
        assert j.stage_peaks == pytest.approx(sp.stage_peaks, rel=1e-12)
        assert j.seconds == pytest.approx(sp.seconds, rel=1e-12)


def test_deterministic(result):
    assert simulate_pipeline(**SMALL) == result


def test_command_line(capsys):
    assert main(["--steps", "1", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "SIMULATION" in out and "| ParaDySe (optimal, run-order search) | " in out
    with pytest.raises(SystemExit):
        main(["--steps", "0"])
