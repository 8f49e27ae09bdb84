"""Training with hot switching (issue 4): equality with stock Megatron TP+SP, resume, plan checks.

Two 4-rank gloo worlds (spawning costs ~5 s of imports per rank on 2 cores, so each world runs
many checks):

* world A, TP=p=4: stock megatron-core TP+SP and ParaDySe train the same small GPT for 14
  steps over variable-length micro-batches; ParaDySe's plan changes per step, per
  micro-batch and per layer. Both save at step 7. Then the planner chooses the plans with
  online refinement (10 steps), and again for 3 steps writing a run report.
* world B (fresh): resume from step 7 (ParaDySe -> ParaDySe, ParaDySe -> stock,
  stock -> ParaDySe); a divergent plan planted on one rank; dp=2 x p=2 equality; padding
  invariance of loss and gradient at TP=1.

The comparisons run in this process on what the worlds return.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time

import pytest

from megatron_paradyse.testing.spawn import run_world

STEPS = 14
SAVE_AT = 7

BASE = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
    "--vocab-size", "128", "--make-vocab-size-divisible-by", "32",
    "--micro-batch-size", "2", "--global-batch-size", "4",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--weight-decay", "0.01", "--clip-grad", "1.0", "--adam-beta2", "0.95",
    "--mock-data", "--paradyse-mock-min-length", "6", "--seed", "1234",
    "--log-interval", "1", "--sequence-parallel",
]


def _argv(tp, extra):
    return BASE + ["--tensor-model-parallel-size", str(tp), "--train-iters", str(STEPS)] + list(extra)


def _cycling_plan_fn(config, p):
    """A plan per (step, micro-batch, layer) cycling over every strategy that supports the model."""
    import megatron_paradyse as mp

    names = [n for n in mp.STRATEGIES if mp.supports(n, config, p)[0]]

    def plan_fn(mb, step, index):
        return tuple(names[(step + 2 * index + layer) % len(names)] for layer in range(config.num_layers))

    return plan_fn


@contextlib.contextmanager
def _logged(lines):
    """The package's log records of this rank (INFO and above) appended to ``lines`` (None: none)."""
    if lines is None:
        yield
        return
    logger = logging.getLogger("megatron_paradyse")
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _train(tp, world, extra, paradyse, plan_fn_factory=None, steps=None, lines=None):
    """One Trainer run inside a world; returns (history, full params on rank 0, trainer)."""
    import megatron_paradyse as mp
    from megatron_paradyse.training import arguments, trainer as training
    from megatron_paradyse.testing.models import gather_full

    if not paradyse:
        mp.uninstall()
    args = arguments.parse_args(_argv(tp, extra + (["--paradyse"] if paradyse else [])), world_size=world)
    plan_fn = None
    if plan_fn_factory is not None:
        plan_fn = plan_fn_factory(arguments.transformer_config_from_args(args), tp)
    with _logged(lines):
        trainer = training.Trainer(args, plan_fn=plan_fn)
        trainer.train(steps)
    params = gather_full(mp.unwrap(trainer.model))
    return trainer.history, params, trainer


EVAL = ["--eval-interval", "5", "--eval-iters", "1"]  # validation at 5, 10 (and after training)


def _evaluated(trainer, lines=None, final=True):
    """The validation results of a run (with ``final``, after the final validation and test, their
    log lines appended to ``lines``) and the plans of the last validation batch."""
    if final:
        with _logged(lines):
            trainer.final_evaluation()
    res = [(r.prefix, r.split, r.loss, r.ppl, r.peak_bytes, r.budget_bytes, r.seconds)
           for r in trainer.evaluation.results]
    it = trainer.evaluation.iterators["validation"]
    return dict(results=res, plans=[] if it is None else [mb.plan for mb in it.current])


def _summary(history):
    return [dict(it=h.iteration, loss=h.loss, gn=h.grad_norm, lr=h.lr, s=h.seq_lengths,
                 plans=h.plans, tokens=h.tokens, padded=h.padded_tokens, sec=h.seconds) for h in history]


