"""The time model on the analytic work (issue 24): features, rates by non-negative least
squares, the correction fading beyond the profiled range, the shipped models."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_paradyse.costmodel import analytic, build_cost_model, kernels
from megatron_paradyse.costmodel.fit import (RATE_FEATURES, fit_kernel_rates, fit_profile, fit_time_rates,
                                             rate_features)
from megatron_paradyse.costmodel.fitted import FittedCostModel, fade
from megatron_paradyse.costmodel.profile import FORMAT
from megatron_paradyse.costmodel.shape import ModelShape, demo_shape

SHAPE = ModelShape(num_layers=3, hidden=160, heads=10, query_groups=2, ffn=432, swiglu=True, bias=False,
                   vocab=512, p=2, dtype="fp32")
SEQS = (128, 256, 512, 1024, 2048)
# seconds per unit of each feature: one GEMM rate, attention per kernel class, collectives per class
TRUE = {"gemm_flops": 1 / 20e9, "attn_flops@flash": 1 / 40e9, "attn_flops@rows": 1 / 8e9,
        "comm:collective": 1 / 2e9, "comm:alltoall": 1 / 1e9, "comm:p2p": 1 / 3e9}
FIXED = {"tp_sp": 2e-3, "ulysses": 3e-3, "ring": 5e-3, "colossal": 6e-3, "metp": 8e-3}


def true_seconds(st, s, b, shape=SHAPE):
    f = analytic.time_features(st, shape, s, b)
    cls = analytic.ATTENTION_KERNEL[st]
    return (FIXED[st] + TRUE["gemm_flops"] * f["gemm_flops"] + TRUE[f"attn_flops@{cls}"] * f["attn_flops"]
            + sum(TRUE[k] * f[k] for k in ("comm:collective", "comm:alltoall", "comm:p2p")))


@pytest.mark.parametrize("st", analytic.STRATEGIES)
def test_features_scale_as_the_work(st):
    """GEMM FLOPs grow as b*s, attention FLOPs as b*s^2 (and only they), the collective bytes
    are the analytic collectives' wire bytes, their classes sum them."""
    f1, f2 = analytic.time_features(st, SHAPE, 1024, 1), analytic.time_features(st, SHAPE, 2048, 1)
    fb = analytic.time_features(st, SHAPE, 1024, 2)
    assert f2["gemm_flops"] == pytest.approx(2 * f1["gemm_flops"]) == pytest.approx(fb["gemm_flops"])
    assert f2["attn_flops"] == pytest.approx(4 * f1["attn_flops"])
    assert fb["attn_flops"] == pytest.approx(2 * f1["attn_flops"])
    assert f1["gemm_flops"] + f1["attn_flops"] == pytest.approx(analytic.layer_flops(st, SHAPE, 1024, 1))
    ops = analytic.comm_ops(st, SHAPE, 1024, 1)
    for kind in analytic.COMM_KINDS:
        want = sum(c * analytic.wire_bytes(k, nb, SHAPE.p) for k, nb, c in ops if k == kind)
        assert f1[f"bytes:{kind}"] == pytest.approx(want), kind
    assert sum(f1[k] for k in f1 if k.startswith("comm:")) == pytest.approx(
        sum(f1[f"bytes:{k}"] for k in analytic.COMM_KINDS))
    assert f1["messages"] == sum(c for _, _, c in ops) and f1["layer"] == 1.0
    # the wire bytes at p = 2: half of a ring collective's tensor, all of a hop
    assert analytic.wire_bytes("allgather", 1000, 2) == 500 and analytic.wire_bytes("p2p", 1000, 2) == 1000
    assert analytic.time_features(st, ModelShape(**{**SHAPE.key(), "p": 1}), 1024, 1)["messages"] == 0


def test_metp_counts_its_recomputed_forward():
    a, m = analytic.time_features("ring", SHAPE, 1024, 1), analytic.time_features("metp", SHAPE, 1024, 1)
    assert m["attn_flops"] == pytest.approx(4 / 3 * a["attn_flops"])
    assert m["gemm_flops"] == pytest.approx(4 / 3 * a["gemm_flops"])


