"""A cost model made on another host, rescaled to this one (``costmodel.calibrate``): the
factors and where they apply, the command a user runs, and the trainer's
``--paradyse-calibrate``, which must train exactly as the run without it."""
from __future__ import annotations

import os

import pytest

from megatron_paradyse.costmodel import calibrate
from megatron_paradyse.costmodel.fitted import FittedCostModel
from megatron_paradyse.costmodel.packs import PackShape
from megatron_paradyse.testing.spawn import run_world

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_paradyse",
                      "costmodel", "models")
P2 = os.path.join(MODELS, "demo_p2.json")


def _rows(cm, lengths, slower):
    """Merged layer rows as a calibration measures them: each strategy ``slower[st]`` times the
    model's prediction at each length."""
    return [{"type": "layer", "strategy": st, "s": s, "b": 1, "layer_times": [1.0],
             "seconds": cm.layer(st, s, 1).seconds * slower[st](s)} for st in cm.strategies for s in lengths]


def test_factors_scale_times_only_and_interpolate_in_log_s(tmp_path):
    cm = FittedCostModel.load(P2)
    assert calibrate.lengths_for(cm, 4096) == [1024, 4096] and calibrate.lengths_for(cm, 10 ** 6)[-1] == 4096
    slower = {st: (lambda s: 1.5) for st in cm.strategies}
    slower["ring"] = lambda s: 2.0 if s == 1024 else 1.25
    cal = calibrate.apply(cm, calibrate.factors(cm, _rows(cm, [1024, 4096], slower)))
    for st in cm.strategies:
        for s in (256, 1024, 2048, 4096, 16384):
            a, b = cm.layer(st, s, 1), cal.layer(st, s, 1)
            want = 1.5 if st != "ring" else (2.0 if s <= 1024 else 1.25 if s >= 4096 else 1.625)  # linear in log s
            assert b.seconds == pytest.approx(a.seconds * want) and b.saved_bytes == a.saved_bytes
            assert b.transient_bytes == a.transient_bytes
    # a pack takes the factor of the single sequence with its share of attention, sum(d^2) / T:
    # 805 tokens for these three documents (held at the shortest calibrated length's 2.0), not
    # its total's (2048: 1.625); one document is a sequence of its length
    pack = PackShape((300, 1000, 748))
    assert cal.layer("ring", pack, 1).seconds == pytest.approx(cm.layer("ring", pack, 1).seconds * 2.0)
    one = PackShape((2048,))
    assert cal.layer("ring", one, 1).seconds == pytest.approx(cm.layer("ring", one, 1).seconds * 1.625)
    even = PackShape((1024, 1024, 1024, 1024))  # 4096 tokens of 1024-token documents: 1024's factor
    assert cal.layer("ring", even, 1).seconds == pytest.approx(cm.layer("ring", even, 1).seconds * 2.0)
    other = cal.meta["calibration"]["other"]  # the median ratio: non-layer part and update
    assert other == pytest.approx(1.5)
    assert cal.nonlayer(2048, 1).seconds == pytest.approx(cm.nonlayer(2048, 1).seconds * other)
    assert cal.update_seconds() == pytest.approx(cm.update_seconds() * other)
    assert cal.step(("tp_sp",) * 4, 2048, 1).peak_bytes == cm.step(("tp_sp",) * 4, 2048, 1).peak_bytes
    # saved and loaded: the same predictions; calibrating again starts from the profile's host
    path = calibrate.save(cal, str(tmp_path / "here.json"))
    back = FittedCostModel.load(path, cm.shape)
    assert back.layer("ring", 2048, 1) == cal.layer("ring", 2048, 1)
    again = calibrate.apply(back, calibrate.factors(back, _rows(cm, [1024, 4096], {s: (lambda x: 1.0) for s in cm.strategies})))
    assert again.layer("metp", 2048, 1).seconds == pytest.approx(cm.layer("metp", 2048, 1).seconds)


def test_the_calibrate_command(tmp_path, monkeypatch, capsys):
    """``python -m megatron_paradyse.costmodel calibrate MODEL -o OUT`` (its ``main``, which starts
    the model's p gloo ranks), into a folder that does not exist yet."""
    monkeypatch.chdir(tmp_path)
    assert calibrate.main([P2, "-o", "cal/here.json", "--seq-length", "64"]) == 0
    out = capsys.readouterr().out
    cal = FittedCostModel.load(str(tmp_path / "cal/here.json"))
    rec = cal.meta["calibration"]
    assert rec["lengths"] == [16, 64] and set(rec["strategies"]) == set(cal.strategies)
    assert all(x[1] > 0 and x[3] > 0 for pts in rec["strategies"].values() for x in pts)
    assert "wrote cal/here.json: time here / on the profile's host at s = 16/64" in out


def _calibrated_training(rank, world):
    from megatron_paradyse.training import arguments, trainer

    argv = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "8", "--ffn-hidden-size", "512",
            "--vocab-size", "258", "--seq-length", "64", "--max-position-embeddings", "64",
            "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "1", "--train-iters", "2",
            "--lr", "1e-3", "--tensor-model-parallel-size", str(world), "--sequence-parallel", "--mock-data",
            "--paradyse", "--paradyse-memory-budget", "1"]
    out = {}
    for name, extra in (("calibrated", ["--paradyse-calibrate"]), ("plain", [])):
        t = trainer.Trainer(arguments.parse_args(argv + extra, world_size=world))
        t.train()
        out[name] = ([h.loss for h in t.history], [h.plans for h in t.history],
                     t.cost_model.meta["calibration"] if t.cost_model is not None else None)
    return out