def _world_a(rank, world, ckpt_root):
    import torch.distributed as dist

    out = {}
    lines = []
    t0 = time.perf_counter()
    hist, params, trainer = _train(4, world, ["--save", f"{ckpt_root}/stock", "--save-interval", str(SAVE_AT)]
                                   + EVAL, paradyse=False)
    out["stock_eval"] = _evaluated(trainer)
    out["stock"] = _summary(hist)
    out["stock_params"] = params if rank == 0 else None
    out["stock_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    hist, params, trainer = _train(4, world, ["--save", f"{ckpt_root}/paradyse", "--save-interval", str(SAVE_AT)]
                                   + EVAL, paradyse=True, plan_fn_factory=_cycling_plan_fn, lines=lines)
    out["paradyse_eval"] = _evaluated(trainer, lines)
    out["paradyse"] = _summary(hist)
    out["paradyse_params"] = params if rank == 0 else None
    out["paradyse_seconds"] = time.perf_counter() - t0
    out["log"] = lines if rank == 0 else None
    # the planner chooses per micro-batch (--paradyse, no plan): 10 steps; the budget (analytic
    # model of this shape) fits tp_sp up to s = 32 and needs tp_sp+metp mixes beyond
    t0 = time.perf_counter()
    planned_lines = []
    hist, _, trainer = _train(4, world, ["--paradyse-memory-budget", PLANNER_BUDGET_GIB, "--paradyse-refine", "on"]
                              + EVAL, paradyse=True, steps=PLANNER_STEPS, lines=planned_lines)
    out["planned_eval"] = _evaluated(trainer, final=False)
    out["planned"] = _summary(hist)
    out["planned_log"] = planned_lines if rank == 0 else None
    out["planned_seconds"] = time.perf_counter() - t0
    # the same with a run report: the same step path, so the refinement still learns
    t0 = time.perf_counter()
    reported_lines = []
    hist, _, trainer = _train(4, world, ["--paradyse-memory-budget", PLANNER_BUDGET_GIB, "--paradyse-refine", "on",
                                         "--paradyse-run-report", f"{ckpt_root}/report",
                                         "--paradyse-memory-every", "2",
                                         # TensorBoard (training/scalars.py), the launcher line
                                         "--tensorboard-dir", f"{ckpt_root}/tb", "--log-timers-to-tensorboard",
                                         "--eval-interval", "5", "--eval-iters", "2"],
                              paradyse=True, steps=REPORTED_STEPS, lines=reported_lines)
    ref = trainer.planner.refinement
    out["reported"] = dict(steps=_summary(hist), log=reported_lines if rank == 0 else None,
                           version=ref.version, updates=ref.updates, state=ref.state(),
                           seconds=time.perf_counter() - t0)
    dist.barrier()
    return out


PLANNER_STEPS = 10
PLANNER_BUDGET_GIB = "0.001336"
REPORTED_STEPS = 3


class _Planted:
    """The cycling plan, except on global rank 3 at iteration 2 (a divergent rank)."""

    def __init__(self, rank):
        self.rank = rank

    def __call__(self, config, p):
        base = _cycling_plan_fn(config, p)
        rank = self.rank

        def plan_fn(mb, step, index):
            plan = base(mb, step, index)
            if rank == 3 and step == 2 and index == 1:
                plan = tuple(reversed(plan)) if len(set(plan)) > 1 else ("tp_sp",) * len(plan)
                if plan == base(mb, step, index):
                    plan = ("ulysses",) * len(plan)
            return plan

        return plan_fn


def _world_b(rank, world, ckpt_root):
    import torch
    import torch.distributed as dist

    from megatron_paradyse.training import trainer as training
    from megatron_paradyse.parallel.plan_check import PlanMismatchError

    out = {}
    load = ["--ckpt-step", str(SAVE_AT)]
    # (b) resume from step 7 in a fresh world
    hist, params, _ = _train(4, world, ["--load", f"{ckpt_root}/paradyse"] + load, paradyse=True,
                             plan_fn_factory=_cycling_plan_fn)
    out["resume_pd_pd"] = _summary(hist)
    out["resume_pd_pd_params"] = params if rank == 0 else None
    hist, _, _ = _train(4, world, ["--load", f"{ckpt_root}/stock"] + load, paradyse=True,
                        plan_fn_factory=_cycling_plan_fn)
    out["resume_stock_pd"] = _summary(hist)
    hist, _, trainer = _train(4, world, ["--load", f"{ckpt_root}/paradyse"] + load, paradyse=False)
    out["resume_pd_stock"] = _summary(hist)
    out["crash"] = _crash_during_save(trainer, f"{ckpt_root}/crash")
    out["exits"] = _exit_and_resume(world, ckpt_root)

    # (c) a divergent plan planted on rank 3 at iteration 2
    from megatron_paradyse.training import arguments

    args_div = arguments.parse_args(_argv(4, ["--paradyse"]), world_size=world)
    trainer = training.Trainer(args_div, plan_fn=_Planted(rank)(arguments.transformer_config_from_args(args_div), 4))
    trainer.train(2)
    t0 = time.perf_counter()
    try:
        trainer.train_step()
        out["divergence"] = ("no error", None, time.perf_counter() - t0)
    except PlanMismatchError as e:
        out["divergence"] = ("PlanMismatchError", str(e), time.perf_counter() - t0)
    # the world is still usable: every rank left the check together
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after_divergence_allreduce"] = float(t)

    # dp=2 x p=2: equality with stock, 10 steps
    hist_s, params_s, _ = _train(2, world, [], paradyse=False, steps=10)
    hist_p, params_p, _ = _train(2, world, [], paradyse=True, plan_fn_factory=_cycling_plan_fn, steps=10)
    out["dp2_stock"], out["dp2_paradyse"] = _summary(hist_s), _summary(hist_p)
    out["dp2_params"] = (params_s, params_p) if rank == 0 else None

    # padding: loss and gradient of a padded micro-batch equal those of its unpadded documents (TP=1)
    out["padding"] = _padding_check()
    dist.barrier()
    return out


