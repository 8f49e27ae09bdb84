"""Recomputed layers (plan entries ``st:rc``) in the cost models.

No process group here: the fit is checked on synthetic ``recompute`` rows written as the
profiler writes them (a known extra time per strategy, the tracker's saved and transient
bytes as measured on the demo layer: the output plus the checkpoint's RNG states, and the
plain layer's saved + transient plus the same), the shipped models' section is read as
shipped, and the analytic model's assumption is checked against its own plain layer. The
profiler's phase itself runs in ``tests/test_costmodel_profile.py`` (2 gloo ranks).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_paradyse.costmodel import build_cost_model, demo_shape
from megatron_paradyse.costmodel.analytic import AnalyticCostModel, basis
from megatron_paradyse.costmodel.calibrate import apply
from megatron_paradyse.costmodel.fit import fit_profile
from megatron_paradyse.costmodel.fitted import FittedCostModel
from megatron_paradyse.parallel.packing import PackShape
from tests.test_costmodel_fit import LAW, SHAPE, write_profile

EXTRA = {"tp_sp": 0.40, "ulysses": 0.35, "ring": 0.30, "colossal": 0.45, "metp": 0.20}
RNG_BYTES = 15168  # what megatron's checkpoint keeps beside the layer's output (measured, CPU)
CELLS = (256, 1024, 4096)


def recompute_rows(prof_rows, rounds=8, noise=0.03, seed=1):
    """``recompute`` rows at CELLS from the synthetic profile's layer rows: plain and rc timed
    in the same rounds (a drift common to both, noise of their own), the memory as the tracker
    measures it on the demo layer (output + RNG states; plain saved + transient + the same)."""
    rng = np.random.default_rng(seed)
    layers = {(r["strategy"], r["s"]): r for r in prof_rows if r.get("type") == "layer"}
    out = []
    for st in LAW:
        for s in CELLS:
            lay = layers[(st, s)]
            drift = 1 + 0.3 * rng.random(rounds)  # the machine's speed, shared by the round
            plain = lay["seconds"] * drift * (1 + noise * rng.standard_normal(rounds))
            rc = lay["seconds"] * (1 + EXTRA[st]) * drift * (1 + noise * rng.standard_normal(rounds))
            out.append({"type": "recompute", "strategy": st, "s": s, "b": 1,
                        "plain_times": plain.tolist(), "rc_times": rc.tolist(),
                        "seconds": float(np.median(rc)), "plain_seconds": float(np.median(plain)),
                        "saved_bytes": s // SHAPE.p * SHAPE.hidden * SHAPE.elt + RNG_BYTES,
                        "transient_bytes": lay["saved_bytes"] + lay["transient_bytes"] + RNG_BYTES,
                        "plain_saved_bytes": lay["saved_bytes"], "plain_transient_bytes": lay["transient_bytes"],
                        "expected": lay["seconds"] * (1 + EXTRA[st])})  # without the drift
    return out


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    d = tmp_path_factory.mktemp("rc")
    prof = d / "prof.jsonl"
    write_profile(prof, [128, 256, 512, 1024, 2048, 4096])
    rows = [json.loads(x) for x in open(prof)]
    rc = recompute_rows(rows)
    with open(prof, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rc))
    meta = fit_profile(str(prof), str(d / "m.json"))
    return build_cost_model(SHAPE, str(d / "m.json")), meta, rc, d


def test_fit_prices_recomputed_layers_from_the_rows(fitted):
    cm, meta, rows, _ = fitted
    assert cm.recomputes() and meta["recompute_complete"]
    for r in rows:
        st, s = r["strategy"], r["s"]
        plain, got = cm.layer(st, s, 1), cm.layer(st + ":rc", s, 1)
        # time: the plain prediction times 1 + the extra the rounds measured (the drift cancels)
        assert got.seconds / plain.seconds - 1 == pytest.approx(EXTRA[st], abs=0.05), (st, s)
        assert abs(got.seconds / r["expected"] - 1) < 0.08, (st, s, got.seconds, r["expected"])
        # memory: the saved output and the transient an upper bound of what was measured, tight
        assert r["saved_bytes"] <= got.saved_bytes <= r["saved_bytes"] * 1.001, (st, s)
        assert r["transient_bytes"] <= got.transient_bytes <= r["transient_bytes"] * 1.01, (st, s)
    sec = meta["recompute"]["tp_sp"]
    assert sec["saved"][1] == pytest.approx(SHAPE.hidden * SHAPE.elt) and sec["transient_factor"] >= 1.0
    assert [x[0] for x in sec["extra"]] == list(CELLS) and len(sec["extra_spread"]) == len(CELLS)
    # between and beyond the cells: continuous, and a layer keeps far less than the plain one
    for s in (512, 2048, 8192, 32768):
        plain, got = cm.layer("ring", s, 1), cm.layer("ring:rc", s, 1)
        assert plain.seconds < got.seconds < 1.6 * plain.seconds
        assert got.saved_bytes < plain.saved_bytes and got.transient_bytes >= plain.saved_bytes + plain.transient_bytes


def test_packs_pools_steps_and_calibration_take_recomputed_entries(fitted):
    cm, _, _, _ = fitted
    pk = PackShape((300, 700, 24))
    plain, got = cm.layer("ulysses", pk, 1), cm.layer("ulysses:rc", pk, 1)
    assert got.seconds > plain.seconds and got.saved_bytes < plain.saved_bytes
    assert got.transient_bytes >= plain.saved_bytes + plain.transient_bytes
    assert cm.pool("metp:rc", 1024, 1) == cm.pool("metp", 1024, 1)
    assert cm.pool("metp:rc", pk, 1) == cm.pool("metp", pk, 1)
    plan = ("tp_sp:rc", "tp_sp:rc", "metp", "ring")
    step = cm.step(plan, 2048, 1)
    assert step.seconds == pytest.approx(cm.nonlayer(2048, 1).seconds + sum(cm.layer(x, 2048, 1).seconds for x in plan))
    assert step.peak_bytes < cm.step(("tp_sp", "tp_sp", "metp", "ring"), 2048, 1).peak_bytes
    # a calibration to this host scales the recomputed layer's time as its strategy's
    rec = {"strategies": {st: [[512, 2.0, 1.0, 2.0], [2048, 2.0, 1.0, 2.0]] for st in cm.strategies},
           "other": 2.0, "lengths": [512, 2048]}
    cal = apply(cm, rec, host={"node": "test"})
    assert cal.layer("tp_sp:rc", 1024, 1).seconds == pytest.approx(2 * cm.layer("tp_sp:rc", 1024, 1).seconds)
    assert cal.layer("tp_sp:rc", 1024, 1).saved_bytes == cm.layer("tp_sp:rc", 1024, 1).saved_bytes


def test_a_file_without_the_section_loads_and_prices_no_recompute(fitted):
    cm, _, _, d = fitted
    meta = json.loads((d / "m.json").read_text())
    for key in ("recompute", "recompute_complete"):
        meta.pop(key)
    (d / "old.json").write_text(json.dumps(meta))
    old = FittedCostModel.load(str(d / "old.json"), SHAPE)
    assert not old.recomputes()
    assert old.layer("ring", 1024, 1) == cm.layer("ring", 1024, 1)
    with pytest.raises(KeyError, match="without recompute rows"):
        old.layer("ring:rc", 1024, 1)
    # a section missing a strategy (its phase ran out of memory): no recompute priced at all
    meta = json.loads((d / "m.json").read_text())
    del meta["recompute"]["colossal"]
    (d / "part.json").write_text(json.dumps(meta))
    assert not FittedCostModel.load(str(d / "part.json"), SHAPE).recomputes()


@pytest.mark.parametrize("p", [2, 4])
def test_shipped_models_price_recompute_from_their_profiles(p):
    cm = build_cost_model(demo_shape(p))
    assert isinstance(cm, FittedCostModel) and cm.recomputes()
    sec = cm.meta["recompute"]
    assert set(sec) == set(cm.strategies)
    for st, r in sec.items():
        assert r["transient_factor"] >= 1.0 and r["saved"][1] == pytest.approx(128 * 4)  # [s/p, b, h] fp32
        for s, b, f in r["extra"]:
            assert 0.0 < f < 1.0, (st, s, f)  # the forward again: more time, less than a second layer
            plain, got = cm.layer(st, s, b), cm.layer(st + ":rc", s, b)
            assert got.seconds / plain.seconds - 1 == pytest.approx(f, rel=1e-9)
        for s, b, rc_s, plain_s, saved, trans in r["cells"]:
            got = cm.layer(st + ":rc", s, b)
            assert saved <= got.saved_bytes <= saved * 1.01 and trans <= got.transient_bytes, (st, s)


def test_analytic_model_assumes_one_more_forward():
    shape = demo_shape(4)
    cm = AnalyticCostModel(shape)
    assert cm.recomputes()
    for st in cm.strategies:
        for s in (512, PackShape((900, 100, 24))):
            plain, got = cm.layer(st, s, 1), cm.layer(st + ":rc", s, 1)
            passes = 4 if st == "metp" else 3
            assert got.seconds == pytest.approx(plain.seconds * (1 + 1 / passes))
            tokens = s if isinstance(s, int) else s.padded(4).tokens
            assert got.saved_bytes == basis(shape, tokens, 1)["t*h"] == tokens / 4 * 128 * 4
            assert got.transient_bytes == pytest.approx(plain.saved_bytes + plain.transient_bytes)
            assert cm.pool(st + ":rc", s, 1) == cm.pool(st, s, 1)
