"""The profiler, the fit and the report's whole steps, end to end on 2 gloo ranks (short lengths).

What the shipped models come from: `profile` writes every row the fit needs (layers, pool,
non-layer part, the step's update as megatron-core training runs it), `fit` turns them into a
model, and a mixed plan's whole training step, measured as training runs it, peaks where the
model says (the CPU tracker is exact, so this is checked; times are printed by the report,
never asserted).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_paradyse.costmodel import build_cost_model, demo_shape
from megatron_paradyse.costmodel.fit import fit_profile
from megatron_paradyse.costmodel.profile import ProfileConfig, run_profile
from megatron_paradyse.costmodel.report import measure_steps, step_errors

SHAPE = demo_shape(2)
CFG = ProfileConfig(seqs=[128, 256, 512], batches=[1], strategies=["tp_sp", "ring", "metp"], parts=["layer", "attn"],
                    warmup=1, repeats=1, command="test", recompute_points=2)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    d = tmp_path_factory.mktemp("profile")
    rows = run_profile(SHAPE, CFG, nproc=2, out=str(d / "p.jsonl"), timeout=300)
    fit_profile(str(d / "p.jsonl"), str(d / "m.json"))
    return rows, build_cost_model(SHAPE, str(d / "m.json")), d


def test_profile_writes_every_row_the_fit_needs(fitted):
    rows, cm, d = fitted
    kinds = [r["type"] for r in rows]
    assert kinds[0] == "header" and kinds[-1] == "footer"
    head = rows[0]
    assert head["p"] == 2 and head["shape"] == SHAPE.key() and head["versions"]["torch"]
    from megatron_paradyse.cpu_compat import ALLOCATOR_ENV  # the spawned ranks' settings, recorded

    assert head["hardware"]["allocator_env"] == ALLOCATOR_ENV
    layers = {(r["strategy"], r["s"]) for r in rows if r["type"] == "layer"}
    assert layers == {(st, s) for st in CFG.strategies for s in CFG.seqs}
    for r in rows:
        if r["type"] == "layer":
            # the timed repeats ran in rounds over every cell: one per round, parts alike
            assert len(r["layer_times"]) == len(r["attn_times"]) >= 1 and r["seconds"] > 0
            assert len(r["saved_by_rank"]) == 2 and r["saved_bytes"] > 0
    upd = [r for r in rows if r["type"] == "optimizer"]
    assert len(upd) == 1 and upd[0]["grad_sync_seconds"] > 0 and upd[0]["optimizer_seconds"] > 0
    assert cm.update_seconds() == pytest.approx(upd[0]["grad_sync_seconds"] + upd[0]["optimizer_seconds"])
    assert {r["strategy"] for r in rows if r["type"] == "pool"} == set(CFG.strategies) | {"nonlayer"}
    saved = json.loads((d / "m.json").read_text())
    assert saved["nonlayer"]["update_seconds"] == pytest.approx(cm.update_seconds())
    # the attention kernel calibration: the flash class (all three strategies') at every length,
    # and the fit takes its s**2 rate as theirs
    kern = {(r["kernel"], r["s"]) for r in rows if r["type"] == "kernel"}
    assert kern == {("flash", s) for s in CFG.seqs}
    assert all(r["kernel_seconds"] > 0 for r in rows if r["type"] == "kernel")
    for st in CFG.strategies:
        phys = saved["targets"][st]["seconds"]["physics"]
        if "flash" in saved["kernel_rates"]:  # absent only if the noise left no s**2 term
            assert phys["attention_rate"] == "kernel"
            assert phys["rates"]["attn_flops"] == saved["kernel_rates"]["flash"]["attn_flops"]


def test_the_recompute_phase_is_measured_and_priced(fitted):
    """The recompute phase (on by default): per strategy at the shortest and the longest of its
    lengths (recompute_points=2), ``st`` and ``st:rc`` timed in the same rounds and both
    memories measured; the fitted model prices ``st:rc`` from them, its saved and transient
    bytes an upper bound of the tracker's."""
    rows, cm, _ = fitted
    rc = [r for r in rows if r["type"] == "recompute"]
    assert {(r["strategy"], r["s"]) for r in rc} == {(st, s) for st in CFG.strategies for s in (128, 512)}
    layers = {(r["strategy"], r["s"]): r for r in rows if r["type"] == "layer"}
    assert cm.recomputes()
    for r in rc:
        st, s = r["strategy"], r["s"]
        assert len(r["rc_times"]) == len(r["plain_times"]) == 4 and r["seconds"] > 0 and r["plain_seconds"] > 0
        # the plain layer measured beside it is the layer sweep's; recomputed, it keeps its output
        # (and the checkpoint's RNG states) only, and peaks at about the plain saved + transient
        assert (r["plain_saved_bytes"], r["plain_transient_bytes"]) == (layers[(st, s)]["saved_bytes"],
                                                                       layers[(st, s)]["transient_bytes"])
        out = s // 2 * SHAPE.hidden * SHAPE.elt
        assert out <= r["saved_bytes"] < out + 64 * 1024 and r["saved_bytes"] < r["plain_saved_bytes"]
        plain_sum = r["plain_saved_bytes"] + r["plain_transient_bytes"]
        assert plain_sum <= r["transient_bytes"] < 1.05 * plain_sum
        got = cm.layer(st + ":rc", s, 1)
        assert r["saved_bytes"] <= got.saved_bytes <= 1.001 * r["saved_bytes"]
        assert r["transient_bytes"] <= got.transient_bytes <= 1.01 * r["transient_bytes"]
        f = float(np.median([a / c - 1 for a, c in zip(r["rc_times"], r["plain_times"])]))
        assert got.seconds / cm.layer(st, s, 1).seconds - 1 == pytest.approx(f, rel=1e-9)