def _exit_and_resume(world, ckpt_root):
    """A time-limited job: from the step-7 checkpoint, --exit-duration-in-mins (so short it is
    over after the first step) stops after iteration 8, saving; the run resumed from that with
    --exit-interval 9 stops after iteration 9, saving. Both exit cleanly."""
    from megatron_paradyse.training import checkpointing

    t0 = time.perf_counter()
    root = f"{ckpt_root}/exits"
    legs = []
    for extra in (["--load", f"{ckpt_root}/paradyse", "--ckpt-step", str(SAVE_AT), "--exit-duration-in-mins", "1e-9"],
                  ["--load", root, "--exit-interval", str(SAVE_AT + 2)]):
        lines = []
        hist, _, trainer = _train(4, world, extra + ["--save", root], paradyse=True,
                                  plan_fn_factory=_cycling_plan_fn, lines=lines)
        legs.append(dict(steps=_summary(hist), reason=trainer.exit_reason, tracker=checkpointing.read_tracker(root),
                         log=[x for x in lines if "exiting" in x or "saved checkpoint" in x]))
    return dict(legs=legs, seconds=time.perf_counter() - t0)


def _crash_during_save(trainer, root):
    """A save that dies after writing its data but before the rename leaves the last complete
    checkpoint as the latest; the next save removes the debris."""
    import copy

    from megatron.core import dist_checkpointing

    from megatron_paradyse.training import checkpointing

    args = copy.copy(trainer.args)
    args.save = args.load = root
    checkpointing.save_checkpoint(args, 20, trainer.model, trainer.optimizer, trainer.scheduler)
    real = dist_checkpointing.save

    def dying_save(sd, path, *a, **k):
        real(sd, path, *a, **k)
        raise RuntimeError("simulated crash")

    dist_checkpointing.save = dying_save
    try:
        checkpointing.save_checkpoint(args, 21, trainer.model, trainer.optimizer, trainer.scheduler)
        crashed = False
    except RuntimeError:
        crashed = True
    finally:
        dist_checkpointing.save = real
    after_crash = sorted(os.listdir(root))
    tracker = checkpointing.read_tracker(root)
    loaded = checkpointing.load_checkpoint(args, trainer.model, trainer.optimizer, trainer.scheduler)
    checkpointing.save_checkpoint(args, 22, trainer.model, trainer.optimizer, trainer.scheduler)
    return dict(crashed=crashed, after_crash=after_crash, tracker=tracker, loaded=loaded,
                after_next=sorted(os.listdir(root)))


def _padding_check():
    import megatron_paradyse as mp
    from megatron_paradyse import data
    from megatron_paradyse.training import arguments, trainer as training
    from megatron_paradyse.training import forward_step as hooks

    from megatron_paradyse.testing.models import init_megatron

    mp.uninstall()
    init_megatron(1)  # every rank: TP=1, nothing shared
    args = arguments.parse_args(_argv(1, []), world_size=1)
    config = arguments.transformer_config_from_args(args)
    model = training.build_model(args, config)
    ds = data.MockDataset(64, 128, seed=5, min_length=6)
    docs = [ds[i] for i in range(3)]
    mb = data.pad_to_multiple(docs, 8)

    def grads():
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    out = model(mb.tokens, mb.position_ids, None, labels=mb.labels)
    loss_sum, ntok, _ = hooks.loss_func(mb.loss_mask, out)
    (loss_sum / ntok).backward()
    g_pad, l_pad = grads(), float(loss_sum / ntok)
    model.zero_grad()
    total, count = 0.0, 0
    for d in docs:  # one document at a time, no padding at all
        one = data.pad_to_multiple([d], 1)
        o = model(one.tokens, one.position_ids, None, labels=one.labels)
        s, n, _ = hooks.loss_func(one.loss_mask, o)
        total, count = total + s, count + int(n)
    (total / count).backward()
    g_ref, l_ref = grads(), float(total / count)
    gerr = max(float((g_pad[k] - g_ref[k]).norm() / g_ref[k].norm().clamp_min(1e-30)) for k in g_ref)
    return dict(lengths=mb.lengths, padded=mb.seq_length, loss_pad=l_pad, loss_ref=l_ref,
                loss_rel=abs(l_pad - l_ref) / abs(l_ref), grad_rel=gerr, tokens=mb.num_tokens, count=count)


# ----------------------------------------------------------------------------- helpers


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def _param_rel(pa, pb):
    """Worst per-tensor relative error ||a - b|| / ||b|| over the final parameters.

    One slice is compared in the global norm only: the key part of ``linear_qkv.bias``. Its
    true gradient is exactly zero (softmax is invariant to adding ``q.b_k`` to every score of
    a query), so its gradient is rounding noise in any run, and Adam normalises that noise
    into steps of up to ``lr``: two stock runs that merely sum in another order differ there
    too. Every other tensor, including the query and value biases, must match to 1e-5.
    """
    import torch

    worst, num, den = 0.0, 0.0, 0.0
    for k in pb:
        a, b = pa[k], pb[k]
        num, den = num + float((a - b).norm() ** 2), den + float(b.norm() ** 2)
        if k.endswith("linear_qkv.bias"):
            a, b = a.view(4, 3, -1), b.view(4, 3, -1)  # [groups, (q, k, v), head_dim] of the test model
            keep = torch.tensor([0, 2])
            a, b = a[:, keep], b[:, keep]
        worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-30)))
    return max(worst, (num / den) ** 0.5)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    t0 = time.perf_counter()
    a = run_world(_world_a, 4, root, timeout=240)
    ta = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = run_world(_world_b, 4, root, timeout=240)
    tb = time.perf_counter() - t0
    print(f"\nworld A {ta:.1f} s, world B {tb:.1f} s")
    return a, b, root


