"""Training with pipeline stages (issue 35): ``pretrain_gpt_paradyse.py`` at PP = 2 x TP = 2 x
DP = 2 equals stock megatron-core at the same layout on the same data, with plans changing per
step, micro-batch, layer and so per stage: variable lengths, packs, megatron's recompute with
``:rc`` entries; megatron's interleaved schedule (2 model chunks per stage), unpacked and
packed; checkpoints move both ways between stock and ParaDySe (with the interleaved schedule,
stock's model chunks resumed by ParaDySe); the step planner with online
refinement per stage. With context
parallelism PP = 2 x TP = 2 x CP = 2 on the same ranks equals stock PP = 2 x TP = 2 x DP = 2
without CP, and the step planner plans it within its budget.

One world of 8 gloo ranks (megatron's order: TP fastest, then DP, then PP; stage 0 is ranks
0-3, stage 1 ranks 4-7), about 30 s here. Stock runs megatron's own
p2p shape exchange (``variable_seq_lengths``); ParaDySe answers it from the agreed micro-batches
(``training/p2p_shapes.py``), and the test makes megatron's exchange raise in those runs.
"""
import contextlib
import time

import pytest

from megatron_paradyse.testing.spawn import run_world

from .test_training import _cycling_plan_fn, _evaluated, _param_rel, _rel, _summary, _train