def test_recompute_only_appends_to_an_existing_profile(fitted, capsys):
    """``profile --recompute-only --append``: the phase alone, its rows after a ``section`` row at
    the end of a profile of the same shape, the profile's own lines unchanged."""
    from megatron_paradyse.costmodel.profile import main

    _, _, d = fitted
    lines = (d / "p.jsonl").read_text().splitlines(keepends=True)
    base = "".join(x for x in lines if json.loads(x)["type"] != "recompute")
    (d / "q.jsonl").write_text(base)
    main(["--p", "2", "--seqs", "128", "--strategies", "tp_sp", "--repeats", "1", "--recompute-only",
          "--append", "-o", str(d / "q.jsonl")])
    assert "appended to" in capsys.readouterr().out
    text = (d / "q.jsonl").read_text()
    assert text.startswith(base)
    new = [json.loads(x) for x in text[len(base):].splitlines()]
    assert [r["type"] for r in new] == ["section", "recompute"] and new[0]["phase"] == "recompute"
    assert "--recompute-only" in new[0]["command"] and new[0]["duration_s"] > 0
    meta = fit_profile(str(d / "q.jsonl"), str(d / "q.json"))
    assert set(meta["recompute"]) == {"tp_sp"} and not meta["recompute_complete"]  # one strategy of three
    with pytest.raises(SystemExit):  # before any rank starts
        main(["--p", "2", "--seqs", "128", "--recompute-only", "--append", "-o", str(d / "q.jsonl")])
    assert "recompute rows already" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a profile that is not there: named, and no folder made for it
        main(["--p", "2", "--recompute-only", "--append", "-o", str(d / "none" / "p.jsonl")])
    assert "does not exist" in capsys.readouterr().err and not (d / "none").exists()


def test_a_mixed_plans_training_step_peaks_where_the_model_says(fitted):
    _, cm, _ = fitted
    # the second: ring layers next to each other prefetch across the layer boundary (the pool's
    # second weight slot, parallel/prefetch.py)
    plans = [("metp", "tp_sp", "ring", "tp_sp"), ("ring", "ring", "metp", "ring")]
    measured = measure_steps(SHAPE, plans, [256, 384], repeats=1, timeout=300)
    for e in step_errors(cm, measured):
        assert e["seconds"] > 0 and e["pred_seconds"] > cm.update_seconds()
        # 384 was never profiled: layers interpolated, the pool from its fitted buffers
        assert e["err_peak"] < 5.0, e


def test_bf16_update_on_cpu_is_refused_before_any_rank_starts(capsys):
    import torch

    from megatron_paradyse.costmodel.profile import main

    if torch.cuda.is_available():
        pytest.skip("on CUDA megatron's mixed-precision optimizer runs")
    bf16 = SHAPE.__class__(**dict(SHAPE.key(), dtype="bf16"))
    with pytest.raises(ValueError, match="mixed-precision optimizer, which needs CUDA"):
        run_profile(bf16, CFG, nproc=2, timeout=30)
    with pytest.raises(SystemExit):
        main(["--p", "2", "--bf16", "--seqs", "128", "-o", "unused.jsonl"])
    assert "--no-nonlayer" in capsys.readouterr().err