def test_paradyse_training_equals_stock(worlds):
    a, _, _ = worlds
    r0 = a[0]
    stock, pd = r0["stock"], r0["paradyse"]
    assert len(stock) == len(pd) == STEPS
    # the plans really changed per step, per micro-batch and per layer
    plans = [p for step in pd for p in step["plans"]]
    assert all(p is not None for p in plans)
    assert len({p for p in plans}) > 1
    assert any(len(set(p)) > 1 for p in plans)
    assert len({step["plans"] for step in pd}) > 1
    # and so did the lengths (several padded lengths, padding present)
    lengths = {s for step in pd for s in step["s"]}
    assert len(lengths) > 3 and any(step["padded"] > step["tokens"] for step in pd)
    worst = max(_rel(x["loss"], y["loss"]) for x, y in zip(pd, stock))
    worst_gn = max(_rel(x["gn"], y["gn"]) for x, y in zip(pd, stock))
    prel = _param_rel(r0["paradyse_params"], r0["stock_params"])
    print(f"\np=4 {STEPS} steps: max rel loss err {worst:.2e}, grad-norm {worst_gn:.2e}, params {prel:.2e}; "
          f"stock {r0['stock_seconds']:.1f} s, paradyse {r0['paradyse_seconds']:.1f} s")
    print("\n".join(r0["log"][:6]))
    assert worst < 1e-5 and prel < 1e-5
    assert worst_gn < 1e-4
    # every rank saw the same losses (TP ranks replicate the loss)
    for r in a[1:]:
        assert [x["loss"] for x in r["paradyse"]] == [x["loss"] for x in pd]
    # loss decreased: the model trains
    assert pd[-1]["loss"] < pd[0]["loss"]


def test_planner_chooses_and_training_equals_stock(worlds):
    """--paradyse without --paradyse-plan: the planner picks each micro-batch's plan; losses equal stock's."""
    a, _, _ = worlds
    r0 = a[0]
    stock, pl = r0["stock"][:PLANNER_STEPS], r0["planned"]
    assert len(pl) == PLANNER_STEPS
    plans = [p for step in pl for p in step["plans"]]
    assert all(p is not None and len(p) == 4 for p in plans)
    assert len(set(plans)) > 1 and any(len(set(p)) > 1 for p in plans), plans  # chosen per length, mixed
    worst = max(_rel(x["loss"], y["loss"]) for x, y in zip(pl, stock))
    log = r0["planned_log"]
    print(f"\nplanner, p=4 {PLANNER_STEPS} steps: max rel loss err {worst:.2e} "
          f"({r0['planned_seconds']:.1f} s); plans {sorted(set(plans))}")
    print("\n".join(log[:4]))
    assert worst < 1e-5
    assert any("optimal planner" in line for line in log)
    steps = [line for line in log if "iteration" in line and "pred:" in line]
    assert len(steps) == PLANNER_STEPS and all("measured peak" in line for line in steps)
    # the refinement (all-reduced measured/predicted ratios) changed the planner's view, and
    # every rank still planned the same (one switching group)
    assert any("refinement v" in line and "refinement v0" not in line for line in steps)
    for r in a[1:]:
        assert [x["plans"] for x in r["planned"]] == [x["plans"] for x in pl]


def test_validation_equals_stock_and_stays_in_the_budget(worlds):
    """--eval-interval 5 --eval-iters 1: Megatron-LM's validation (at 5 and 10, then the
    validation and test sets after training) runs forward-only under the cycling plans and
    under the planner and equals stock's (fp32, rel < 1e-5); the planner's forward-only peak
    (planned as training steps) stays within its budget; the log has Megatron-LM's lines."""
    import math
    import re

    a, _, _ = worlds
    r0 = a[0]
    stock, pd, pl = r0["stock_eval"], r0["paradyse_eval"], r0["planned_eval"]
    prefixes = ["iteration 5", "iteration 10", f"iteration {STEPS} on validation set",
                f"iteration {STEPS} on test set"]
    assert [x[0] for x in stock["results"]] == prefixes == [x[0] for x in pd["results"]]
    assert [x[1] for x in stock["results"]] == ["validation"] * 3 + ["test"]
    assert [x[0] for x in pl["results"]] == prefixes[:2]
    worst = max(_rel(x[2], y[2]) for x, y in zip(pd["results"], stock["results"]))
    worst_pl = max(_rel(x[2], y[2]) for x, y in zip(pl["results"], stock["results"]))
    peaks = [(x[4], x[5]) for x in pl["results"]]
    seconds = sum(x[6] for x in stock["results"] + pd["results"] + pl["results"])
    print(f"\nvalidation: cycling plans max rel err {worst:.2e}, planner {worst_pl:.2e}; "
          f"forward-only peak/budget (MiB) {[(p / 2**20, b / 2**20) for p, b in peaks]}; "
          f"{len(stock['results'] + pd['results'] + pl['results'])} evaluations in {seconds:.1f} s")
    assert worst < 1e-5 and worst_pl < 1e-5
    assert all(x[4] is None for x in stock["results"] + pd["results"])  # measured with a planner only
    assert all(p is not None and 0 < p <= b for p, b in peaks)
    # the validation batches ran mixed plans (cycling; chosen by the planner)
    assert all(p is not None for p in pd["plans"] + pl["plans"])
    assert any(len(set(p)) > 1 for p in pd["plans"])
    for r in a[1:]:  # every rank reports the same validation losses
        assert [x[2] for x in r["paradyse_eval"]["results"]] == [x[2] for x in pd["results"]]
    log = r0["log"]
    for prefix, _, loss, ppl, *_ in pd["results"]:
        assert ppl == math.exp(loss)
        text = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        i = log.index(text)
        assert log[i - 1] == log[i + 1] == "-" * (len(text) + 1)
    assert all(re.fullmatch(r" validation loss at .* \| lm loss value: \S+ \| lm loss PPL: \S+ \| ", line)
               for line in log if "validation loss" in line)


