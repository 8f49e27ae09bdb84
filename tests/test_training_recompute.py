"""Training under recompute (issue 34): megatron's recompute flags and planned ``:rc`` entries
train equal to stock megatron-core under the same flags, with plans changing per micro-batch.

One world of p = 2 ranks: per flag set, stock megatron-core TP+SP and ParaDySe with a plan that
cycles over every strategy, recomputed or not, per step, micro-batch and layer; then the planner
(``--paradyse-recompute auto``) under a budget where recompute pays.
"""
import math
import re

import pytest

from megatron_paradyse.testing.spawn import run_world

from .test_training import _cycling_plan_fn, _rel, _summary, _train

STEPS = 4
# 2.4 MiB per rank: the analytic model of this shape fits plain plans up to 44 tokens and, with
# recompute, the whole 64 (the planner must recompute to train the longer documents)
BUDGET_GIB = str(2.4 / 1024)
FLAG_SETS = {
    "full-uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
    "full-block": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
    # megatron's mlp checkpoint cannot take linear biases (arguments.MLP_RECOMPUTE_WITH_BIAS)
    "selective": ["--recompute-activations", "--recompute-modules", "core_attn", "mlp", "--disable-bias-linear"],
}


def _with_rc(config, p):
    """The cycling plan, every other entry recomputed (``:rc``)."""
    base = _cycling_plan_fn(config, p)

    def plan_fn(mb, step, index):
        return tuple(n + (":rc" if (step + index + i) % 2 else "") for i, n in enumerate(base(mb, step, index)))

    return plan_fn


def _world(rank, world, planned=True):
    out = {}
    for key, flags in FLAG_SETS.items():
        hist, _, _ = _train(2, world, flags, paradyse=False, steps=STEPS)
        out[f"{key}/stock"] = _summary(hist)
        hist, _, _ = _train(2, world, flags, paradyse=True, plan_fn_factory=_with_rc, steps=STEPS)
        out[f"{key}/paradyse"] = _summary(hist)
    if not planned:
        return out if rank == 0 else None
    lines = []
    hist, _, _ = _train(2, world, ["--paradyse-memory-budget", BUDGET_GIB, "--paradyse-refine", "off"],
                        paradyse=True, steps=STEPS, lines=lines)
    out["planned"] = _summary(hist)
    out["planned_log"] = lines
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def world():
    return run_world(_world, 2, timeout=300)[0]


@pytest.mark.parametrize("key", list(FLAG_SETS))
def test_recompute_flags_train_equal_to_stock(world, key):
    stock, pd = world[f"{key}/stock"], world[f"{key}/paradyse"]
    assert len(stock) == len(pd) == STEPS
    plans = [p for step in pd for p in step["plans"]]
    assert any(e.endswith(":rc") for p in plans for e in p) and any(not e.endswith(":rc") for p in plans for e in p)
    assert len(set(plans)) > 2
    worst = max(_rel(x["loss"], y["loss"]) for x, y in zip(pd, stock))
    worst_gn = max(_rel(x["gn"], y["gn"]) for x, y in zip(pd, stock))
    print(f"\n{key}: {STEPS} steps, max rel loss err {worst:.2e}, grad-norm {worst_gn:.2e}")
    assert worst < 1e-5 and worst_gn < 1e-4


def test_the_planner_recomputes_under_a_tight_budget(world):
    plans = [p for step in world["planned"] for p in step["plans"]]
    print("\n" + "\n".join(sorted({"+".join(p) for p in plans})))
    assert any(e.endswith(":rc") for p in plans for e in p), plans
    assert any(not e.endswith(":rc") for p in plans for e in p), plans  # and not everywhere
    stock = world["full-uniform/stock"]  # the same batches; recompute changes no number
    worst = max(_rel(x["loss"], y["loss"]) for x, y in zip(world["planned"], stock))
    assert worst < 1e-5, worst
    assert any("recompute" in line and "planner" in line for line in world["planned_log"]), world["planned_log"][:3]


def test_the_demo_budget_plans_recompute():
    """The demo's budget (the CPU launcher's 0.03 GiB) with the shipped p = 4 model: the longer
    packs are planned with recomputed layers (what ``scripts/run_demo.sh`` prints)."""
    import os

    from megatron_paradyse.costmodel.fitted import FittedCostModel
    from megatron_paradyse.parallel.packing import PackShape
    from megatron_paradyse.planner import build_planner
    from megatron_paradyse.units import GiB

    models = os.path.join(os.path.dirname(__file__), "..", "megatron_paradyse", "costmodel", "models")
    cm = FittedCostModel.load(os.path.join(models, "demo_p4.json"))
    planner = build_planner("optimal", cm, 0.03 * GiB, device_kind="cpu")
    short, long = planner.choose(PackShape((512, 300)), 1), planner.choose(PackShape((2044, 800)), 1)
    assert short.fits and not any(":rc" in e for e in short.layers), short
    # the longer pack recomputes: whole layers or, cheaper, their MLP blocks (st:rc-mlp)
    assert long.fits and any(":rc" in e for e in long.layers), long


def test_megatron_flags_fix_recompute_where_they_apply():
    """megatron's uniform recompute: the planner plans :rc entries only (chunks bound the
    transient); block: the first N layers are :rc in every plan, priced and re-checked."""
    from argparse import Namespace

    from megatron_paradyse.costmodel.analytic import AnalyticCostModel
    from megatron_paradyse.costmodel.shape import demo_shape
    from megatron_paradyse.planner import build_planner
    from megatron_paradyse.training.planning import recompute_plan
    from megatron_paradyse.units import MiB

    flags = lambda g=None, m=None, n=None: Namespace(paradyse_recompute="auto", recompute_granularity=g,  # noqa: E731
                                                     recompute_method=m, recompute_num_layers=n)
    assert recompute_plan(flags()) == ("auto", 1, 0)
    assert recompute_plan(flags("selective")) == ("auto", 1, 0)
    assert recompute_plan(flags("full", "uniform", 2)) == ("only", 2, 0)
    assert recompute_plan(flags("full", "block", 3)) == ("auto", 1, 3)
    cm = AnalyticCostModel(demo_shape(4))
    only = build_planner("optimal", cm, 64 * MiB, recompute="only", recompute_chunk=2)
    assert all(e.endswith(":rc") for e in only.choose(2048, 1).layers)
    for mode in ("auto", "off"):
        pl = build_planner("optimal", cm, 64 * MiB, recompute=mode, recompute_first=2)
        c = pl.choose(512, 1)
        assert all(e.endswith(":rc") for e in c.layers[:2]), c
        assert c.fits and math.isclose(c.peak_bytes, cm.step(c.layers, 512, 1).peak_bytes, rel_tol=1e-9), (mode, c)


@pytest.mark.parametrize("flags, said", [
    (["--recompute-granularity", "full"], "needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"],
     "must divide the layers per pipeline stage (4)"),
    (["--recompute-method", "block", "--recompute-num-layers", "1"], "need --recompute-granularity full"),
    (["--recompute-activations", "--recompute-num-layers", "1"], "are for --recompute-granularity full"),
    (["--recompute-activations", "--recompute-modules", "mlp"], "needs --disable-bias-linear"),
    (["--recompute-activations", "--recompute-modules", "layernorm", "--disable-bias-linear"],
     "needs Transformer Engine"),
])
def test_recompute_flags_megatron_core_cannot_run_are_refused(flags, said):
    from megatron_paradyse.training import arguments

    from .test_training import _argv

    with pytest.raises(arguments.ArgumentError, match=re.escape(said)):
        arguments.parse_args(_argv(2, flags + ["--paradyse"]), world_size=2)
