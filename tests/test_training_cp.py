"""Training with context parallelism (issue 36): ``--context-parallel-size 2 --paradyse`` at
CP = 2 x TP = 2 (4 ranks) trains equal to stock megatron-core TP = 2 without CP (stock's local
attention cannot run CP) on the same data: one sequence per row with plans cycling per step,
micro-batch and layer, and packed (stock: the same documents unpacked).

One 4-rank gloo world: stock TP = 2 x DP = 2 and ParaDySe TP = 2 x CP = 2 read the same global
batches (the loss is per token over the whole batch, so the split over replicas and CP ranks
does not change it). Losses, gradient norms and final weights agree; megatron's checkpoints
move both ways between the two layouts; the planner plans at CP = 2 within its budget.
"""
from __future__ import annotations

import pytest

from megatron_paradyse.testing.spawn import run_world

from .test_training import _cycling_plan_fn, _param_rel, _rel, _summary, _train

STEPS, SAVE_AT = 4, 2
PLANNER_BUDGET_MIB = 2.5
CP = ["--context-parallel-size", "2"]
PACK = ["--micro-batch-size", "1", "--global-batch-size", "8", "--paradyse-pack-tokens", "64"]


def _world(rank, world, root):
    out = {}
    save = ["--save-interval", str(SAVE_AT)]
    hist, out["stock_params"], _ = _train(2, world, ["--save", f"{root}/stock"] + save, paradyse=False, steps=STEPS)
    out["stock"] = _summary(hist)
    lines = []
    hist, out["cp_params"], _ = _train(2, world, CP + ["--save", f"{root}/cp"] + save, paradyse=True,
                                       plan_fn_factory=_cycling_plan_fn, steps=STEPS, lines=lines)
    out["cp"], out["cp_log"] = _summary(hist), lines
    from megatron.core import parallel_state

    out["cp_rank"] = parallel_state.get_context_parallel_rank()
    # checkpoints are megatron's: stock's step-2 checkpoint resumes under CP, and the reverse
    load = ["--ckpt-step", str(SAVE_AT)]
    hist, _, _ = _train(2, world, CP + ["--load", f"{root}/stock"] + load, paradyse=True,
                        plan_fn_factory=_cycling_plan_fn, steps=STEPS)
    out["stock_to_cp"] = _summary(hist)
    hist, _, _ = _train(2, world, ["--load", f"{root}/cp"] + load, paradyse=False, steps=STEPS)
    out["cp_to_stock"] = _summary(hist)
    lines = []
    hist, _, _ = _train(2, world, CP + ["--paradyse-memory-budget", str(PLANNER_BUDGET_MIB / 1024)], paradyse=True,
                        steps=STEPS, lines=lines)
    out["planned"], out["planned_log"] = _summary(hist), lines
    hist, out["unpacked_params"], _ = _train(2, world, ["--micro-batch-size", "1", "--global-batch-size", "8"],
                                             paradyse=False, steps=STEPS)
    out["unpacked"] = _summary(hist)
    # packs under CP need a plan (the planner's CP cost model prices rows): the cycling plan_fn
    # replaces the --paradyse-plan given to pass that check
    hist, out["packed_params"], _ = _train(2, world, CP + PACK + ["--paradyse-pack", "balanced", "--paradyse-plan",
                                                                  "tp_sp"], paradyse=True,
                                           plan_fn_factory=_cycling_plan_fn, steps=STEPS)
    out["packed"] = _summary(hist)
    lines = []  # packs planned under CP (costmodel/cp.py prices them per CP rank)
    hist, _, _ = _train(2, world, CP + PACK + ["--paradyse-pack", "balanced", "--paradyse-memory-budget",
                                               str(PLANNER_BUDGET_MIB / 1024)], paradyse=True, steps=STEPS, lines=lines)
    out["packed_planned"], out["packed_planned_log"] = _summary(hist), lines
    return out


@pytest.fixture(scope="module")
def cp_world(tmp_path_factory):
    return run_world(_world, 4, str(tmp_path_factory.mktemp("cpckpt")), timeout=300, trace=True)


def _compare(got, ref, got_params, ref_params, label):
    assert len(got) == len(ref) == STEPS
    worst = max(_rel(x["loss"], y["loss"]) for x, y in zip(got, ref))
    worst_gn = max(_rel(x["gn"], y["gn"]) for x, y in zip(got, ref))
    prel = _param_rel(got_params, ref_params)
    print(f"\n{label}: max rel loss err {worst:.2e}, grad-norm {worst_gn:.2e}, final weights {prel:.2e}")
    assert worst < 1e-5 and worst_gn < 1e-4 and prel < 1e-5
    return worst


def test_cp_training_equals_stock_without_cp(cp_world):
    r0 = cp_world[0]
    _compare(r0["cp"], r0["stock"], r0["cp_params"], r0["stock_params"], "CP=2 x TP=2 vs stock TP=2")
    plans = [p for step in r0["cp"] for p in step["plans"]]
    assert len(set(plans)) > 1 and any(len(set(p)) > 1 for p in plans)
    assert any("CP=2" in line for line in r0["cp_log"]), r0["cp_log"][:3]
    # every rank, both CP ranks included, logs the same loss
    assert {r["cp_rank"] for r in cp_world} == {0, 1}
    for r in cp_world[1:]:
        assert [x["loss"] for x in r["cp"]] == [x["loss"] for x in r0["cp"]]