def test_run_report_keeps_the_refinement(worlds):
    """--paradyse-run-report with the planner and --paradyse-refine on: every step is predicted,
    measured, fed to the refinement (its factors move, the same on every rank) and recorded.
    With --paradyse-memory-every 2 the second step runs without the memory tracker: its time
    (not its peak) is measured, learnt and the summary's time error; the others' peaks."""
    import json

    a, _, root = worlds
    rep = a[0]["reported"]
    print(f"\nreported run, {REPORTED_STEPS} steps ({rep['seconds']:.1f} s): refinement v{rep['version']} "
          f"after {rep['updates']} updates")
    print("\n".join(rep["log"][-2:]))
    assert rep["updates"] == REPORTED_STEPS and rep["version"] > 0
    state = rep["state"]
    assert any(abs(f - 1.0) > 1e-6 for f in state["time"] + state["mem"])
    for r in a[1:]:  # all-reduced: every rank holds the same factors and plans
        assert r["reported"]["state"] == state
        assert [x["plans"] for x in r["reported"]["steps"]] == [x["plans"] for x in rep["steps"]]
    steps = [line for line in rep["log"] if "lm loss" in line]
    assert len(steps) == REPORTED_STEPS
    assert all("time pred/meas" in line and "refinement v" in line for line in steps)
    assert ["peak pred/meas" in line for line in steps] == [True, False, True]
    assert ["(tracker)" in line for line in steps] == [True, False, True]
    assert "refinement v0" not in steps[-1]
    assert any(line.startswith("> run summary") for line in rep["log"])
    assert any("time" in line and "(the 1 steps without the memory tracker)" in line for line in rep["log"])
    assert any("measured on 2 of 3 steps" in line for line in rep["log"])
    with open(f"{root}/report/run_report.json") as fh:
        written = json.load(fh)["steps"]
    assert [s_["iteration"] for s_ in written] == list(range(1, REPORTED_STEPS + 1))
    assert [s_["tracked"] for s_ in written] == [True, False, True]
    assert all(s_["predicted_seconds"] > 0 and s_["predicted_peak_bytes"] > 0 for s_ in written)
    assert [s_["peak_bytes"] is not None and s_["peak_bytes"] > 0 for s_ in written] == [True, False, True]


def test_tensorboard_scalars_of_a_run(worlds):
    """--tensorboard-dir on the reported run: the last rank wrote an event file; TensorBoard's
    own reader finds Megatron-LM's tags and the plugin's, one point per step (the writer's
    tags in detail, validation and wandb: tests/test_scalars.py)."""
    from tests.test_scalars import read_scalars

    a, _, root = worlds
    got = read_scalars(f"{root}/tb")
    steps = list(range(1, REPORTED_STEPS + 1))
    for tag in ("lm loss", "learning-rate", "grad-norm", "batch-size", "throughput", "iteration-time",
                "paradyse/recompute-share", "paradyse/step-seconds/predicted",
                "paradyse/step-seconds/measured", "paradyse/peak-MiB/predicted", "paradyse/planner-seconds"):
        assert [s_ for s_, _ in got[tag]] == steps, tag
    assert [s_ for s_, _ in got["lm loss vs samples"]] == [4, 8, 12]  # consumed samples, batch 4
    assert [v for _, v in got["lm loss"]] == pytest.approx([x["loss"] for x in a[0]["reported"]["steps"]])
    assert [s_ for s_, _ in got["paradyse/peak-MiB/measured"]] == [1, 3]  # --paradyse-memory-every 2
    shares = [k for k in got if k.startswith("paradyse/strategy-share/")]
    assert shares and all(0 <= v <= 1 for k in shares for _, v in got[k])
    for i in range(REPORTED_STEPS):  # the shares of a step add up to one
        assert sum(got[k][i][1] for k in shares) == pytest.approx(1.0)


