"""The benchmark's own logic: oracle, summaries, headline ratios, one small measured world, the simulation; with pipeline stages the per-stage report on synthetic records and a PP = 2 x p = 2 world."""
import math
import os

import numpy as np
import pytest

from megatron_paradyse.bench import report
from megatron_paradyse.units import MiB


def _rec(step, length, seconds, peak, plan="p"):
    return dict(step=step, length=length, padded=length, seconds=seconds, peak_bytes=peak, loss=1.0,
                plan=plan, predicted_seconds=None, predicted_peak_bytes=None)


def test_oracle_summary_headline():
    budget = 10 * MiB
    recs = {
        "tp_sp": [_rec(0, 100, 1.0, 5 * MiB), _rec(1, 900, 3.0, 12 * MiB)],   # fast, one step over
        "metp": [_rec(0, 100, 2.0, 2 * MiB), _rec(1, 900, 4.0, 4 * MiB)],     # slow, always fits
        "paradyse_optimal": [_rec(0, 100, 1.1, 5 * MiB), _rec(1, 900, 4.1, 4 * MiB)],
    }
    orc = report.oracle(recs, budget, ["tp_sp", "metp", "paradyse_optimal"])
    assert [o["source"] for o in orc] == ["tp_sp", "metp"] and [o["seconds"] for o in orc] == [1.0, 4.0]
    recs["oracle"] = orc
    s = report.summarize(recs, budget)
    assert s["tp_sp"]["steps_over_budget"] == 1 and not s["tp_sp"]["all_steps_fit"]
    assert s["tp_sp"]["longest_trained_within_budget"] == 100
    assert s["metp"]["all_steps_fit"] and s["metp"]["total_seconds"] == pytest.approx(6.0)
    h = report.headline(s, {"tp_sp": {"longest_fitting": 512}, "stock": {"longest_fitting": 256},
                            "paradyse_optimal": {"longest_fitting": 2048}})
    assert h["fastest_all_fitting_static"] == "metp"
    assert h["paradyse_optimal_speedup_vs_metp"] == pytest.approx(6.0 / 5.2)
    assert h["paradyse_optimal_vs_oracle"] == pytest.approx(5.2 / 5.0)
    assert h["paradyse_optimal_longest_vs_tp_sp"] == 4.0 and h["paradyse_optimal_longest_vs_stock"] == 8.0
    # a step where nothing fits: the oracle has no time for it and counts it over budget
    recs2 = {"tp_sp": [_rec(0, 100, 1.0, 20 * MiB)]}
    o2 = report.oracle(recs2, budget, ["tp_sp"])
    assert o2[0]["seconds"] is None
    assert report.summarize({"oracle": o2}, budget)["oracle"]["steps_over_budget"] == 1


