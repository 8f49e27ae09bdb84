"""TensorBoard / wandb scalars (training/scalars.py): Megatron-LM's tags read back with
TensorBoard's own reader, the plugin's paradyse/* shares, wandb through a stand-in module, the
refusals at start-up. The trainer writing them in a run: tests/test_training.py (world A's
reported run, test_tensorboard_scalars_of_a_run)."""
import sys
import types

import pytest

from megatron_paradyse.training.scalars import ScalarWriter, measure_scalars, plan_shares
from megatron_paradyse.training.trainer import StepStats

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--vocab-size", "128", "--mock-data", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]


def read_scalars(folder) -> dict:
    """``{tag: [(step, value), ...]}`` of the event files under ``folder``, by TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _stats(it, plans=(("tp_sp", "ring:rc", None, "tp_sp"), ("tp_sp",) * 4)):
    return StepStats(iteration=it, loss=2.5, grad_norm=0.75, lr=1e-3, seconds=0.5, tokens=1000,
                     padded_tokens=1024, seq_lengths=(64, 64), plans=plans)


def test_plan_shares():
    s = plan_shares([("tp_sp", "ring:rc", None, "metp:rc-mlp"), ("tp_sp",) * 4])
    assert s == {"paradyse/strategy-share/metp": 1 / 8, "paradyse/strategy-share/ring": 1 / 8,
                 "paradyse/strategy-share/stock": 1 / 8, "paradyse/strategy-share/tp_sp": 5 / 8,
                 "paradyse/recompute-share": 2 / 8}
    assert plan_shares([None, None]) == {}  # stock megatron: no plugin scalars


def test_measure_scalars():
    """Predicted beside measured: one switching group's (peak None: not measured this step), a
    pipeline's (the highest stage of each), none without a planner (the measured seconds)."""
    st = _stats(1)
    got = measure_scalars(dict(pred_seconds=0.4, pred_peak=3 * 2**20, peak=None), st)
    assert got == {"paradyse/step-seconds/measured": 0.5, "paradyse/step-seconds/predicted": 0.4,
                   "paradyse/peak-MiB/predicted": 3.0}
    pp = dict(pred_seconds=0.3, pred_stage_peaks=[2 * 2**20, 5 * 2**20], stage_peaks=[6 * 2**20, 1 * 2**20])
    got = measure_scalars(pp, st)
    assert got["paradyse/peak-MiB/predicted"] == 5.0 and got["paradyse/peak-MiB/measured"] == 6.0
    assert measure_scalars(None, st) == {"paradyse/step-seconds/measured": 0.5}


def test_writer_tags_read_back_by_tensorboard(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    w = ScalarWriter(SummaryWriter(str(tmp_path)), batch_size=4, timers=True, cp_size=2)
    measure = dict(pred_seconds=0.4, pred_peak=3 * 2**20, peak=4 * 2**20)
    w.step(_stats(1), measure, plan_seconds=0.01)
    w.step(_stats(2, plans=(("ulysses",) * 4,) * 2), dict(measure, peak=None), plan_seconds=0.02)
    w.validation(2, 2.0, 7.389)
    w.close()
    got = read_scalars(tmp_path)
    for tag in ("lm loss", "learning-rate", "grad-norm", "batch-size"):  # Megatron-LM's, both axes
        assert got[tag] == [(1, pytest.approx(got[tag][0][1])), (2, pytest.approx(got[tag][1][1]))]
        assert [s for s, _ in got[f"{tag} vs samples"]] == [4, 8]
    assert got["lm loss"][0][1] == pytest.approx(2.5) and got["batch-size"][0][1] == 4
    assert got["throughput"][0][1] == pytest.approx(2000) and got["iteration-time"][0][1] == pytest.approx(0.5)
    assert got["lm loss validation"] == [(2, pytest.approx(2.0))]
    assert got["lm loss validation ppl"] == [(2, pytest.approx(7.389))]
    assert got["lm loss validation vs samples"] == [(8, pytest.approx(2.0))]
    assert got["paradyse/strategy-share/tp_sp"] == [(1, pytest.approx(6 / 8)), (2, 0.0)]
    assert got["paradyse/strategy-share/ulysses"] == [(2, 1.0)]
    assert got["paradyse/recompute-share"] == [(1, pytest.approx(1 / 8)), (2, 0.0)]
    assert got["paradyse/step-seconds/predicted"][0][1] == pytest.approx(0.4)
    assert got["paradyse/step-seconds/measured"][0][1] == pytest.approx(0.5)
    assert got["paradyse/peak-MiB/predicted"][0][1] == pytest.approx(3.0)
    assert got["paradyse/peak-MiB/measured"] == [(1, pytest.approx(4.0))]  # step 2 not measured
    assert got["paradyse/planner-seconds"][1][1] == pytest.approx(0.02)
    assert got["paradyse/cp-size"][0][1] == 2
    assert "paradyse/strategy-share/tp_sp vs samples" not in got


def test_wandb_logs_the_same(monkeypatch, tmp_path):
    """--wandb-project with a stand-in ``wandb`` module: init as Megatron-LM calls it, the same
    scalars through wandb.log(values, step=iteration), finish at the end."""
    from megatron_paradyse.training import arguments

    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw))
    fake.log = lambda values, step=None: calls.append(("log", dict(values), step))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = arguments.parse_args(BASE + ["--wandb-project", "p", "--wandb-exp-name", "e",
                                        "--wandb-save-dir", str(tmp_path / "wb")], world_size=1)
    w = ScalarWriter.from_args(args, rank=0, world_size=1)
    assert ScalarWriter.from_args(args, rank=0, world_size=2) is None  # the last rank writes
    w.step(_stats(3))
    w.validation(3, 2.0, 7.389)
    w.close()
    assert calls[0][0] == "init" and calls[0][1]["project"] == "p" and calls[0][1]["name"] == "e"
    logged = {k: v for c in calls if c[0] == "log" for k, v in c[1].items()}
    assert {c[2] for c in calls if c[0] == "log"} == {3}
    for tag in ("lm loss", "learning-rate", "grad-norm", "batch-size", "throughput", "lm loss validation",
                "paradyse/strategy-share/tp_sp", "paradyse/recompute-share", "paradyse/step-seconds/measured"):
        assert tag in logged, tag
    assert calls[-1] == ("finish",)


@pytest.mark.parametrize("flags,missing,needle", [
    (["--tensorboard-dir", "tb"], "tensorboard", "needs the tensorboard package: pip install tensorboard"),
    (["--wandb-project", "p", "--wandb-exp-name", "e"], "wandb", "needs the wandb package: pip install wandb"),
])
def test_missing_package_is_refused_at_start(monkeypatch, tmp_path, flags, missing, needle):
    from megatron_paradyse.training.arguments import ArgumentError, parse_args

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    base = BASE
    with pytest.raises(ArgumentError, match=needle):
        parse_args(base + flags, world_size=1)
    if missing == "wandb":
        monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
        with pytest.raises(ArgumentError, match="--wandb-exp-name"):
            parse_args(base + ["--wandb-project", "p"], world_size=1)