def test_resume_and_cross_loading(worlds):
    a, b, root = worlds
    full_pd, full_stock = a[0]["paradyse"], a[0]["stock"]
    assert os.path.isdir(os.path.join(root, "paradyse", f"iter_{SAVE_AT:07d}"))
    assert open(os.path.join(root, "paradyse", "latest_checkpointed_iteration.txt")).read().strip() == str(STEPS)
    assert not [n for n in os.listdir(os.path.join(root, "paradyse")) if n.endswith(".tmp")]
    res = b[0]["resume_pd_pd"]
    assert [x["it"] for x in res] == list(range(SAVE_AT + 1, STEPS + 1))
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(res, full_pd[SAVE_AT:])]
    print(f"\nresume ParaDySe->ParaDySe steps {SAVE_AT + 1}-{STEPS}: max |loss diff| {max(diffs):.3e}")
    # bitwise: the resumed run is the uninterrupted one, loss by loss and parameter by parameter
    assert [x["loss"] for x in res] == [y["loss"] for y in full_pd[SAVE_AT:]]
    assert [x["plans"] for x in res] == [x["plans"] for x in full_pd[SAVE_AT:]]
    got, want = b[0]["resume_pd_pd_params"], a[0]["paradyse_params"]
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k]) for k in want)
    for key, ref in (("resume_pd_stock", full_stock), ("resume_stock_pd", full_pd)):
        got = b[0][key]
        err = max(_rel(x["loss"], y["loss"]) for x, y in zip(got, ref[SAVE_AT:]))
        print(f"{key}: steps {SAVE_AT + 1}-{STEPS} max rel loss err vs uninterrupted {err:.2e}")
        assert [x["it"] for x in got] == list(range(SAVE_AT + 1, STEPS + 1))
        assert err < 1e-5


def test_exit_interval_and_duration_resume_exactly(worlds):
    """--exit-duration-in-mins and --exit-interval save, stop every rank at the same iteration
    and resume to the uninterrupted run's losses (ParaDySe's bitwise; stock's within 1e-5)."""
    a, b, _ = worlds
    full_pd, full_stock = a[0]["paradyse"], a[0]["stock"]
    legs = b[0]["exits"]["legs"]
    print(f"\nexit and resume, 2 runs of 1 step: {b[0]['exits']['seconds']:.1f} s")
    for r in b:  # every rank stopped after the same iteration
        assert [[x["it"] for x in leg["steps"]] for leg in r["exits"]["legs"]] == [[8], [9]]
    assert [leg["tracker"] for leg in legs] == [8, 9]
    assert "--exit-duration-in-mins 1e-09" in legs[0]["reason"] and "--exit-interval 9" in legs[1]["reason"]
    assert any(x.startswith("> exiting after") and "at iteration 8" in x and "resume with --load" in x
               for x in legs[0]["log"])
    assert any("saved checkpoint at iteration        9" in x for x in legs[1]["log"])
    got = [x for leg in legs for x in leg["steps"]]
    assert [x["loss"] for x in got] == [y["loss"] for y in full_pd[SAVE_AT:SAVE_AT + 2]]
    err = max(_rel(x["loss"], y["loss"]) for x, y in zip(got, full_stock[SAVE_AT:SAVE_AT + 2]))
    print(f"exit/resume steps {SAVE_AT + 1}-{SAVE_AT + 2}: max rel loss err vs uninterrupted stock {err:.2e}")
    assert err < 1e-5


def test_exit_check():
    """The exit decision alone (one process): the interval, the duration, SIGTERM."""
    import signal

    from megatron_paradyse.training.exits import ExitCheck

    assert ExitCheck().reason(5) is None
    assert [ExitCheck(exit_interval=3).reason(i) is not None for i in (1, 2, 3, 6)] == [False, False, True, True]
    assert ExitCheck(exit_duration_in_mins=1.0, start_time=time.time()).reason(1) is None
    assert "minutes" in ExitCheck(exit_duration_in_mins=1.0, start_time=time.time() - 61).reason(1)
    check = ExitCheck(signal_handler=True)
    before = signal.getsignal(signal.SIGTERM)
    with check.handling_signals():
        assert check.reason(1) is None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert "SIGTERM" in check.reason(2)
    assert signal.getsignal(signal.SIGTERM) is before


def test_interrupted_save_never_becomes_the_latest(worlds):
    _, b, _ = worlds
    c = b[0]["crash"]
    assert c["crashed"] and c["tracker"] == 20 and c["loaded"] == 20
    assert c["after_crash"] == ["iter_0000020", "iter_0000021.tmp", "latest_checkpointed_iteration.txt"]
    assert c["after_next"] == ["iter_0000020", "iter_0000022", "latest_checkpointed_iteration.txt"]


def test_divergent_plan_is_an_error_on_every_rank(worlds):
    _, b, _ = worlds
    for rank, r in enumerate(b):
        kind, msg, seconds = r["divergence"]
        assert kind == "PlanMismatchError", (rank, kind)
        assert "plan mismatch at iteration 2, micro-batch 1" in msg
        assert "rank 3" in msg and "rank 0" in msg
        assert seconds < 5.0
        assert r["after_divergence_allreduce"] == 4.0
    print(f"\ndivergence caught on all 4 ranks in {max(r['divergence'][2] for r in b) * 1000:.0f} ms (max):\n"
          + b[0]["divergence"][1])