def _tables(noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for st in analytic.STRATEGIES:
        s = np.array([x for x in SEQS for _ in (1, 2)], float)
        b = np.array([bb for _ in SEQS for bb in (1, 2)], float)
        y = np.array([true_seconds(st, int(x), int(bb)) for x, bb in zip(s, b)])
        out[st] = (s, b, y * (1 + noise * rng.standard_normal(len(y))))
    return out


def test_nnls_recovers_the_rates_of_the_feature_model():
    """Data made by the feature model with known rates: the fit returns them (all >= 0), and
    they predict 4x beyond the fitted lengths."""
    got = fit_time_rates(_tables(), SHAPE)
    for st, rates in got.items():
        assert set(rates) == set(RATE_FEATURES)
        assert all(v >= 0 for v in rates.values()), rates
        cls = analytic.ATTENTION_KERNEL[st]
        assert rates["attn_flops"] == pytest.approx(TRUE[f"attn_flops@{cls}"], rel=1e-6)
        assert rates["gemm_flops"] == pytest.approx(TRUE["gemm_flops"], rel=1e-6)
        f = analytic.time_features(st, SHAPE, 1024, 1)
        for k in ("comm:collective", "comm:alltoall", "comm:p2p"):
            if f[k] > 0:
                assert rates[k] == pytest.approx(TRUE[k], rel=1e-6), (st, k)
        assert rates["layer"] == pytest.approx(FIXED[st], rel=1e-6)
        feats = rate_features(st, SHAPE, [8192], [1])
        pred = sum(rates[k] * feats[k][0] for k in rates)
        assert pred == pytest.approx(true_seconds(st, 8192, 1), rel=1e-6)


def test_nnls_rates_stay_nonnegative_under_noise():
    got = fit_time_rates(_tables(noise=0.05, seed=3), SHAPE)
    for st, rates in got.items():
        assert all(v >= 0 for v in rates.values()), (st, rates)
        feats = rate_features(st, SHAPE, [8192], [1])
        pred = sum(rates[k] * feats[k][0] for k in rates)
        assert pred == pytest.approx(true_seconds(st, 8192, 1), rel=0.15), st


def _profile(path, seqs, bump, extra=()):
    """A profile whose times are the feature model's times ``(1 + bump(s))``, ``extra`` rows after them."""
    rows = [{"type": "header", "format": FORMAT, "shape": SHAPE.key(), "p": SHAPE.p, "dtype": SHAPE.dtype,
             "strategies": list(analytic.STRATEGIES), "mode": "synthetic"}]
    for st in analytic.STRATEGIES:
        for s in seqs:
            sv, tr = analytic.layer_memory(st, SHAPE, s, 1)
            rows.append({"type": "layer", "strategy": st, "s": s, "b": 1,
                         "seconds": true_seconds(st, s, 1) * (1 + bump(s)), "saved_bytes": sv,
                         "transient_bytes": tr})
    rows += list(extra)
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


KERNEL_A, KERNEL_R = 1e-7, TRUE["attn_flops@flash"]  # the flash kernel's seconds per token and per FLOP


def _kernel_rows(seqs, wrong=()):
    """``kernel`` rows made by ``a*s + r*FLOPs``; at ``wrong`` lengths 3x that."""
    return [{"type": "kernel", "kernel": "flash", "s": s, "b": 1,
             "kernel_seconds": (KERNEL_A * s + KERNEL_R * kernels.kernel_flops("flash", SHAPE, s, 1))
             * (3 if s in wrong else 1)} for s in seqs]


def test_kernel_calibration_gives_the_rate_from_the_longest_fitted_lengths():
    """The kernel rows' curve is recovered from the three longest lengths the class's strategies
    are fitted on: rows at held-out lengths (here 3x off) and at the shortest ones (another
    regime on a CPU) change nothing."""
    tabs = {st: (np.array(SEQS, float), np.ones(len(SEQS)), np.ones(len(SEQS))) for st in analytic.STRATEGIES}
    got = fit_kernel_rates(_kernel_rows(SEQS + (384, 4096), wrong=(128, 256, 384, 4096)), tabs, SHAPE)
    assert set(got) == set(kernels.KERNELS) == {"flash"}
    assert got["flash"]["lengths"] == list(SEQS[-3:])
    assert (got["flash"]["tokens"], got["flash"]["attn_flops"]) == pytest.approx((KERNEL_A, KERNEL_R), rel=1e-6)
    assert got["flash"]["GFLOPs"] == pytest.approx(1e-9 / KERNEL_R)
    # fewer than three fitted lengths: not calibrated (the layers' fit rates it)
    assert fit_kernel_rates(_kernel_rows(SEQS[:2]), tabs, SHAPE) == {}
    with pytest.raises(ValueError, match="no calibration for attention kernel class 'rows'"):
        kernels.kernel_flops("rows", SHAPE, 1024, 1)


def test_a_fixed_attention_rate_is_kept_and_the_others_fit_what_it_leaves():
    """Given the true attention rates the others come out exact; given a wrong one, it is kept
    as given (the layers do not override the kernel calibration)."""
    fixed = {f"attn_flops@{k}": TRUE[f"attn_flops@{k}"] for k in ("flash", "rows")}
    got = fit_time_rates(_tables(), SHAPE, fixed=fixed)
    for st, rates in got.items():
        assert rates["gemm_flops"] == pytest.approx(TRUE["gemm_flops"], rel=1e-6)
        assert rates["layer"] == pytest.approx(FIXED[st], rel=1e-6)
    wrong = fit_time_rates(_tables(), SHAPE, fixed={"attn_flops@flash": 2 * TRUE["attn_flops@flash"]})
    assert wrong["tp_sp"]["attn_flops"] == 2 * TRUE["attn_flops@flash"]
    assert wrong["colossal"]["attn_flops"] > 0  # the other class still fitted


def test_fit_takes_the_attention_rates_from_the_kernel_rows(tmp_path):
    """A profile whose layer times at 2048 read 25% low (one noisy length): the joint fit's
    flash rate moves with it, the kernel-calibrated one stays the kernel's and predicts 4x
    beyond the fitted lengths within 10% where the joint one misses by more."""
    _profile(tmp_path / "p.jsonl", SEQS + (8192,), lambda s: -0.25 if s == 2048 else 0.0,
             extra=_kernel_rows(SEQS))
    fit_profile(str(tmp_path / "p.jsonl"), str(tmp_path / "k.json"), fit_max_seq=2048)
    fit_profile(str(tmp_path / "p.jsonl"), str(tmp_path / "j.json"), fit_max_seq=2048, attention_rate="joint")
    k, j = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "kj")
    assert set(k["kernel_rates"]) == {"flash"} and j["kernel_rates"] == {}
    mk, mj = build_cost_model(SHAPE, str(tmp_path / "k.json")), build_cost_model(SHAPE, str(tmp_path / "j.json"))
    flash = [st for st in analytic.STRATEGIES if analytic.ATTENTION_KERNEL[st] == "flash"]
    for st in analytic.STRATEGIES:
        how = "kernel" if st in flash else "joint"  # colossal's rows: no calibration
        assert k["targets"][st]["seconds"]["physics"]["attention_rate"] == how
        assert j["targets"][st]["seconds"]["physics"]["attention_rate"] == "joint"
    for st in flash:
        assert k["targets"][st]["seconds"]["physics"]["rates"]["attn_flops"] == pytest.approx(KERNEL_R)
        assert abs(mk.layer(st, 8192, 1).seconds / true_seconds(st, 8192, 1) - 1) < 0.10, st
    assert max(abs(mj.layer(st, 8192, 1).seconds / true_seconds(st, 8192, 1) - 1) for st in flash) > 0.10