STEPS = 4
SAVE_AT = 2
WORLD = 8
FIRST_OF_STAGE = (0, WORLD // 2)  # each stage's first rank: it returns its stage's full weights
PP = ["--pipeline-model-parallel-size", "2", "--train-iters", str(STEPS), "--micro-batch-size", "1",
      "--global-batch-size", "4"]  # two micro-batches per replica and step
# the analytic model of this shape: every micro-batch fits a stage alone, two long ones in flight
# on the first stage do not with the fastest plans (the step planner recomputes some layers) ...
BUDGET_GIB = str(1.3 / 1024)
# ... and at this one the first step's two micro-batches in flight fit no plan at all
TOO_SMALL_GIB = str(1.1 / 1024)
UNPACKED = ["--micro-batch-size", "1", "--global-batch-size", "4"]
PACK = ["--paradyse-pack-tokens", "64", "--paradyse-pack", "balanced"]  # stock: the same documents unpacked
CP = ["--context-parallel-size", "2"]
CP_STEPS = 3  # the packed and planned CP runs
# at CP = 2 every micro-batch fits, two long ones in flight on the first stage only with some
# attention recomputed
CP_BUDGET_GIB = str(1.15 / 1024)
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
# the interleaved schedule: two model chunks per stage, one layer each (stage 0 runs layers 1
# and 3, stage 1 layers 2 and 4); four documents per replica and step, so that a packed step
# has at least PP packs (megatron's groups of PP micro-batches per chunk); one stock run is the
# reference of both ParaDySe runs, unpacked and packed (the same documents)
VPP = ["--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
VPP_STEPS = 2
VPP_CKPT = ["--virtual-pipeline-model-parallel-size", "2"]  # 2 micro-batches a replica, 2 steps of STEPS


def _with_rc(config, p):
    """The cycling plan, every other entry recomputed (``:rc``)."""
    base = _cycling_plan_fn(config, p)

    def plan_fn(mb, step, index):
        return tuple(n + (":rc" if (step + index + i) % 2 else "") for i, n in enumerate(base(mb, step, index)))

    return plan_fn


class _NoExchange:
    """megatron's p2p shape exchange made to raise: ParaDySe's runs must not use it."""

    NAME = "test:no_exchange"

    def __enter__(self):
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        from megatron_paradyse import runtime
        from megatron_paradyse.training import p2p_shapes

        def refuse(*a, **k):
            raise AssertionError("megatron's shape exchange ran in a ParaDySe step")

        # the plugin's patch installed over one that refuses: its fallback is the refusal
        p2p_shapes.uninstall()
        runtime.install(self.NAME, runtime.Patch(P2PCommunicator, "_communicate_shapes", refuse))
        p2p_shapes.install()

    def __exit__(self, *exc):
        from megatron_paradyse import runtime
        from megatron_paradyse.training import p2p_shapes

        p2p_shapes.uninstall()
        runtime.restore(self.NAME)
        p2p_shapes.install()


def _pair(world, extra, factory=_cycling_plan_fn, save=None, packed=False, evaluate=False):
    """Stock and ParaDySe runs of ``extra`` (``packed``: ParaDySe packs the documents stock
    runs one per micro-batch): their summaries and final full weights; with ``evaluate`` their
    final validation and test (one global batch each)."""
    out = {}
    for name, paradyse in (("stock", False), ("paradyse", True)):
        more = list(extra) + (PACK if packed and paradyse else []) + (["--eval-iters", "1"] if evaluate else [])
        if save:
            more += ["--save", f"{save}/{name}", "--save-interval", str(SAVE_AT)]
        with _NoExchange() if paradyse else contextlib.nullcontext():
            hist, params, trainer = _train(2, world, PP + more, paradyse=paradyse,
                                           plan_fn_factory=factory if paradyse else None)
            if evaluate:
                out[f"{name}_eval"] = _evaluated(trainer)
        out[name], out[f"{name}_params"] = _summary(hist), params
    return out


def _resume(world, root):
    """From step SAVE_AT: ParaDySe from stock's checkpoint, stock from ParaDySe's."""
    load = ["--ckpt-step", str(SAVE_AT)]
    with _NoExchange():
        a, _, _ = _train(2, world, PP + ["--load", f"{root}/stock"] + load, paradyse=True,
                         plan_fn_factory=_cycling_plan_fn)
    b, _, _ = _train(2, world, PP + ["--load", f"{root}/paradyse"] + load, paradyse=False)
    return {"paradyse_from_stock": _summary(a), "stock_from_paradyse": _summary(b)}


def _planned(world, root):
    """The step planner under a tight budget with a run report; then a budget no step fits."""
    import json

    from megatron_paradyse.parallel.plan_check import PlanMismatchError
    from megatron_paradyse.planner import NoFitError

    hist, _, trainer = _train(2, world, PP + ["--paradyse-memory-budget", BUDGET_GIB, "--paradyse-run-report",
                                              f"{root}/report", "--eval-iters", "1", "--paradyse-refine", "on"],
                              paradyse=True)
    evaluated = _evaluated(trainer)
    refinement = [dict(ref.state(), updates=ref.updates) for ref in trainer.planner.pipeline.refinements]
    with open(f"{root}/report/run_report.json") as fh:
        report = json.load(fh)
    try:
        _train(2, world, PP + ["--paradyse-memory-budget", TOO_SMALL_GIB], paradyse=True)
        error = None
    except (NoFitError, PlanMismatchError) as e:  # a replica whose own step fits hears the other's
        error = str(e)
    return {"summary": _summary(hist), "report": report, "error": error, "eval": evaluated, "refinement": refinement}


def _interleaved(world, cases=("interleaved", "interleaved_packed")):
    """Stock megatron-core's interleaved schedule and ParaDySe's under cycling plans, unpacked
    and packed (two steps each; ``cases``: which): their summaries and the first model chunk's
    final weights."""
    hist, stock_params, _ = _train(2, world, PP + VPP, paradyse=False, steps=VPP_STEPS)
    out = {}
    for case, more in (("interleaved", []), ("interleaved_packed", PACK)):
        if case not in cases:
            continue
        with _NoExchange():
            pd, params, _ = _train(2, world, PP + VPP + more, paradyse=True, plan_fn_factory=_cycling_plan_fn,
                                   steps=VPP_STEPS)
        out[case] = {"stock": _summary(hist), "paradyse": _summary(pd), "stock_params": stock_params,
                     "paradyse_params": params}
    return out


def _divergent(rank):
    """The cycling plan, except on a rank of stage 1 (global rank 6) at step 1: another plan for
    its stage's layers. Every rank of every stage must stop together before the step."""
    def factory(config, p):
        base = _cycling_plan_fn(config, p)

        def plan_fn(mb, step, index):
            plan = base(mb, step, index)
            if rank == 6 and step == 1:
                plan = plan[:2] + (("ulysses", "ring") if plan[2:] != ("ulysses", "ring") else ("ring", "ulysses"))
            return plan
        return plan_fn
    return factory


def _stage_divergence(rank, world):
    from megatron_paradyse.parallel.plan_check import PlanMismatchError

    try:
        _train(2, world, PP, paradyse=True, plan_fn_factory=_divergent(rank), steps=2)
        return None
    except PlanMismatchError as e:
        return str(e)


def _context_parallel(world, root):
    """ParaDySe at PP = 2 x TP = 2 x CP = 2 on the same 8 ranks (DP = 1, four micro-batches a
    step): the cycling plans one sequence per row (compared with ``plain``'s stock PP = 2 x
    TP = 2 x DP = 2, no CP) and packed for 3 steps (with ``packed``'s stock, the same documents
    unpacked); then the step planner at CP with a run report (3 steps, a budget every length
    fits: the data are stock's)."""
    import json
    import time

    out, t0 = {}, time.perf_counter()
    with _NoExchange():
        hist, out["paradyse_params"], _ = _train(2, world, PP + CP, paradyse=True, plan_fn_factory=_cycling_plan_fn)
        out["paradyse"] = _summary(hist)
        hist, _, _ = _train(2, world, PP + CP + UNPACKED + PACK + ["--paradyse-plan", "tp_sp"], paradyse=True,
                            plan_fn_factory=_cycling_plan_fn, steps=CP_STEPS)
        out["packed"] = _summary(hist)
        hist, _, _ = _train(2, world, PP + CP + ["--paradyse-memory-budget", CP_BUDGET_GIB, "--paradyse-run-report",
                                                 f"{root}/cp_report"], paradyse=True, steps=CP_STEPS)
        out["planned"] = _summary(hist)
    with open(f"{root}/cp_report/run_report.json") as fh:
        out["report"] = json.load(fh)
    out["seconds"] = time.perf_counter() - t0  # what the CP runs add to the world
    return out


def _interleaved_resume(world, root):
    """The interleaved schedule's checkpoint (its two model chunks, saved as model0 and model1):
    stock saves at step 1, ParaDySe resumes there under cycling plans."""
    t0 = time.perf_counter()
    stock, _, _ = _train(2, world, PP + VPP_CKPT + ["--save", f"{root}/vpp", "--save-interval", "1"], paradyse=False,
                         steps=2)
    with _NoExchange():
        got, _, _ = _train(2, world, PP + VPP_CKPT + ["--load", f"{root}/vpp", "--ckpt-step", "1"], paradyse=True,
                           plan_fn_factory=_cycling_plan_fn, steps=2)
    return {"stock": _summary(stock), "resumed": _summary(got), "seconds": time.perf_counter() - t0}


def _world(rank, world, root):
    out = {"plain": _pair(world, [], save=root, evaluate=True)}
    out["resume"] = _resume(world, root)
    out["packed"] = _pair(world, UNPACKED, packed=True)
    out["recompute"] = _pair(world, RECOMPUTE, factory=_with_rc)
    out["planned"] = _planned(world, root)
    out["divergence"] = {"error": _stage_divergence(rank, world)}
    out.update(_interleaved(world, cases=("interleaved",)))
    if rank in FIRST_OF_STAGE:
        return out
    return {k: {n: v for n, v in d.items() if not n.endswith("params")} for k, d in out.items()}


def _world_dims(rank, world, root):
    """The runs at more dimensions, with the stock runs they compare with: CP with pipeline
    stages (against stock PP x TP x DP, unpacked and packed) and the interleaved schedule."""
    out = {"plain": _pair(world, []), "packed": _pair(world, UNPACKED, packed=True)}
    out["cp"] = _context_parallel(world, root)
    t0 = time.perf_counter()
    out.update(_interleaved(world, cases=("interleaved_packed",)))
    out["times"] = {"interleaved": time.perf_counter() - t0}
    out["vpp_resume"] = _interleaved_resume(world, root)
    if rank in FIRST_OF_STAGE:
        return out
    return {k: {n: v for n, v in d.items() if not n.endswith("params")} for k, d in out.items()}


SLOW_DIMS = pytest.mark.slow(reason="a second 8-rank world (about 60 s alone, over 300 s beside the default suite's "
                                    "other 8-rank jobs on 2 cores); the default suite keeps PP and CP each "
                                    "(this file's world, tests/test_training_cp.py)")


@pytest.fixture(scope="module")
def world_dims(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pp_dims"))
    return run_world(_world_dims, WORLD, root, timeout=600, trace=True)


def test_interleaved_pipeline_trains_equal_to_stock(world):
    """megatron's interleaved schedule (2 model chunks per stage) under cycling plans equals
    stock's interleaved schedule (packed: the second world's test below)."""
    _check_pair(world, "interleaved")


@SLOW_DIMS
def test_interleaved_pipeline_packed_trains_equal_to_stock(world_dims):
    """The same with ParaDySe's micro-batches packed (stock runs the same documents unpacked)."""
    _check_pair(world_dims, "interleaved_packed")


@SLOW_DIMS
def test_cp_with_pipeline_stages_trains_equal_to_stock_without_cp(world_dims):
    """PP = 2 x TP = 2 x CP = 2 (each stage's layers attend across the two CP ranks, each CP
    rank's p2p tensors of s / 2 tokens) equals stock PP = 2 x TP = 2 x DP = 2 without CP on the
    same global batches: plans cycling per step, micro-batch and layer, one sequence per row
    (losses, grad norms, final weights) and packed (against the same documents unpacked)."""
    got, stock = world_dims[0]["cp"], world_dims[0]["plain"]["stock"]
    pd = got["paradyse"]
    assert len(pd) == STEPS and len(got["packed"]) == CP_STEPS
    plans = [p for step in pd + got["packed"] for p in step["plans"]]
    assert len({p[:2] for p in plans}) > 1 and len({p[2:] for p in plans}) > 1, plans
    assert all(s % 8 == 0 for step in pd for s in step["s"]) and len(pd[0]["s"]) == 4  # 2 x CP x TP; DP = 1
    loss = max(_rel(x["loss"], y["loss"]) for x, y in zip(pd, stock))
    gn = max(_rel(x["gn"], y["gn"]) for x, y in zip(pd, stock))
    weights = max(_param_rel(world_dims[r]["cp"]["paradyse_params"], world_dims[r]["plain"]["stock_params"])
                  for r in FIRST_OF_STAGE)
    unpacked = world_dims[0]["packed"]["stock"]
    packed = max(max(_rel(x["loss"], y["loss"]), _rel(x["gn"], y["gn"])) for x, y in zip(got["packed"], unpacked))
    print(f"\nPP=2 x TP=2 x CP=2 vs stock PP=2 x TP=2 x DP=2: loss {loss:.1e}, grad norm {gn:.1e}, weights "
          f"{weights:.1e}; packed vs unpacked (loss, grad norm) {packed:.1e}; the CP runs took {got['seconds']:.1f} s")
    assert loss < 1e-5 and gn < 1e-5 and weights < 1e-5 and packed < 1e-5
    for r in world_dims[1:]:  # every rank, both CP ranks of both stages, reports the same losses
        assert [x["loss"] for x in r["cp"]["paradyse"]] == [x["loss"] for x in pd]


@SLOW_DIMS
def test_the_step_planner_plans_cp_with_pipeline_stages_within_the_budget(world_dims):
    """Without a plan, at PP = 2 x CP = 2: each stage priced by the CP cost model (its layers at
    s / 2 plus the ring), a step's four micro-batches planned together over 1F1B; no stage's
    measured peak over the budget, each predicted within 5% (the first step left out, as at
    CP = 1), losses stock's."""
    got = world_dims[0]["cp"]
    steps, budget = got["report"]["steps"], got["report"]["budget_bytes"]
    plans = [p for step in got["planned"] for p in step["plans"]]
    assert any(":rc" in e for p in plans for e in p) and len(set(plans)) > 1, plans
    for s in steps:
        assert len(s["stage_peak_bytes"]) == 2 and max(s["stage_peak_bytes"]) <= budget, s
        assert max(s["stage_predicted_peak_bytes"]) <= budget
    errs = [abs(p - m) / m for s in steps[1:] for p, m in zip(s["stage_predicted_peak_bytes"], s["stage_peak_bytes"])]
    loss = max(_rel(x["loss"], y["loss"]) for x, y in zip(got["planned"], world_dims[0]["plain"]["stock"]))
    print(f"\nPP=2 x CP=2 planner: stage peaks worst {max(max(s['stage_peak_bytes']) for s in steps) / budget:.0%} "
          f"of the budget, predicted within {100 * max(errs):.1f}% (first step left out); loss vs stock {loss:.1e}")
    assert max(errs) < 0.05 and loss < 1e-5


def test_the_step_planner_keeps_every_stage_within_the_budget(world):
    got = world[0]["planned"]
    steps = got["report"]["steps"]
    budget = got["report"]["budget_bytes"]
    plans = [p for step in got["summary"] for p in step["plans"]]
    assert any(e.endswith(":rc") for p in plans for e in p) and len(set(plans)) > 1, plans
    for s in steps:
        assert len(s["stage_peak_bytes"]) == 2 and max(s["stage_peak_bytes"]) <= budget, s
        assert max(s["stage_predicted_peak_bytes"]) <= budget
    errs = [abs(p - m) / m for s in steps[1:] for p, m in zip(s["stage_predicted_peak_bytes"], s["stage_peak_bytes"])]
    print(f"\nstage peaks: worst {max(max(s['stage_peak_bytes']) for s in steps) / budget:.0%} of the budget, "
          f"prediction error {100 * max(errs):.1f}% worst (first step left out)")


def test_a_step_no_plan_fits_stops_on_every_rank_naming_the_stage(world):
    for r in world:
        e = r["planned"]["error"]
        assert e is not None and "step 0" in e and "stage 0 of 2" in e and "in flight" in e, e
        assert "MiB" in e and "limit" in e and "budget" in e


def test_the_step_planner_refines_each_stage(world):
    """--paradyse-refine on with stages (the planned run above): one refinement per stage
    planner, updated every step from its own stage's measurements summed over the world, the
    same on every rank."""
    refs = world[0]["planned"]["refinement"]
    assert len(refs) == 2 and all(ref["updates"] == STEPS for ref in refs), refs
    assert refs[0]["mem"] != refs[1]["mem"]  # each stage's own peaks
    for r in world[1:]:
        assert r["planned"]["refinement"] == refs
    print(f"\nrefinement versions per stage {[ref['version'] for ref in refs]}")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pp"))
    return run_world(_world, WORLD, root, timeout=300, trace=True)  # NCCL's ordering rule checked on every stage


@pytest.mark.parametrize("case", ["plain", "packed", "recompute"])
def test_pipeline_stages_train_equal_to_stock_pipeline(world, case):
    _check_pair(world, case)


def _check_pair(world, case):
    got = world[0][case]
    stock, pd = got["stock"], got["paradyse"]
    assert len(stock) == len(pd) == (VPP_STEPS if case.startswith("interleaved") else STEPS)
    plans = [p for step in pd for p in step["plans"]]
    # per stage: stage 0 runs layers 1-2, stage 1 layers 3-4 (interleaved: 1 and 3, 2 and 4);
    # each changes per micro-batch
    assert len({p[:2] for p in plans}) > 1 and len({p[2:] for p in plans}) > 1, plans
    assert len({p[0::2] for p in plans}) > 1 and len({p[1::2] for p in plans}) > 1, plans
    assert len({s for step in pd for s in step["s"]}) > 1  # lengths vary per micro-batch
    loss = max(_rel(x["loss"], y["loss"]) for x, y in zip(pd, stock))
    gn = max(_rel(x["gn"], y["gn"]) for x, y in zip(pd, stock))
    weights = max(_param_rel(world[r][case]["paradyse_params"], world[r][case]["stock_params"])
                  for r in FIRST_OF_STAGE)
    print(f"\n{case}: {len(pd)} steps at PP=2 x TP=2 x DP=2, loss {loss:.1e}, grad norm {gn:.1e}, weights {weights:.1e}")
    assert loss < 1e-5 and gn < 1e-5 and weights < 1e-5
    for r in world[1:]:  # every rank reports the same losses (summed over the stages)
        assert [x["loss"] for x in r[case]["paradyse"]] == [x["loss"] for x in pd]


def test_pipeline_validation_equals_stock_and_stays_in_the_budget(world):
    """--eval-iters 1 at PP = 2: the final validation and test losses (the last stage's, summed
    over the stages) equal stock's under the cycling plans, and under the step planner the
    forward-only passes stay within its budget on every stage."""
    plain = world[0]["plain"]
    stock, pd = plain["stock_eval"]["results"], plain["paradyse_eval"]["results"]
    assert [x[1] for x in stock] == [x[1] for x in pd] == ["validation", "test"]
    worst = max(_rel(x[2], y[2]) for x, y in zip(pd, stock))
    planned = world[0]["planned"]["eval"]["results"]
    print(f"\nPP=2 validation: max rel err {worst:.1e} (plans {plain['paradyse_eval']['plans']}); planner's forward-only peak "
          f"{max(x[4] for x in planned) / 2**20:.2f} MiB, budget {planned[0][5] / 2**20:.2f} MiB; "
          f"{len(stock + pd + planned)} evaluations in {sum(x[6] for x in stock + pd + planned):.1f} s")
    assert worst < 1e-5
    plans = plain["paradyse_eval"]["plans"]  # the last validation batch's: per layer, mixed
    assert plans and all(p is not None for p in plans) and any(len(set(p)) > 1 for p in plans), plans
    assert [x[1] for x in planned] == ["validation", "test"]
    assert all(x[4] is not None and 0 < x[4] <= x[5] for x in planned)
    for r in world[1:]:  # every rank reports the same losses
        assert [x[2] for x in r["plain"]["paradyse_eval"]["results"]] == [x[2] for x in pd]


def test_checkpoints_move_both_ways_between_stock_and_paradyse_pipelines(world):
    plain, resumed = world[0]["plain"], world[0]["resume"]
    for key, ref in (("paradyse_from_stock", plain["stock"]), ("stock_from_paradyse", plain["paradyse"])):
        got = resumed[key]
        assert [x["it"] for x in got] == list(range(SAVE_AT + 1, STEPS + 1))
        worst = max(_rel(x["loss"], y["loss"]) for x, y in zip(got, ref[SAVE_AT:]))
        assert worst < 1e-5, (key, worst)


@SLOW_DIMS  # the interleaved schedule's runs: in the second world (beside the suite, 8 ranks of it took 4-5x)
def test_interleaved_checkpoint_resumes_to_the_uninterrupted_run(world_dims):
    """Checkpoints with the interleaved schedule (PP = 2 x V = 2 x TP = 2 x DP = 2): stock's
    model chunks and optimizer saved at step 1 through megatron-core's dist checkpointing,
    loaded by a ParaDySe run under cycling plans, whose step 2 equals the uninterrupted stock
    run's (loss and grad norm; a chunk not restored would differ)."""
    got = world_dims[0]["vpp_resume"]
    stock, resumed = got["stock"], got["resumed"]
    assert [x["it"] for x in stock] == [1, 2] and [x["it"] for x in resumed] == [2]
    assert all(p is not None for p in resumed[0]["plans"])
    loss, gn = _rel(resumed[0]["loss"], stock[1]["loss"]), _rel(resumed[0]["gn"], stock[1]["gn"])
    print(f"\ninterleaved resume: loss {loss:.1e}, grad norm {gn:.1e} ({got['seconds']:.1f} s)")
    assert loss < 1e-5 and gn < 1e-5
    for r in world_dims[1:]:
        assert [x["loss"] for x in r["vpp_resume"]["resumed"]] == [x["loss"] for x in resumed]


def test_a_stage_planning_otherwise_stops_every_rank_before_the_step(world):
    """The plan check spans the pipeline: a rank of stage 1 with another plan for its layers
    stops all 8 ranks, stage 0's included, naming the ranks and their plans."""
    for r in world:
        e = r["divergence"]["error"]
        assert e is not None and "plan mismatch at iteration 1" in e and "rank 6" in e, e