def test_dp2_tp2_equals_stock(worlds):
    _, b, _ = worlds
    s, p = b[0]["dp2_stock"], b[0]["dp2_paradyse"]
    worst = max(_rel(x["loss"], y["loss"]) for x, y in zip(p, s))
    ps, pp = b[0]["dp2_params"]
    prel = _param_rel(pp, ps)
    print(f"\ndp=2 x p=2, 10 steps: max rel loss err {worst:.2e}, params {prel:.2e}")
    assert worst < 1e-5 and prel < 1e-5
    # the two replicas saw different micro-batches (different lengths) yet agree on the loss
    assert b[0]["dp2_paradyse"][0]["s"] != b[2]["dp2_paradyse"][0]["s"] or \
        any(x["s"] != y["s"] for x, y in zip(b[0]["dp2_paradyse"], b[2]["dp2_paradyse"]))
    assert [x["loss"] for x in b[2]["dp2_paradyse"]] == [x["loss"] for x in p]


def test_padding_keeps_loss_and_gradient(worlds):
    _, b, _ = worlds
    r = b[0]["padding"]
    print(f"\npadding {r['lengths']} -> {r['padded']}: loss rel err {r['loss_rel']:.2e}, grad rel err {r['grad_rel']:.2e}")
    assert r["padded"] % 8 == 0 and r["padded"] > min(r["lengths"])
    assert r["tokens"] == r["count"] == sum(r["lengths"])
    assert r["loss_rel"] < 1e-6 and r["grad_rel"] < 1e-5


# ----------------------------------------------------------------------------- local (no world)


def test_plan_parsing():
    from megatron_paradyse.parallel.plans import parse_plan

    assert parse_plan("tp_sp", 3)(100) == ("tp_sp",) * 3
    assert parse_plan("tp_sp,ulysses,ring", 3)(1) == ("tp_sp", "ulysses", "ring")
    assert parse_plan("tp_sp*2+ring", 3)(1) == ("tp_sp", "tp_sp", "ring")
    rule = parse_plan("rule:32=tp_sp,64=ulysses*1+ring*1,ring", 2)
    assert rule(32) == ("tp_sp", "tp_sp") and rule(33) == ("ulysses", "ring") and rule(65) == ("ring", "ring")
    assert rule.strategies() == ["ring", "tp_sp", "ulysses"]
    # recompute entries: the whole layer, or one of its blocks
    assert parse_plan("tp_sp:rc-mlp*2+ring:rc-attn+metp:rc", 4)(1) == (
        "tp_sp:rc-mlp", "tp_sp:rc-mlp", "ring:rc-attn", "metp:rc")
    from megatron_paradyse.parallel.plans import describe, make_entry, split_entry

    assert [split_entry(e) for e in ("ring", "ring:rc", "ring:rc-attn", "ring:rc-mlp")] == [
        ("ring", None), ("ring", "layer"), ("ring", "attn"), ("ring", "mlp")]
    assert [make_entry("ring", k) for k in (None, False, True, "layer", "attn", "mlp")] == [
        "ring", "ring", "ring:rc", "ring:rc", "ring:rc-attn", "ring:rc-mlp"]
    assert describe(("tp_sp:rc-mlp",) * 2 + ("ring",)) == "tp_sp:rc-mlp*2+ring*1"
    for bad, why in (("tp_sp*3", "has 3 layers"), ("nope", "unknown ParaDySe strategy"),
                     ("rule:64=tp_sp", "default"), ("rule:64=tp_sp,32=ring,ring", "ascending"),
                     ("tp_sp,ring", "has 2 layers"), ("tp_sp:rc-ffn", "rc-attn")):
        with pytest.raises(ValueError, match=why):
            parse_plan(bad, 4 if bad != "tp_sp,ring" else 3)