def test_residual_correction_does_not_act_beyond_the_profiled_range(tmp_path):
    """A correction measured inside the range (here +30% measured at the largest fitted length) is used
    there, fades between s_max and 2 s_max, and is gone beyond: there the rates alone predict."""
    bump = lambda s: 0.30 if s == 2048 else 0.0  # noqa: E731
    _profile(tmp_path / "p.jsonl", (128, 256, 512, 1024, 2048, 8192), bump)
    meta = fit_profile(str(tmp_path / "p.jsonl"), str(tmp_path / "m.json"), fit_max_seq=2048)
    assert meta["format"] == "paradyse-costmodel/2"
    assert all(meta["held_out"][st] == [8192] for st in analytic.STRATEGIES)
    m = build_cost_model(SHAPE, str(tmp_path / "m.json"))
    for st in analytic.STRATEGIES:
        phi = lambda s: m._phi(st, "seconds", s, 1)  # noqa: E731
        in_range = m.layer(st, 2048, 1).seconds / phi(2048) - 1
        assert in_range > 0.01, (st, in_range)  # the correction acts at the measured length
        mid = m.layer(st, 2896, 1).seconds / phi(2896) - 1  # half-way in log2
        assert mid == pytest.approx(in_range * fade(2896, 2048), abs=1e-9)
        for s in (4096, 8192, 16384):
            assert m.layer(st, s, 1).seconds == pytest.approx(phi(s), rel=1e-12), (st, s)
    assert fade(2048, 2048) == 1.0 and fade(4096, 2048) == 0.0 and fade(1e6, 2048) == 0.0


def test_a_format_1_file_is_still_read(tmp_path):
    """A model file of the earlier format (its time a curve in s) loads and predicts as before."""
    _profile(tmp_path / "p.jsonl", SEQS, lambda s: 0.0)
    fit_profile(str(tmp_path / "p.jsonl"), str(tmp_path / "m.json"), time_model="poly")
    meta = json.loads((tmp_path / "m.json").read_text())
    meta["format"] = "paradyse-costmodel/1"
    for st in meta["targets"]:
        meta["targets"][st]["seconds"].pop("beyond")
    (tmp_path / "m.json").write_text(json.dumps(meta))
    m = FittedCostModel.load(str(tmp_path / "m.json"), shape=SHAPE)
    assert meta["targets"]["ring"]["seconds"]["physics"]["kind"] == "poly"
    assert m.layer("ring", 1024, 1).seconds == pytest.approx(true_seconds("ring", 1024, 1), rel=0.05)
    assert m.layer("ring", 4096, 1).seconds > m.layer("ring", 2048, 1).seconds


@pytest.mark.parametrize("p", (2, 4))
def test_the_shipped_models_are_fitted_rates_and_predict(p):
    m = build_cost_model(demo_shape(p))
    assert isinstance(m, FittedCostModel) and m.meta["format"] == "paradyse-costmodel/2"
    for st in m.strategies:
        phys = m.meta["targets"][st]["seconds"]["physics"]
        assert phys["kind"] == "rates" and all(v >= 0 for v in phys["rates"].values())
        t = [m.layer(st, s, 1).seconds for s in (1024, 4096, 16384, 65536)]
        assert all(a < b for a, b in zip(t, t[1:])), (st, t)
        # far beyond the profile the attention's s^2 term dominates: 4x the length, ~16x the time
        assert 10 < t[3] / t[2] < 16.5, (st, t)
