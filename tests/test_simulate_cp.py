"""Context parallelism across nodes: the cost model (``costmodel/cp.py``) and its simulation
(``bench/simulate_cp.py``) on a small configuration (7B, 16 and 32 GPUs, 64 documents; about
ten seconds, half of it the Dynamic CP planner)."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_paradyse.bench.simulate import H100Roofline, Hardware, Model7B
from megatron_paradyse.bench.simulate import lengths_distribution
from megatron_paradyse.bench.simulate_cp import (NAMES, STATIC, DocumentPacks, Pricer, Setup, base_model, dcp_planners,
                                                 dynamic_jobs, links_for, main, pack, pack_priced, planner_dcp_step,
                                                 schedule, simulate_cp, static_jobs, summary)
from megatron_paradyse.costmodel import analytic, build_cost_model, demo_shape
from megatron_paradyse.costmodel.cp import CPCostModel, Links
from megatron_paradyse.parallel.packing import PackShape
from megatron_paradyse.planner.core import NoFitError
from megatron_paradyse.planner.dynamic_cp import plan_dynamic_cp

LINKS = Links(315e9, 0.0, 45e9, 1e-5)
ENTRIES = ("tp_sp", "ulysses", "ring", "colossal", "metp", "tp_sp:rc", "ulysses:rc", "metp:rc")
SMALL = Setup(gpus=(16, 32), models=("7b",), docs=64, docs_per_node=2, max_len=1 << 21)


@pytest.fixture(scope="module")
def roofline():
    return H100Roofline(Hardware(), Model7B())


@pytest.fixture(scope="module")
def result():
    return simulate_cp(SMALL)


@pytest.mark.parametrize("which", ["roofline", "fitted"])
def test_cp1_is_the_base_exactly(which, roofline):
    base = roofline if which == "roofline" else build_cost_model(demo_shape(4))
    cm = CPCostModel(base, 1, LINKS)
    s = 8192 if which == "roofline" else 1024
    for e in ENTRIES if which == "roofline" else ("tp_sp", "ulysses:rc", "ring", "metp:rc"):
        assert cm.layer(e, s, 1) == base.layer(e, s, 1), e
        assert cm.pool(e, s, 1) == base.pool(e, s, 1)
    plan = ("tp_sp", "ulysses:rc") * (base.num_layers // 2)
    assert cm.step(plan, s, 1) == base.step(plan, s, 1)
    assert cm.nonlayer(s, 1) == base.nonlayer(s, 1) and cm.resident_bytes(s, 1) == base.resident_bytes(s, 1)
    assert (cm.static_bytes(), cm.update_seconds(), cm.recomputes(), cm.device_kind(), cm.strategies) == \
        (base.static_bytes(), base.update_seconds(), base.recomputes(), base.device_kind(), tuple(base.strategies))


def test_the_layer_is_the_local_layer_plus_attention_plus_the_ring(roofline):
    """Per rank at C: the base at s/C, (C-1) times its attention (the datasheet attention
    rate on the analytic attention FLOPs, for the roofline), the ring's time x (1 - overlap)."""
    s, C, L = 1 << 18, 4, 1 << 16
    for overlap in (0.0, 0.5):
        cm = CPCostModel(roofline, C, LINKS, overlap=overlap)
        for e in ("tp_sp", "ring", "tp_sp:rc"):
            att = cm.attention_seconds(e, L, 1)
            plain = e.split(":")[0]
            ref = roofline.rates["attn_flops"] * analytic.flops_parts(plain, roofline.shape, L, 1)[1] \
                * (4 / 3 if e.endswith(":rc") else 1)
            assert att == pytest.approx(ref, rel=1e-9)
            want = roofline.layer(e, L, 1).seconds + (C - 1) * att + (1 - overlap) * cm.ring_seconds(e, s, 1)
            assert cm.layer(e, s, 1).seconds == pytest.approx(want, rel=1e-12)