def test_bad_flags_fail_before_any_collective():
    from megatron_paradyse.training.arguments import ArgumentError, parse_args

    base = [a for a in BASE if a != "--sequence-parallel"]
    cases = [
        (base + ["--tensor-model-parallel-size", "4", "--train-iters", "2", "--paradyse"], 4, "--sequence-parallel"),
        (_argv(3, []), 4, "not divisible by --tensor-model-parallel-size"),
        (_argv(4, ["--paradyse", "--paradyse-plan", "tp_sp*3"]), 4, "has 3 layers"),
        (_argv(4, ["--global-batch-size", "6"]), 8, "global-batch-size"),
        (_argv(4, ["--paradyse", "--attention-dropout", "0.1"]), 4, "dropout"),
        (_argv(4, ["--bf16", "--distributed-backend", "gloo"]), 4, "bf16"),
        (_argv(4, ["--use-distributed-optimizer", "--distributed-backend", "gloo"]), 4, "distributed-optimizer"),
        ([a for a in _argv(4, []) if a != "--mock-data"], 4, "--mock-data"),
        (_argv(4, ["--paradyse", "--paradyse-memory-budget", "-1"]), 4, "must be positive"),
        (_argv(4, ["--paradyse", "--paradyse-cost-model", "cm.json"]), 4, "does not exist"),
        (_argv(4, ["--paradyse", "--paradyse-plan", "tp_sp", "--paradyse-planner", "optimal"]), 4,
         "give one or the other"),
        (_argv(4, ["--paradyse-gamma", "0.1"]), 4, "needs --paradyse"),
        (_argv(4, ["--exit-interval", "0"]), 4, "--exit-interval must be positive"),
        (_argv(4, ["--exit-duration-in-mins", "-1"]), 4, "--exit-duration-in-mins must be positive"),
        (_argv(2, ["--pipeline-model-parallel-size", "3"]), 6, "must be divisible by --pipeline-model-parallel-size"),
        (_argv(2, ["--pipeline-model-parallel-size", "2"]), 6, "not divisible by --tensor-model-parallel-size 2 x"),
        (_argv(2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                   "--global-batch-size", "2"]), 4, "micro-batches per replica and step, not a multiple of 2"),
        (_argv(2, ["--virtual-pipeline-model-parallel-size", "2"]), 4, "needs --pipeline-model-parallel-size > 1"),
        (_argv(2, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "4"]), 4,
         "must be divisible by --pipeline-model-parallel-size 2 x --virtual-pipeline-model-parallel-size 4"),
        (_argv(2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"]), 4,
         "must be a multiple of it"),
        (_argv(4, ["--split", "0,1,0"]), 4, "the training one above zero"),
        (_argv(4, ["--split", "90,x"]), 4, "--split '90,x'"),
        (_argv(4, ["--eval-iters", "-1"]), 4, "must be >= 0"),
    ]
    for argv, world, needle in cases:
        with pytest.raises(ArgumentError, match=needle.replace("-", r"\-")):
            parse_args(argv, world_size=world)
    args = parse_args(_argv(4, ["--paradyse"]), world_size=8)
    assert args.data_parallel_size == 2 and args.num_microbatches == 1 and args.paradyse_pad_multiple == 4
    args = parse_args(_argv(2, ["--paradyse", "--pipeline-model-parallel-size", "2"]), world_size=8)
    assert args.data_parallel_size == 2
    args = parse_args(_argv(2, ["--paradyse", "--pipeline-model-parallel-size", "2", "--paradyse-refine", "on",
                                "--num-layers-per-virtual-pipeline-stage", "1"]), world_size=4)
    assert args.paradyse_dims.vpp == 2 and args.virtual_pipeline_model_parallel_size == 2


def test_pad_to_multiple_and_data():
    import numpy as np
    import torch

    from megatron_paradyse import data

    mb = data.pad_to_multiple([np.arange(6), np.arange(11)], 4)
    assert mb.shape == (2, 12) and mb.lengths == (5, 10) and mb.num_tokens == 15
    assert mb.loss_mask[0].tolist() == [1] * 5 + [0] * 7
    assert torch.equal(mb.labels[1, :10], torch.arange(1, 11))
    ds = data.MockDataset(128, 100, seed=3, min_length=4)
    lens = [len(ds[i]) - 1 for i in range(400)]
    assert min(lens) >= 4 and max(lens) <= 128 and np.median(lens) < 40 and max(lens) > 100  # long tail
    assert all(np.array_equal(ds[i], data.MockDataset(128, 100, seed=3, min_length=4)[i]) for i in range(5))
    # Megatron's sampler order: rank r takes the r-th micro-batch of each round
    assert data.sample_indices(1, 1, 8, 2, 1, 2) == [8 + 6, 8 + 7]
    view = data.FixedLengthView(ds, 128)
    item = view[0]
    back = data.trim_to_multiple(item["tokens"][None], item["labels"][None], item["loss_mask"][None], 4)
    ref = data.pad_to_multiple([ds[0]], 4)
    assert torch.equal(back.tokens, ref.tokens) and back.num_tokens == ref.num_tokens


def test_indexed_document_dataset(tmp_path):
    import numpy as np

    from megatron_paradyse import data

    docs = [np.arange(n) % 50 for n in (3, 1, 40, 200, 7)]
    prefix = str(tmp_path / "docs")
    data.write_indexed_dataset(prefix, docs, 50)
    ds = data.DocumentDataset(prefix, seq_length=64, seed=0, shuffle=False)
    assert len(ds) == 4  # the 1-token document is skipped
    got = sorted(len(ds[i]) for i in range(4))
    assert got == [3, 7, 40, 65]  # truncated to seq_length + 1
    shuffled = data.DocumentDataset(prefix, seq_length=64, seed=0)
    assert sorted(len(shuffled[i]) for i in range(4, 8)) == got  # a second epoch, reshuffled

    # --split: megatron-core's parser and rounding over the documents; each split its own documents
    assert data.split_ranges("969, 30, 1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert data.split_ranges("60,40", 5) == [(0, 3), (3, 5), None]
    from megatron_paradyse.layout import DataConfig

    cfg = DataConfig(seq_length=64, vocab_size=50, seed=0, data_path=prefix, split="60,40")
    train, valid = data.build_dataset(cfg), data.build_dataset(cfg, split=1)
    assert sorted(train.sample_docs.tolist()) == [0, 2] and sorted(set(valid.sample_docs.tolist())) == [3, 4]
    assert data.build_dataset(cfg, split=2) is None  # no test split
    assert data.build_dataset(DataConfig(seq_length=64, vocab_size=50, data_path=prefix), split=1) is None
    mock = DataConfig(seq_length=64, vocab_size=50, seed=0)
    tr, va = data.build_dataset(mock), data.build_dataset(mock, split=1)
    assert tr[5].tolist() == data.MockDataset(64, 50, seed=0)[5].tolist()  # the training documents as before
    assert va[0].tolist() == data.MockDataset(64, 50, seed=0)[96900].tolist()
