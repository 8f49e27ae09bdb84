"""The every-dimension simulation (``bench/simulate_every_dim.py``) on a small configuration (8
layers over 2 stages, TP 8, C in {1, 2}, V in {1, 2}, 32 documents to 256K, 6 GB GPUs): the
interleaved rule is the step planner's formula, it differs from 1F1B's, ParaDySe trains every
step a static system trains at the same layout, the best layouts and aims are the grid's (a
few seconds)."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_paradyse.bench.simulate import Hardware, lengths_distribution
from megatron_paradyse.bench.simulate_every_dim import (SYSTEMS, EveryDimSetup, InterleavedJudge, Layout, main,
                                                        replica_steps, simulate_every_dim)
from megatron_paradyse.bench.simulate_pipeline import Judge, Model70B

MODEL = Model70B(name="small", num_layers=8, hidden=1024, heads=16, query_groups=4, ffn=2816)
HW = Hardware(memory_bytes=6e9, reserved_bytes=1e9)
SETUP = EveryDimSetup(gpus=64, tp=8, stages=2, cp_sizes=(1, 2), chunks=(1, 2), docs=32, batch=8,
                      max_len=256 * 1024, longest_cap=1 << 22)


@pytest.fixture(scope="module")
def result():
    return simulate_every_dim(SETUP, HW, MODEL)


def _steps(lay: Layout):
    lens = [int(x) for x in lengths_distribution(SETUP.docs, SETUP.seed, SETUP.max_len, SETUP.min_len)]
    return [[(lay.pad(s), b) for s, b in shapes] for st in replica_steps(lens, SETUP.batch, lay.dp) for shapes in st]


def test_the_interleaved_rule_is_the_step_planners_formula():
    """At V = 2 under CP = 2 the judge gives the planner's own stage peaks and step time for
    its plans (both price the interleaved schedule's in-flight chunks)."""
    lay = Layout(SETUP, HW, 2, 2, MODEL)
    checked = 0
    for shapes in _steps(lay)[:4]:
        sp = lay.planner.plan_step(shapes)
        j = lay.judge(shapes, sp.plans, sp.order)
        assert j.stage_peaks == pytest.approx(sp.stage_peaks, rel=1e-9)
        assert j.seconds == pytest.approx(sp.seconds, rel=1e-9)
        assert j.fits == sp.fits
        checked += 1
    assert checked == 4


def test_the_interleaved_rule_is_not_1f1b():
    """V = 2 is judged by its own schedule: stage 0 holds more chunks in flight than 1F1B's
    micro-batches (its peaks differ), and with the stage's time split over its chunks the
    bubbles shrink (a shorter makespan)."""
    lay = Layout(SETUP, HW, 1, 2, MODEL)
    one = Judge(lay.cm, SETUP.stages, lay.budget)
    plan = ("tp_sp:rc",) * MODEL.num_layers
    shapes = [(16384, 1)] * 4
    v2, v1 = lay.judge(shapes, [plan] * 4, range(4)), one(shapes, [plan] * 4, range(4))
    assert v2.stage_peaks[0] != pytest.approx(v1.stage_peaks[0], rel=1e-6)
    assert v2.makespan < v1.makespan
    assert InterleavedJudge(lay.cm, SETUP.stages, lay.budget, 1)(shapes, [plan] * 4, range(4)) == v1


def test_paradyse_trains_what_a_static_system_trains_at_each_layout(result):
    n = len(result["grid"]["paradyse"])
    assert n == len(SETUP.cp_sizes) * len(SETUP.chunks)
    for i in range(n):
        mine = result["grid"]["paradyse"][i]
        for name in ("tp_sp", "tp_sp+rc"):
            theirs = result["grid"][name][i]
            assert (mine["c"], mine["v"]) == (theirs["c"], theirs["v"])
            for a, b in zip(mine["per_step"], theirs["per_step"]):
                assert b is None or a is not None, (name, mine["c"], mine["v"])
            assert mine["longest_trainable"] >= theirs["longest_trainable"], (name, mine["c"], mine["v"])
    # the configuration is not trivial: some layout of a stock system misses a step
    assert any(None in r["per_step"] for n in SYSTEMS for r in result["grid"][n])


def test_best_layouts_and_aims_are_the_grids(result):
    for name in SYSTEMS:
        rows = result["grid"][name]
        best = result["best"][name]
        top = max((r["tokens_trained"], r["tokens_per_s"]) for r in rows)
        assert (best["tokens_trained"], best["tokens_per_s"]) == top
    a = result["aims"]
    assert a["paradyse_longest"] == max(r["longest_trainable"] for r in result["grid"]["paradyse"])
    assert a["longest_met"] == (a["paradyse_longest"] >= 1.3 * a["megatron_longest"])
    assert a["tokens_per_s_met"] == (a["tokens_per_s"] > a["megatron_tokens_per_s"])


def test_command_line_refuses_a_layout_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--cp", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpus 512" in err[0]
    with pytest.raises(SystemExit):
        main(["--chunks", "3"])
    assert dataclasses.asdict(SETUP)["chunks"] == (1, 2)