def test_the_ring_grows_with_c_minus_1_on_the_inter_node_link(roofline):
    """At a fixed local length the tp_sp ring's time is linear in C (C-1 K/V hops per pass, C
    dK/dV hops) and scales with the inter-node link alone; the ring family's flat ring is
    bounded by the inter-node link too (its in-node ring, already in the base, taken off)."""
    L = 1 << 16
    kv = L / 8 * 2 * 4096 * 2  # s/(C p) tokens x K and V x 32 heads x 128 x bf16
    r = {C: CPCostModel(roofline, C, LINKS).ring_seconds("tp_sp", C * L, 1) for C in (2, 3, 4)}
    for C, x in r.items():
        assert x == pytest.approx(2 * (C - 1) * LINKS.hop(kv, True) + C * LINKS.hop(2 * kv, True))
    assert r[3] - r[2] == pytest.approx(r[4] - r[3], rel=1e-9) and r[4] - r[3] > 0
    fast_inter = dataclasses.replace(LINKS, inter_bandwidth=1e30, inter_alpha=0.0)
    slow_intra = dataclasses.replace(LINKS, intra_bandwidth=1e3)
    cm, fast = CPCostModel(roofline, 4, LINKS, ring="flat"), CPCostModel(roofline, 4, fast_inter)
    assert fast.ring_seconds("tp_sp", 4 * L, 1) == pytest.approx(0.0, abs=1e-12)
    ulysses = cm.ring_seconds("ulysses", 4 * L, 1)
    assert CPCostModel(roofline, 4, slow_intra).ring_seconds("ulysses", 4 * L, 1) == ulysses  # no in-node hop
    half = CPCostModel(roofline, 4, dataclasses.replace(LINKS, inter_bandwidth=LINKS.inter_bandwidth / 2,
                                                        inter_alpha=0))
    nolat = CPCostModel(roofline, 4, dataclasses.replace(LINKS, inter_alpha=0))
    assert half.ring_seconds("tp_sp", 4 * L, 1) == pytest.approx(2 * nolat.ring_seconds("tp_sp", 4 * L, 1))
    # ring family, flat: C*p - 1 hops on the inter-node link per pass, the base's in-node ring taken off
    kv = cm.block_bytes("ring", 4 * L, 1)
    flat = 2 * 31 * LINKS.hop(kv, True) + 32 * LINKS.hop(2 * kv, True)
    inner = 2 * 7 * LINKS.hop(kv, False) + 8 * LINKS.hop(2 * kv, False)
    assert cm.ring_seconds("ring", 4 * L, 1) == pytest.approx(flat - inner)
    assert cm.ring_seconds("ring", 4 * L, 1) > 8 * cm.ring_seconds("tp_sp", 4 * L, 1)
    # the two-level form: C - 1 inter-node hops per pass, C in-node rings (the base's one taken off)
    two = CPCostModel(roofline, 4, LINKS)  # the default, the plugin's ring
    outer = 2 * 3 * LINKS.hop(kv, True) + 4 * LINKS.hop(2 * kv, True)
    assert two.ring_seconds("ring", 4 * L, 1) == pytest.approx(outer + 3 * inner)
    assert two.ring_seconds("ring", 4 * L, 1) < cm.ring_seconds("ring", 4 * L, 1)
    assert two.layer("ring", 4 * L, 1).transient_bytes > cm.layer("ring", 4 * L, 1).transient_bytes  # outer blocks
    assert two.layer("tp_sp", 4 * L, 1) == cm.layer("tp_sp", 4 * L, 1)
    with pytest.raises(ValueError, match="ring must be"):
        CPCostModel(roofline, 2, LINKS, ring="torus")