def test_measured_world_small(tmp_path):
    """2 gloo ranks, a 2-layer model: stock, tp_sp and metp on the same 2 batches, plus a search."""
    from megatron_paradyse import data
    from megatron_paradyse.bench.__main__ import demo_argv
    from megatron_paradyse.bench.config import BenchConfig
    from megatron_paradyse.bench.world import bench_world
    from megatron_paradyse.testing.spawn import run_world

    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "docs")
    data.write_indexed_dataset(prefix, [rng.integers(0, 256, n) for n in (40, 100, 250, 70, 500)], 258)
    argv = demo_argv(2, 256, 1234)
    for k, v in (("--num-layers", "2"), ("--hidden-size", "64"), ("--num-attention-heads", "4"),
                 ("--ffn-hidden-size", "128")):
        argv[argv.index(k) + 1] = v
    cfg = BenchConfig(argv=argv, data_prefix=prefix, long_docs="skip", steps=2, budget_bytes=4 * MiB,
                      systems=["stock", "tp_sp", "metp", "stock+rc", "tp_sp+rc"], search=True, search_cap=1024,
                      search_probes=2,
                      search_resolution=128, verbose=False)
    out = run_world(bench_world, 2, cfg, timeout=240)[0]
    rec = out["records"]
    lens = [r["length"] for r in rec["tp_sp"]]
    assert [r["length"] for r in rec["stock"]] == lens == [r["length"] for r in rec["metp"]]
    assert all(r["plan"] is None for r in rec["stock"]) and all(r["plan"] == "metp*2" for r in rec["metp"])
    by = {n: [r["peak_bytes"] for r in rec[n]] for n in rec}
    # memory order on the longest step: stock (s x s scores) > tp_sp > metp; static bytes counted
    k = int(np.argmax(lens))
    assert by["stock"][k] > by["tp_sp"][k] > by["metp"][k] > out["static_bytes"]["metp"] > 0
    assert all(r["seconds"] > 0 and np.isfinite(r["loss"]) for n in rec for r in rec[n])
    srch = out["search"]
    for n, v in srch.items():
        assert all(p["fits"] == (p["peak_bytes"] <= cfg.budget_bytes) for p in v["probes"])
        if v["longest_fitting"]:
            assert any(p["length"] == v["longest_fitting"] and p["fits"] for p in v["probes"])
    assert srch["metp"]["longest_fitting"] >= srch["tp_sp"]["longest_fitting"] >= srch["stock"]["longest_fitting"]
    # recompute: the same losses, less memory on the longest step, every layer's plan entry :rc
    assert all(r["plan"] == "tp_sp:rc*2" for r in rec["tp_sp+rc"]) and all(r["plan"] is None for r in rec["stock+rc"])
    for a, b in (("stock+rc", "stock"), ("tp_sp+rc", "tp_sp")):
        assert all(abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"]) for x, y in zip(rec[a], rec[b])), (a, b)
        assert by[a][k] < by[b][k], (a, by[a][k], b, by[b][k])
    assert out["systems"][3]["config"]["recompute_granularity"] == "full"


def test_packed_systems_train_the_same_documents(tmp_path):
    """``<system>+pack``: the same documents in fewer steps (packs up to the token cap), every
    system's tokens equal; the packed planner plans each pack; the summary keeps its keys."""
    from megatron_paradyse import data
    from megatron_paradyse.bench import report
    from megatron_paradyse.bench.__main__ import demo_argv
    from megatron_paradyse.bench.config import BenchConfig
    from megatron_paradyse.bench.world import bench_world
    from megatron_paradyse.testing.spawn import run_world

    rng = np.random.default_rng(1)
    prefix = str(tmp_path / "docs")
    data.write_indexed_dataset(prefix, [rng.integers(0, 256, n) for n in (40, 100, 25, 70, 30, 61)], 258)
    argv = demo_argv(2, 256, 1234)
    for k, v in (("--num-layers", "2"), ("--hidden-size", "64"), ("--num-attention-heads", "4"),
                 ("--ffn-hidden-size", "128")):
        argv[argv.index(k) + 1] = v
    systems = ["tp_sp", "tp_sp+pack", "ring+pack", "paradyse_optimal", "paradyse_optimal+pack"]
    cfg = BenchConfig(argv=argv, data_prefix=prefix, long_docs="skip", steps=6, budget_bytes=64 * MiB,
                      systems=systems, verbose=False, pack_tokens=256)
    out = run_world(bench_world, 2, cfg, timeout=240)[0]
    rec = out["records"]
    summary = report.summarize(rec, cfg.budget_bytes)
    assert {summary[n]["tokens"] for n in systems} == {sum(r["length"] for r in rec["tp_sp"])}
    assert len(rec["tp_sp"]) == 6 and all(len(rec[n]) < 6 for n in systems if n.endswith("+pack"))
    assert all(r["documents"] > 1 for r in rec["tp_sp+pack"][:1])
    assert all(r["plan"] == "ring*2" for r in rec["ring+pack"])
    assert all(r["plan"] is not None and r["planner_fits"] for r in rec["paradyse_optimal+pack"])
    assert all(np.isfinite(r["loss"]) and r["seconds"] > 0 for n in systems for r in rec[n])
    for n in systems:
        assert {"tokens", "total_seconds", "steps", "steps_over_budget", "all_steps_fit"} <= set(summary[n])
    head = report.headline(summary, None)
    assert "paradyse_optimal+pack_tokens_per_s_vs_paradyse_optimal" in head


def _assert_one_rule(r, cm, limit):
    """The simulation ``r`` judged every system by one rule (``CostModel.step`` on its per-layer
    plan at most ``limit``) and its planners are never shorter than the leanest static system:
    they train every sequence any static system (plain, +rc or +rc-mlp) trains, and their longest trained
    and trainable lengths are >= every static system's."""
    from megatron_paradyse.bench.simulate import lengths_distribution, static_systems

    sysm, statics = r["systems"], r["static_systems"]
    assert r["limit_bytes"] == pytest.approx(limit) and r["budget_bytes"] - r["margin_bytes"] == r["limit_bytes"]
    plans = static_systems(cm)
    assert statics == list(plans) and set(statics) == {n + rc for n in cm.strategies for rc in ("", "+rc", "+rc-mlp")}
    lens = lengths_distribution(r["distribution"]["n"])
    fit_any = [False] * len(lens)
    for st in statics:  # the static systems skip exactly what peaks above the limit
        skipped = set(sysm[st]["skipped_sequences"])
        for k, s in enumerate(lens):
            ok = cm.step(plans[st], s, 1).peak_bytes <= limit
            assert ok == (k not in skipped), (st, s)
            fit_any[k] |= ok
        assert sysm[st]["oom_steps"] == len(skipped) and sysm[st]["sequences_trained"] == len(lens) - len(skipped)
    para = [n for n in sysm if n.startswith("paradyse")]
    assert len(para) == 2
    for pn in para:
        skipped = set(sysm[pn]["skipped_sequences"])
        assert not any(fit_any[k] for k in skipped), pn  # trains what any static system trains
        for st in statics:
            assert sysm[pn]["longest_trainable"] >= sysm[st]["longest_trainable"], (pn, st)
            assert sysm[pn]["longest_trained"] >= sysm[st]["longest_trained"], (pn, st)
            assert sysm[pn]["tokens_trained"] >= sysm[st]["tokens_trained"], (pn, st)
    # the optimal planner is never slower than a static plan that fits (one of its candidates)
    for st in statics:
        k = f"paradyse_optimal_time_reduction_vs_{st}_on_steps_both_fit"
        assert k not in r["headline"] or r["headline"][k] >= -1e-9, k
    return para


def test_simulation(tmp_path):
    import json

    from megatron_paradyse.bench.simulate import H100Roofline, datasheet_rates, simulate, summary
    from megatron_paradyse.costmodel import analytic
    from megatron_paradyse.costmodel.fit import RATE_FEATURES

    cm = H100Roofline()
    big = 256 * 1024
    # the time is the fitted cost model's time model with datasheet rates (a GPU fit calibrates them)
    rates = datasheet_rates(cm.hw)
    assert set(rates) == set(RATE_FEATURES) and rates["gemm_flops"] == 1 / (989e12 * 0.55)
    for n in cm.strategies:
        f = analytic.time_features(n, cm.shape, big, 1)
        assert math.isclose(cm.layer(n, big, 1).seconds, sum(rates[k] * f[k] for k in RATE_FEATURES), rel_tol=1e-12)
    peaks = {n: cm.step({n: cm.num_layers}, big, 1).peak_bytes for n in cm.strategies}
    assert peaks["metp"] < peaks["ring"] < peaks["tp_sp"] < peaks["colossal"]
    # recomputed layers priced: the plain layer plus its forward again (the roofline's split: a
    # third of fwd+bwd, a fourth for metp), one [s/p, b, h] bf16 tensor kept, the plain layer's
    # saved + transient as transient, the strategy's pool
    assert cm.recomputes()
    for n in cm.strategies:
        plain, rc = cm.layer(n, big, 1), cm.layer(n + ":rc", big, 1)
        share = 0.25 if n == "metp" else 1 / 3  # the forward's share of forward + backward
        assert math.isclose(rc.seconds, plain.seconds * (1 + share), rel_tol=1e-12)
        assert rc.saved_bytes == big * cm.m.hidden * 2 / cm.m.p < plain.saved_bytes
        assert rc.transient_bytes == plain.saved_bytes + plain.transient_bytes
        assert cm.pool(n + ":rc", big, 1) == cm.pool(n, big, 1)
        assert cm.step({n + ":rc": cm.num_layers}, big, 1).peak_bytes < peaks[n]

    r = simulate(str(tmp_path))  # no margin: every system judged at 80 GB
    lines = summary(r).splitlines()
    assert "SIMULATION" in r["label"] and any("SIMULATION" in x for x in lines)
    assert any("one rule for every system" in x for x in lines)
    assert json.load(open(tmp_path / "simulation.json"))["systems"] == r["systems"]
    assert r["distribution"]["max"] >= 624 * 1000 and r["margin_bytes"] == 0
    para = _assert_one_rule(r, cm, r["budget_bytes"])
    sysm, ref = r["systems"], r["references"]
    # recompute on both sides: the longest sequence is trained by every planner and by +rc statics
    assert ref["leanest_static"].endswith("+rc") and ref["fastest_static_training_every_sequence"]
    for pn in para:
        assert sysm[pn]["oom_steps"] == 0 and any(":rc" in k for k in sysm[pn]["plans"])
    # the published run (results/benchmark/default/simulation.json) is this one
    shipped = os.path.join(os.path.dirname(__file__), "..", "results", "benchmark", "default", "simulation.json")
    pub = json.load(open(shipped))
    assert {n: (s["tokens_trained"], s["skipped_sequences"], s["longest_trainable"]) for n, s in pub["systems"].items()} \
        == {n: (s["tokens_trained"], s["skipped_sequences"], s["longest_trainable"]) for n, s in sysm.items()}
    # one margin for every system: 10% of the budget judges the static plans as it limits the planners
    (tmp_path / "m").mkdir()
    r10 = simulate(str(tmp_path / "m"), margin_fraction=0.10, n=150)
    _assert_one_rule(r10, cm, 0.9 * r10["budget_bytes"])
    assert r10["systems"]["metp"]["longest_trainable"] < sysm["metp"]["longest_trainable"]


def _staged(step, seconds, stages, pred=None, lengths=(100, 50)):
    """A pipelined step's record (two micro-batches) as ``world._staged_record`` writes it."""
    return dict(step=step, length=sum(lengths), padded=sum(lengths), documents=len(lengths), lengths=list(lengths),
                order=list(range(len(lengths))), seconds=seconds, peak_bytes=max(stages),
                stage_peak_bytes=list(stages), loss=1.0, plan="p", predicted_seconds=None,
                predicted_peak_bytes=None if pred is None else max(pred), predicted_stage_peak_bytes=pred)


def test_pipeline_report_on_synthetic_records():
    """Per-stage steps over budget, the stage peak errors, the oracle judged on every stage, the
    planner's ratio to the fastest static system whose steps all fit, the table."""
    budget = 10 * MiB
    recs = {
        "tp_sp": [_staged(0, 1.0, [5 * MiB, 4 * MiB], [5.5 * MiB, 4 * MiB]),
                  _staged(1, 2.0, [12 * MiB, 8 * MiB], [12 * MiB, 8.4 * MiB], (900, 10))],   # stage 0 over
        "metp+rc": [_staged(0, 2.0, [3 * MiB, 3 * MiB]), _staged(1, 4.0, [6 * MiB, 9 * MiB], None, (900, 10))],
        "paradyse_optimal": [_staged(0, 1.1, [5 * MiB, 4 * MiB], [5 * MiB, 4.2 * MiB]),
                             _staged(1, 2.9, [9 * MiB, 11 * MiB], [9 * MiB, 9.9 * MiB], (900, 10))],  # stage 1 over
    }
    orc = report.pipeline_oracle(recs, budget, ["tp_sp", "metp+rc", "paradyse_optimal"])
    assert [o["source"] for o in orc] == ["tp_sp", "metp+rc"]  # step 1: only metp+rc fits on both stages
    assert orc[1]["stage_peak_bytes"] == [6 * MiB, 9 * MiB] and orc[1]["lengths"] == [900, 10]
    recs["oracle"] = orc
    summary = report.summarize(recs, budget)
    stages = report.stage_summary(recs, budget, 2)
    assert stages["tp_sp"]["steps_over_budget_per_stage"] == [1, 0]
    assert stages["paradyse_optimal"]["steps_over_budget_per_stage"] == [0, 1]
    assert stages["tp_sp"]["longest_document_within_budget"] == 100
    assert stages["metp+rc"]["longest_document_within_budget"] == 900
    e = stages["tp_sp"]["stage_peak_error"]
    assert e[0]["median"] == pytest.approx(0.05) and e[0]["worst_signed"] == pytest.approx(0.1)
    assert e[1]["worst_signed"] == pytest.approx(0.05) and stages["metp+rc"]["peak_error"] is None
    assert stages["paradyse_optimal"]["peak_error"]["worst_signed"] == pytest.approx(-0.1)
    h = report.pipeline_headline(summary, stages)
    assert h["fastest_all_fitting_static"] == "metp+rc"
    assert h["paradyse_optimal_speedup_vs_metp+rc"] == pytest.approx(6.0 / 4.0)
    assert h["paradyse_optimal_vs_oracle"] == pytest.approx(4.0 / 5.0)
    assert h["paradyse_optimal_steps_over_budget_per_stage"] == [0, 1] and not h["paradyse_optimal_all_steps_fit"]
    table = report.pipeline_table(summary, stages, budget).splitlines()
    assert "over s0/s1" in table[0] and any(x.startswith("tp_sp ") and " 1/0 " in x for x in table)


def test_pipeline_world_small(tmp_path):
    """PP = 2 x p = 2 (4 gloo ranks), a 2-layer model: stock, a static plan and the optimal
    step planner train the same 2 steps of 2 micro-batches to the same losses; per-stage peaks
    measured; static and planner systems have per-stage predictions, stock none."""
    from megatron_paradyse import data
    from megatron_paradyse.bench.__main__ import demo_argv, pipeline_argv
    from megatron_paradyse.bench.config import BenchConfig
    from megatron_paradyse.bench.world import bench_world
    from megatron_paradyse.testing.spawn import run_world

    rng = np.random.default_rng(2)
    prefix = str(tmp_path / "docs")
    data.write_indexed_dataset(prefix, [rng.integers(0, 256, n) for n in (40, 200, 90, 250, 30)], 258)
    argv = demo_argv(2, 256, 1234, pipeline_argv(2, 2))
    for k, v in (("--num-layers", "2"), ("--hidden-size", "64"), ("--num-attention-heads", "4"),
                 ("--ffn-hidden-size", "128")):
        argv[argv.index(k) + 1] = v
    systems = ["stock", "tp_sp", "metp+rc", "paradyse_optimal"]
    cfg = BenchConfig(argv=argv, data_prefix=prefix, steps=2, budget_bytes=64 * MiB, systems=systems,
                      verbose=False, pp=2, pp_microbatches=2)
    out = run_world(bench_world, 4, cfg, timeout=240)[0]
    rec = out["records"]
    steps = {tuple(tuple(r["lengths"]) for r in rec[n]) for n in systems}
    assert len(steps) == 1 and sorted(x for s in steps.pop() for x in s) == [29, 39, 199, 249]
    for n in systems:
        assert all(len(r["stage_peak_bytes"]) == 2 and r["peak_bytes"] == max(r["stage_peak_bytes"])
                   and min(r["stage_peak_bytes"]) > max(out["stage_static_bytes"][n]) / 2 for r in rec[n])
    # same weights, same documents: the same losses whatever the plans and the run order
    for n in systems[1:]:
        assert all(abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"]) for x, y in zip(rec[n], rec["stock"])), n
    assert all(r["plan"] is None and r["predicted_stage_peak_bytes"] is None for r in rec["stock"])
    assert all(r["plan"] == "tp_sp*2; tp_sp*2" and len(r["predicted_stage_peak_bytes"]) == 2 for r in rec["tp_sp"])
    assert all(r["plan_layers"] == [["metp:rc"] * 2] * 2 for r in rec["metp+rc"])
    assert all(r["planner_fits"] and len(r["predicted_stage_peak_bytes"]) == 2 for r in rec["paradyse_optimal"])
    stages = report.stage_summary(rec, cfg.budget_bytes, 2)
    assert stages["tp_sp"]["peak_error"]["n"] == 4 and stages["stock"]["peak_error"] is None


def test_pipeline_with_cp_config():
    """``--pp 2 --cp 2``: the layout named in the log and bench.json, the configuration accepted
    (the trainers' layout check), the CP systems that run with stages by default (no world:
    the run itself is results/benchmark/pipeline_cp)."""
    import argparse

    from megatron_paradyse.bench.__main__ import default_systems, demo_argv, layout_name, pipeline_argv
    from megatron_paradyse.bench.config import ALL_SYSTEMS, CP_SYSTEMS, PIPELINE_SYSTEMS, BenchConfig

    a = argparse.Namespace(pp=2, cp=2, p=2)
    assert layout_name(a) == "PP=2 x CP=2 x p=2" and layout_name(argparse.Namespace(pp=1, cp=1, p=4)) == "p=4"
    argv = demo_argv(2, 4096, 1234, pipeline_argv(2, 4, 2))
    assert argv[argv.index("--context-parallel-size") + 1] == "2" and "--pipeline-model-parallel-size" in argv
    systems = default_systems(a)
    assert "colossal+rc" not in systems and "paradyse_optimal" in systems and "stock" not in systems
    assert all(s in CP_SYSTEMS and s in PIPELINE_SYSTEMS for s in systems)
    for pp, cp, want in ((1, 1, ALL_SYSTEMS), (2, 1, PIPELINE_SYSTEMS), (1, 2, CP_SYSTEMS)):
        assert default_systems(argparse.Namespace(pp=pp, cp=cp, p=2)) == want
    cfg = BenchConfig(argv=argv, data_prefix="x", steps=1, budget_bytes=1.0, systems=systems, pp=2, cp=2)
    assert cfg.dims.pp_on and cfg.dims.cp_on
    with pytest.raises(ValueError, match="cannot run"):
        BenchConfig(argv=argv, data_prefix="x", steps=1, budget_bytes=1.0, systems=["stock"], pp=2, cp=2)


def test_dynamic_cp_world_small(tmp_path):
    """``--dynamic-cp-pool 2`` x p = 2 (4 gloo ranks), a 2-layer model, one step of 4 documents
    (one of 900 tokens, which fits a plan at c = 2 only under the budget): ParaDySe x Dynamic CP
    runs it at c = 1 and 2 within its predicted budget, ParaDySe at C = 1 refuses it, a static
    strategy at C = 2 and megatron's policy run it; every system the same documents, each with
    its predicted and measured time and peak; the aims, the table; a bad system name refused."""
    from megatron_paradyse import data
    from megatron_paradyse.bench import dynamic_cp as dcp
    from megatron_paradyse.bench.__main__ import demo_argv
    from megatron_paradyse.bench.config import BenchConfig
    from megatron_paradyse.testing.spawn import run_world

    rng = np.random.default_rng(3)
    prefix = str(tmp_path / "docs")
    data.write_indexed_dataset(prefix, [rng.integers(0, 256, n) for n in (41, 901, 121, 61)], 258)
    argv = demo_argv(2, 1024, 1234, ["--dynamic-context-parallel", "--global-batch-size", "4"])
    for k, v in (("--num-layers", "2"), ("--hidden-size", "64"), ("--num-attention-heads", "4"),
                 ("--ffn-hidden-size", "128")):
        argv[argv.index(k) + 1] = v
    systems = ["paradyse_dcp", "paradyse_cp1", "megatron_dcp+rc", "tp_sp_cp2"]
    assert set(systems) <= set(dcp.system_names(2)) and len(dcp.system_names(4)) == 1 + 3 + 2 + 8 * 3
    with pytest.raises(ValueError, match="unknown"):
        dcp.check_systems(["tp_sp_cp8"], 2)
    budget = 3 * MiB
    cfg = BenchConfig(argv=argv, data_prefix=prefix, steps=1, budget_bytes=budget, systems=systems,
                      verbose=False, dcp_pool=2, global_batch=4)
    out = run_world(dcp.dcp_world, 4, cfg, timeout=240)[0]
    rec = {n: out["records"][n][0] for n in systems}
    assert {r["length"] for r in rec.values()} == {40 + 900 + 120 + 60}
    assert rec["paradyse_cp1"]["seconds"] is None and "CP size 1" in rec["paradyse_cp1"]["refused"]
    ran = [n for n in systems if n != "paradyse_cp1"]
    for n in ran:
        r = rec[n]
        assert r["seconds"] > 0 and r["peak_bytes"] > out["static_bytes"][n] > 0 and r["predicted_seconds"] > 0
        assert sorted(d for rnd in r["rounds"] for _, _, docs in rnd for d in docs) == [0, 1, 2, 3]
    assert rec["paradyse_dcp"]["sizes"].get("2") and rec["paradyse_dcp"]["predicted_peak_bytes"] <= budget
    assert rec["tp_sp_cp2"]["plan"] == "tp_sp*2" and set(rec["tp_sp_cp2"]["sizes"]) == {"2"}
    assert rec["megatron_dcp+rc"]["plan"] == "tp_sp:rc*2"
    records = out["records"]
    records["oracle"] = report.oracle(records, budget, systems)
    summary = report.summarize(records, budget)
    h = dcp.aims(summary)
    assert h["steps_refused"] == 0 and h["best_fixed_c"] is None and h["steps_over_budget"] is not None
    lines = dcp.table(summary, records, budget).splitlines()
    assert any(x.startswith("paradyse_cp1 ") and x.split()[1:5] == ["-", "0.0", "0", "1"] for x in lines), lines
    assert len(dcp.aim_lines(h)) == 6


def test_interleaved_pipeline_config(tmp_path):
    """``--pp 2 --vpp 2``: megatron's interleaved schedule's flag in the ranks' argv, the layout
    named, the step planners given V chunks; refused in one line without stages or with a
    step that is not a multiple of PP micro-batches (the trainer's check)."""
    import argparse

    from megatron_paradyse.bench.__main__ import demo_argv, layout_name, main, pipeline_argv
    from megatron_paradyse.bench.config import BenchConfig
    from megatron_paradyse.bench.systems import build_systems
    from megatron_paradyse.training.arguments import parse_args

    assert layout_name(argparse.Namespace(pp=2, vpp=2, cp=1, p=2)) == "PP=2 x V=2 x p=2"
    argv = demo_argv(2, 1024, 1234, pipeline_argv(2, 4, 1, 2))
    assert argv[argv.index("--virtual-pipeline-model-parallel-size") + 1] == "2"
    assert "--virtual-pipeline-model-parallel-size" not in pipeline_argv(2, 4)
    cfg = BenchConfig(argv=argv, data_prefix="x", steps=1, budget_bytes=64 * MiB,
                      systems=["tp_sp", "paradyse_optimal"], pp=2, pp_microbatches=4, vpp=2)
    assert cfg.dims.vpp == 2 and cfg.dims.pp_on
    specs, _ = build_systems(cfg, parse_args(list(argv), world_size=4))
    assert [s.pipeline.num_chunks for s in specs] == [2, 2]
    plan = specs[1].step_plan([(512, 1)] * 4)
    assert plan["fits"] and len(plan["plans"][0]) == 4
    for bad in (["--vpp", "2"], ["--pp", "2", "--vpp", "2", "--pp-microbatches", "3"]):
        with pytest.raises(SystemExit) as e:
            main(bad + ["--p", "2", "--steps", "1", "--memory-budget-mib", "30", "--out", str(tmp_path)])
        assert e.value.code == 2


@pytest.mark.slow(reason="4 ranks; the interleaved bench run (results/benchmark/pipeline_interleaved) "
                         "and test_interleaved_pipeline_config cover it")
def test_interleaved_pipeline_world_small(tmp_path):
    """PP = 2 x V = 2 x p = 2 (4 gloo ranks), 4 layers (one per model chunk): stock, a static
    plan and the optimal step planner (the interleaved in-flight model) train the same 2
    steps of 2 micro-batches to stock's losses; per-stage peaks measured and predicted."""
    from megatron_paradyse import data
    from megatron_paradyse.bench.__main__ import demo_argv, pipeline_argv
    from megatron_paradyse.bench.config import BenchConfig
    from megatron_paradyse.bench.world import bench_world
    from megatron_paradyse.testing.spawn import run_world

    rng = np.random.default_rng(2)
    prefix = str(tmp_path / "docs")
    data.write_indexed_dataset(prefix, [rng.integers(0, 256, n) for n in (40, 200, 90, 250, 30)], 258)
    argv = demo_argv(2, 256, 1234, pipeline_argv(2, 2, 1, 2))
    for k, v in (("--hidden-size", "64"), ("--num-attention-heads", "4"), ("--ffn-hidden-size", "128")):
        argv[argv.index(k) + 1] = v
    systems = ["stock", "tp_sp", "paradyse_optimal"]
    cfg = BenchConfig(argv=argv, data_prefix=prefix, steps=2, budget_bytes=64 * MiB, systems=systems,
                      verbose=False, pp=2, pp_microbatches=2, vpp=2)
    out = run_world(bench_world, 4, cfg, timeout=240)[0]
    rec = out["records"]
    for n in systems[1:]:
        assert all(abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"]) for x, y in zip(rec[n], rec["stock"])), n
        assert all(len(r["predicted_stage_peak_bytes"]) == 2 and len(r["stage_peak_bytes"]) == 2 for r in rec[n])
    assert all(r["planner_fits"] for r in rec["paradyse_optimal"])