@pytest.mark.slow(reason="the calibrate command and its factors are tested above; the demo calibrates in tests/test_readme.py")
def test_the_trainers_calibration_trains_as_without_it():
    """``--paradyse-calibrate`` measures before the run's parallel state and seeds: the same
    losses as the run without it (the plans at these lengths are the same), the same factors
    on every rank."""
    got = run_world(_calibrated_training, 2, timeout=300)
    for r in got:
        assert r["calibrated"][0] == r["plain"][0] and r["calibrated"][1] == r["plain"][1]
        assert r["calibrated"][2]["lengths"] == [16, 64] and r["plain"][2] is None
    assert got[0]["calibrated"][2]["strategies"] == got[1]["calibrated"][2]["strategies"]


P4 = os.path.join(MODELS, "demo_p4.json")


def test_the_cells_are_the_ones_the_planner_can_choose_under_the_budget():
    """The demo's budget (0.03 GiB): `colossal` at 4096 tokens needs over 130 MiB even
    recomputed, so it is measured at 1024 alone; every other cell stays; no budget: all."""
    from megatron_paradyse.units import GiB

    cm = FittedCostModel.load(P4)
    every = [(st, s) for st in cm.strategies for s in (4096, 1024)]  # the longest first: one warm-up each
    assert calibrate.cells_for(cm, 4096) == every
    cells = calibrate.cells_for(cm, 4096, 0.03 * GiB)
    assert cells == [c for c in every if c != ("colossal", 4096)]
    assert calibrate.lean_bytes(cm, "colossal", 4096) > 0.03 * GiB >= calibrate.lean_bytes(cm, "tp_sp", 4096)
    # a strategy that fits nowhere is still measured, at the shortest length (its factor holds everywhere)
    assert calibrate.cells_for(cm, 4096, 1.0) == [(st, 1024) for st in cm.strategies]


def test_a_cell_stops_once_its_time_settles(monkeypatch):
    """The calibration's timed passes (``sweep._calibration_rows``, a one-rank stand-in sweep): a
    warm-up per strategy at its longest cell, then rounds visiting every open cell once, longest
    first (never one cell's passes back to back while another is open); a cell closes once a
    pass moves the max over ranks of the medians by under 3%, at least ``repeats`` and at most
    ``calibration_repeats`` passes; a noisy cell runs to the cap."""
    from types import SimpleNamespace

    from megatron_paradyse.costmodel import sweep

    assert sweep.settled([1.0, 1.5, 1.52], 0.03, 3) and not sweep.settled([1.0, 1.02], 0.03, 3)
    assert not sweep.settled([1.0, 1.2, 1.0], 0.03, 3)
    assert sweep.pass_statistic([[1.0, 2.0, 9.0], [3.0, 3.0, 3.0]]) == 3.0
    assert sweep.pass_statistic([[1.0, 2.0], [3.0]], "min") == 1.0
    script = {4096: iter([1.0, 2.0] * 20),  # tp_sp's noisy long cell
              1024: iter([1.0, 1.4, 1.01, 1.0] + [9.0] * 20),  # tp_sp's short cell: settles at its 4th pass
              2048: iter([3.0] * 20)}  # ring's cell: steady, closes at its 3rd
    order, warm = [], []

    def time(part, s, b, warmup, repeats):
        if warmup:
            warm.append((current[0], s))
            return []
        order.append((current[0], s))
        return [next(script[s])]

    current = [None]
    monkeypatch.setattr(sweep.M, "set_strategy", lambda model, st: current.__setitem__(0, st))
    cfg = SimpleNamespace(cells=(("tp_sp", 4096), ("tp_sp", 1024), ("ring", 2048)), repeats=3, stable=0.03,
                          time_stat="median")
    sw = SimpleNamespace(cfg=cfg, model=None, runner=SimpleNamespace(time=time), rows=[], rank=0, me=0, n_ranks=1,
                         dev="cpu", collective=False, attempt=lambda fn, what: (fn(), []), progress=lambda msg: None)
    sweep._calibration_rows(sw)
    assert warm == [("tp_sp", 4096), ("ring", 2048)]
    rows = {(r["strategy"], r["s"]): r["layer_times"] for r in sw.rows}
    cap = sweep.calibration_repeats(3, 4096)
    assert rows == {("tp_sp", 4096): [1.0, 2.0] * (cap // 2), ("tp_sp", 1024): [1.0, 1.4, 1.01, 1.0],
                    ("ring", 2048): [3.0] * 3}
    # rounds, longest first: ring closes in the third, tp_sp's short cell in the fourth, then the
    # noisy cell alone to its cap
    long, short, ring = ("tp_sp", 4096), ("tp_sp", 1024), ("ring", 2048)
    assert order == [long, ring, short] * 3 + [long, short] + [long] * (cap - 4)


def test_the_run_report_carries_the_calibrations_time(tmp_path):
    from megatron_paradyse.training.run_report import RunReport

    cm = FittedCostModel.load(P2)
    rec = calibrate.apply(cm, calibrate.factors(cm, _rows(cm, [1024, 4096], {st: (lambda s: 1.5) for st in cm.strategies})))
    rec = dict(rec.meta["calibration"], seconds=12.3)
    rep = RunReport(calibration=rec)
    rep.steps.append(dict(iteration=1, seconds=1.0, tokens=64, padded=[64], loss=1.0, lengths=[64], plans=[["tp_sp"] * 4], peak_bytes=None,
                          predicted_seconds=None, predicted_peak_bytes=None, tracked=None, stage_peak_bytes=None))
    assert "cost model calibrated to this host in 12.3 s: times x1.50 .. x1.50" in rep.summary()
    rep.write(str(tmp_path))
    import json
    with open(tmp_path / "run_report.json") as fh:
        assert json.load(fh)["calibration_seconds"] == 12.3