def test_memory_per_rank_falls_about_1_over_c(roofline):
    """Activation memory (peak - static) x C stays within 25% of C = 1's, for plain and
    recomputed plans; static memory does not change with C."""
    s, st = 1 << 18, roofline.static_bytes()
    for e in ("tp_sp", "ulysses", "ring", "metp", "tp_sp:rc"):
        one = CPCostModel(roofline, 1, LINKS).step((e,) * 32, s, 1).peak_bytes - st
        for C in (2, 4, 8):
            cm = CPCostModel(roofline, C, LINKS)
            assert cm.static_bytes() == st
            ratio = (cm.step((e,) * 32, s, 1).peak_bytes - st) * C / one
            assert 1.0 <= ratio < 1.25, (e, C, ratio)
    cm = CPCostModel(roofline, 4, LINKS)
    assert cm.layer("tp_sp", s, 1).saved_bytes == roofline.layer("tp_sp", s // 4, 1).saved_bytes
    assert cm.layer("tp_sp", s, 1).transient_bytes > roofline.layer("tp_sp", s // 4, 1).transient_bytes  # ring blocks


def test_what_cp_refuses(roofline):
    cm = CPCostModel(roofline, 4, LINKS)
    with pytest.raises(ValueError, match="b must be 1"):   # packs are priced (tests/test_planner_dcp.py), one row
        cm.layer("tp_sp", PackShape((1024, 1024)), 2)
    # a length the 2*cp*p = 64 chunks do not split is priced at its padded length, as the data pads it
    assert cm.layer("tp_sp", 64 * 100 + 8, 1) == cm.layer("tp_sp", 64 * 101, 1)
    with pytest.raises(ValueError, match="length >= 1"):
        cm.layer("tp_sp", 0, 1)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="cp must be"):
            CPCostModel(roofline, bad, LINKS)
    with pytest.raises(ValueError, match="overlap"):
        CPCostModel(roofline, 2, LINKS, overlap=1.5)
    assert Links.from_config("cpu_gloo", "cpu_gloo").inter_bandwidth == 1e9
    assert Links.from_config().inter_name == "ib_ndr"
    with pytest.raises(ValueError, match="unknown interconnect"):
        Links.from_config("nvlink9")


def test_a_small_simulation_yields_the_tables_fields(result):
    m = result["models"]["7b"]
    assert [r["gpus"] for r in m["sizes"]] == [16, 32]
    for r in m["sizes"]:
        assert r["cp_sizes"] == [1 << i for i in range(r["nodes"].bit_length())]
        for sys in STATIC:
            assert set(r["static"][sys]) == set(r["cp_sizes"]) and r["best_c"][sys] in r["cp_sizes"]
            for row in list(r["static"][sys].values()):
                assert row["steps"] == r["steps"] == 64 // r["batch_documents"]
                assert {"steps_trained", "tokens_trained", "tokens_per_s", "longest_trainable", "idle"} <= set(row)
                assert row["steps_trained"] == sum(x is not None for x in row["per_step"])
        # the planner's candidates hold tp_sp and tp_sp:rc: at one C it trains what they train, no slower
        for c in r["cp_sizes"]:
            mine = r["static"]["paradyse"][c]
            for stock in ("tp_sp", "tp_sp+rc"):
                theirs = r["static"][stock][c]
                assert mine["longest_trainable"] >= theirs["longest_trainable"]
                for a, b in zip(mine["per_step"], theirs["per_step"]):
                    assert b is None or (a is not None and a <= b * (1 + 1e-9))
    out = summary(result)
    for name in NAMES.values():
        assert f"| {name} |" in out
    assert "plan_dynamic_cp" in out and "SIMULATION" in out and "aim 4x" in out and "Dynamic CP against" in out


def test_the_longest_trainable_aim_is_consistent(result):
    """The aim compares ParaDySe x CP's longest at the largest C with ParaDySe's on one node
    (C = 1, DP = 1, 18 bytes of state per parameter); both are the pricers' longest, which
    fits while 1K more does not."""
    m = result["models"]["7b"]
    hw = Hardware()
    base, budget = base_model("7b", hw, 1, True)
    assert base.static_bytes() == H100Roofline(hw, Model7B()).static_bytes()  # 18 bytes at DP x CP = 1
    one = Pricer(CPCostModel(base, 1, LINKS), "paradyse", budget, 4 * SMALL.max_len)
    assert m["one_node_longest"] == one.longest > 0
    assert one(one.longest) is not None and one(one.longest + 1024) is None
    for r in m["sizes"]:
        a = m["aims"][r["gpus"]]
        top = r["static"]["paradyse"][r["cp_sizes"][-1]]["longest_trainable"]
        assert a["longest"] == top and a["longest_ratio"] == pytest.approx(top / one.longest)
        assert a["longest_met"] == (top >= 4 * one.longest)
        mb = r["megatron_best"]
        assert a["tokens_per_s_met"] == (a["tokens_per_s"] > r["static"][mb["system"]][mb["cp"]]["tokens_per_s"])
    assert m["aims"][32]["longest_met"]            # 4 nodes: C = 4 reaches 4x
    assert not m["aims"][16]["longest_met"]        # 2 nodes cannot


def test_scheduling_and_dynamic_cp(roofline):
    """Aligned blocks, longest first; Dynamic-CP-style takes each document's smallest C that
    fits, and widening never lengthens a step."""
    assert schedule([(1, 3.0), (1, 2.0), (1, 2.0)], 2) == 4.0
    assert schedule([(2, 1.0), (1, 5.0)], 2) == 6.0
    assert schedule([(1, 1.0), (1, 1.0), (2, 1.0)], 4) == 1.0
    base, budget = base_model("7b", Hardware(), 4, True)
    pr = {c: Pricer(CPCostModel(base, c, LINKS), "tp_sp", budget, c * (1 << 22)) for c in (1, 2, 4)}
    docs = [8192, 4096, pr[1].longest + 1024, 2048]
    fit = dynamic_jobs(pr, 4, "fit")(docs)
    assert sorted(j[0] for j in fit) == [1, 1, 1, 2]                # grouped by C (then packed)
    wide = dynamic_jobs(pr, 4, "widen")(docs)
    assert schedule([j[:2] for j in wide], 4) <= schedule([j[:2] for j in fit], 4)
    long = pr[1].longest + 1024
    eff = dynamic_jobs(pr, 4, "efficient")([long])[0]
    node_seconds = {c: c * p(p.pad(long))[0] for c, p in pr.items() if p(p.pad(long)) is not None}
    assert len(node_seconds) == 2 and eff[0] >= min(node_seconds, key=node_seconds.get)  # then widened alone
    assert dynamic_jobs(pr, 4)([pr[4].longest + 1024]) is None
    assert static_jobs(pr[2])(docs) is not None and static_jobs(pr[1])(docs) is None


def test_command_line(capsys, tmp_path):
    out = tmp_path / "r.json"
    assert main(["--gpus", "16", "--models", "7b", "--docs", "16", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| ParaDySe x CP |" in text and out.exists()
    for bad in (["--gpus", "24"], ["--models", "13b"], ["--docs", "1", "--gpus", "64"], ["--overlap", "2"],
                ["--cp-ring", "torus"]):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2


def test_packing_and_paradyse_dynamic_cp(roofline):
    """First-fit decreasing packs under the cap; a pack is priced as its documents under one plan
    that fits its total, and so does the cost model the Dynamic CP planner plans on."""
    assert pack([5, 9, 3, 4], 12) == [[9, 3], [5, 4]] and pack([5, 9], 0) == [[9], [5]] and pack([20], 8) == [[20]]
    base, budget = base_model("7b", Hardware(), 4, True)
    pr = Pricer(CPCostModel(base, 2, LINKS), "paradyse", budget, 1 << 22)
    docs = [8192, 16384, 4096]
    c, t, plan = pack_priced(pr, docs)
    assert c == 2 and t == pytest.approx(sum(pr.cm.step(plan, pr.pad(s), 1).seconds for s in docs))
    assert t <= sum(pr(pr.pad(s))[0] for s in docs) * 1.05        # about its documents' own best plans
    assert pack_priced(pr, [pr.longest, pr.longest]) is None        # the pack's total does not fit
    # the planner's cost model prices a pack by the same rule: its documents' seconds, the total's bytes
    dp = DocumentPacks(base, 2, LINKS)
    one, whole = dp.step(plan, PackShape(tuple(docs)), 1), pr.cm.step(plan, sum(map(pr.pad, docs)), 1)
    assert one.seconds == pytest.approx(t) and one.peak_bytes == pytest.approx(whole.peak_bytes)
    assert dp.step(plan, 8192, 1) == pr.cm.step(plan, 8192, 1)


def test_paradyse_dynamic_cp_is_the_planners_schedule(result):
    """The system's step is ``plan_dynamic_cp``'s schedule (its rounds' seconds, the simulation's
    update), on the planners over the simulation's cost models; a step with a document that
    fits no C is not trained."""
    hw = Hardware()
    lens = lengths_distribution(SMALL.docs, SMALL.seed, SMALL.max_len, SMALL.min_len)
    for r in result["models"]["7b"]["sizes"]:
        nodes, cs, b = r["nodes"], r["cp_sizes"], r["batch_documents"]
        base, budget = base_model("7b", hw, nodes, True)
        planners = dcp_planners(base, cs, links_for(hw, SMALL.inter), budget, SMALL)
        for k, got in enumerate(r["dynamic"]["paradyse_dcp"]["per_step"]):
            if got is None:
                with pytest.raises(NoFitError):
                    plan_dynamic_cp(lens[k * b:(k + 1) * b], nodes, planners, 8, pack_tokens=SMALL.pack_tokens)
                continue
            sched = plan_dynamic_cp(lens[k * b:(k + 1) * b], nodes, planners, 8, pack_tokens=SMALL.pack_tokens)
            assert got == pytest.approx(sched.seconds - sched.update_seconds + r["update_seconds"], rel=1e-12), k
    docs = lens[:b]
    sched = plan_dynamic_cp(docs, nodes, planners, 8, pack_tokens=SMALL.pack_tokens)
    jobs, span = planner_dcp_step(planners, nodes, SMALL.pack_tokens, 8)(docs)
    assert sorted(j[0] for j in jobs) == sorted(a.size for a in sched.micro_batches())
    assert span == pytest.approx(sum(sched.round_seconds()))
    assert planner_dcp_step(planners, nodes, SMALL.pack_tokens, 8)([r["dynamic"]["paradyse_dcp"]["longest_trainable"]
                                                                  + 1024]) is None


def test_the_dynamic_aims_are_reported(result):
    for r in result["models"]["7b"]["sizes"]:
        for n, v in r["paradyse_dcp_vs_dcp"].items():
            assert v["trains_theirs"], n                                 # every step either trains
            assert v["saved"] is None or v["saved"] > -0.05, n