def test_checkpoints_move_both_ways_between_stock_and_cp(cp_world):
    """Stock TP = 2 x DP = 2's step-2 checkpoint resumes at CP = 2 x TP = 2 and the reverse; each
    continuation equals the uninterrupted run's steps 3-4."""
    r0 = cp_world[0]
    for key in ("stock_to_cp", "cp_to_stock"):
        got = r0[key]
        assert [x["it"] for x in got] == list(range(SAVE_AT + 1, STEPS + 1)), got
        worst = max(_rel(x["loss"], y["loss"]) for x, y in zip(got, r0["stock"][SAVE_AT:]))
        print(f"\n{key}: max rel loss err {worst:.2e} against stock's steps {SAVE_AT + 1}-{STEPS}")
        assert worst < 1e-5


def test_the_planner_plans_under_cp_within_budget(cp_world):
    """Without a plan the planner plans each micro-batch's in-node strategies at CP = 2 with the CP
    cost model (``costmodel.cp.CPCostModel``); losses stay stock's and no measured peak exceeds
    the budget."""
    import re

    r0 = cp_world[0]
    assert any("cost model CPCostModel" in line for line in r0["planned_log"]), r0["planned_log"][:3]
    plans = {p for step in r0["planned"] for p in step["plans"]}
    assert len(plans) > 1, plans
    worst = max(_rel(x["loss"], y["loss"]) for x, y in zip(r0["planned"], r0["stock"]))
    peaks = [float(m) for line in r0["planned_log"] for m in re.findall(r"measured peak \(rank 0\): ([0-9.]+) MiB", line)]
    print(f"\nplanner at CP=2: plans {sorted(plans)}; max rel loss err {worst:.2e}; measured peaks {peaks} MiB "
          f"(budget {PLANNER_BUDGET_MIB})")
    assert worst < 1e-5 and len(peaks) == STEPS and max(peaks) <= PLANNER_BUDGET_MIB


def test_cp_packed_training_equals_stock_unpacked(cp_world):
    r0 = cp_world[0]
    _compare(r0["packed"], r0["unpacked"], r0["packed_params"], r0["unpacked_params"],
             "packed CP=2 x TP=2 vs stock TP=2 unpacked")


def test_the_planner_plans_packs_under_cp_within_its_budget(cp_world):
    """``--paradyse-pack`` at CP = 2 without a plan: the planner plans each pack on the CP cost
    model's per-rank pack prices; losses stay stock's (unpacked) and no measured peak exceeds
    the budget."""
    import re

    r0 = cp_world[0]
    log = r0["packed_planned_log"]
    assert any("cost model CPCostModel" in line for line in log), log[:3]
    worst = max(_rel(x["loss"], y["loss"]) for x, y in zip(r0["packed_planned"], r0["unpacked"]))
    peaks = [float(m) for line in log for m in re.findall(r"measured peak \(rank 0\): ([0-9.]+) MiB", line)]
    print(f"\npacks planned at CP=2: max rel loss err {worst:.2e}; measured peaks {peaks} MiB "
          f"(budget {PLANNER_BUDGET_MIB})")
    assert worst < 1e-5 and len(peaks) == STEPS and max(peaks) <= PLANNER_BUDGET_MIB


def test_cp_flags_are_checked_before_any_collective():
    """Every refusal is an ArgumentError raised while parsing, before torch.distributed starts."""
    from megatron_paradyse.training.arguments import ArgumentError, parse_args

    from .test_training import _argv

    cases = [
        (_argv(2, CP), 4, "needs --paradyse"),
        (_argv(2, CP + ["--paradyse", "--cp-comm-type", "a2a"]), 4, "--cp-comm-type a2a"),
        (_argv(2, CP + ["--paradyse", "--hierarchical-context-parallel-sizes", "2", "2"]), 4, "one CP ring"),
        (_argv(2, ["--context-parallel-size", "3", "--paradyse"]), 4, "not divisible by"),
        (_argv(2, CP + ["--paradyse", "--seq-length", "60"]), 4, "must be a multiple of 2 x"),
        (_argv(2, CP + ["--paradyse", "--paradyse-pad-multiple", "4"]), 4, "multiple of 2 x CP x TP = 8"),
        (_argv(2, CP + ["--paradyse", "--paradyse-cp-links", "nvlink4"]), 4, "give two names"),
        (_argv(2, CP + ["--paradyse", "--paradyse-cp-links", "nvlink4,carrier_pigeon"]), 4, "unknown interconnect"),
    ]
    for argv, world, needle in cases:
        with pytest.raises(ArgumentError, match=needle.replace("-", r"\-")):
            parse_args(argv, world_size=world)
    args = parse_args(_argv(2, CP + ["--paradyse"]), world_size=8)
    assert args.data_parallel_size == 2 and args.paradyse_pad_multiple == 8
    # packs under CP: the planner plans them (no plan needed)
    parse_args(_argv(2, CP + PACK + ["--paradyse", "--paradyse-pack", "balanced"]), world_size=4)
    args = parse_args(_argv(2, CP + ["--paradyse", "--pipeline-model-parallel-size", "2"]), world_size=8)
    assert args.data_parallel_size == 1  # CP with pipeline stages (tests/test_training_pipeline.py)
