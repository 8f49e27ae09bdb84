"""A new user's first hour (issue 33): each command run as a user runs it, in a fresh working
directory (torchrun where a user would use it), checked for its exit status, its one line and
the absence of tracebacks from this package or megatron.

* no command loses work to a missing folder (profile, fit, report, the check under torchrun);
* every mistake is one line and exit status 2 before any work: bad flags (our launcher checks
  them before torchrun), a budget nothing fits (refused at start-up, under torchrun), a cost
  model truncated or for another shape, an empty tracker file, a corrupt ``.idx``, lengths the
  position embeddings cannot hold, ``plan``'s and ``report``'s mistakes;
* cost models say where they guess: ``fit`` refuses too few lengths, ``plan`` warns beyond the
  profiled range with the factor;
* defaults that run: the CPU launcher at NPROC=2 with ``--train-iters 4 --exit-interval 3``
  (saved and exited with status 0 after iteration 3; at NPROC=4:
  ``tests/test_readme.py`` runs the README's line), its defaults giving way to the user's
  ``--paradyse-plan`` and ``--lr-warmup-iters``, ``--mock-data`` cut to the longest length that
  fits, megatron's Transformer Engine / Apex notices filtered;
* Ctrl-C: one line naming the last complete checkpoint, no ``KeyboardInterrupt`` traceback.

Under torchrun the launcher (torchrun) itself still exits 1 and prints its own summary of
the failed workers (torchrun's behaviour for any failure); the tests check that every worker
exited with status 2 and that the summary names the one line.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "scripts", "pretrain_gpt_paradyse_cpu.sh")
MODELS = os.path.join(ROOT, "megatron_paradyse", "costmodel", "models")
TRAINER = os.path.join(ROOT, "pretrain_gpt_paradyse.py")
OUR_FRAME = re.compile(r'File ".*(megatron_paradyse|/megatron/|pretrain_gpt_paradyse)')
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
        "--seq-length", "256", "--max-position-embeddings", "256"]


def user_env(**extra) -> dict:
    """A user's environment: no warning filter of ours, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **extra})
    return env


def run(cmd, cwd, timeout=240, **env) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, cwd=cwd, env=user_env(**env), capture_output=True, text=True, timeout=timeout)
    res.out = res.stdout + res.stderr
    return res


def torchrun(n: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone"]


def no_traceback_of_ours(text: str) -> None:
    """No frame of this package, megatron or the trainer script (torchrun's own may be there)."""
    bad = [ln for ln in text.splitlines() if OUR_FRAME.search(ln) or "KeyboardInterrupt" in ln]
    assert not bad, "\n".join(bad[:10]) + "\n----\n" + text[-3000:]


def one_line(res, needle: str, prog: str = "", code: int = 2) -> str:
    """Exit status ``code``, exactly one ``PROG: error:`` line, holding ``needle``, and no
    traceback of ours (torchrun's summary, which repeats the line, is not counted)."""
    said = [ln for ln in res.out.splitlines() if re.match(rf"(\[rank \d+\] )?{re.escape(prog)}.*: error: ", ln)]
    assert res.returncode == code and len(said) == 1 and needle in said[0], (res.returncode, said, res.out[-3000:])
    no_traceback_of_ours(res.out)
    return said[0]


def torchrun_summary_names(res, needle: str) -> None:
    """torchrun failed (its status 1) because its workers exited with status 2 (or were
    stopped by it after the first did), and its summary names the one line as the cause."""
    assert res.returncode == 1 and re.search(r"exitcode\s*:\s*2 ", res.out), res.out[-3000:]
    assert re.search(r"traceback : .*: error: .*" + re.escape(needle[:40]), res.out), res.out[-3000:]


# ----------------------------------------------------------------------------- folders


def command(main, argv, capsys) -> subprocess.CompletedProcess:
    """``main(argv)``, the function ``python -m ...`` runs, in this process (its imports are
    paid once): its exit status and what it printed."""
    try:
        code = main(argv) or 0
    except SystemExit as e:
        code = e.code
    got = capsys.readouterr()
    res = subprocess.CompletedProcess(argv, code, got.out, got.err)
    res.out = got.out + got.err
    return res


@pytest.mark.slow(reason="each cost-model command's output folder and one-line mistakes, one subprocess each")
def test_costmodel_commands_make_their_folders_and_refuse_mistakes_in_one_line(tmp_path, monkeypatch, capsys):
    from megatron_paradyse.costmodel import fit, report
    from megatron_paradyse.planner import cli as plan

    prof = os.path.join(MODELS, "demo_p2.profile.jsonl")
    # profile as a user runs it, into a folder that does not exist yet (the pool rows: seconds),
    # with no warning of megatron's about Transformer Engine or Apex
    res = run([sys.executable, "-m", "megatron_paradyse.costmodel", "profile", "--p", "2", "--seqs", "128,256",
               "--pool-only", "-o", "runs/profile/pool.jsonl"], tmp_path)
    assert res.returncode == 0 and (tmp_path / "runs/profile/pool.jsonl").is_file(), res.out[-3000:]
    assert "Transformer Engine and Apex" not in res.out and "Apex is not installed" not in res.out
    monkeypatch.chdir(tmp_path)
    one_line(command(plan.main, ["--cost-model", "nope.json", "--seq-lens", "1k", "--memory-budget", "1"], capsys),
             "does not exist", "python -m megatron_paradyse.plan")
    # fit into a new folder; a profile of two lengths is refused with the minimum
    res = command(fit.main, [prof, "-o", "runs/model/m.json", "--fit-max-seq", "2048"], capsys)
    assert res.returncode == 0 and (tmp_path / "runs/model/m.json").is_file(), res.out[-3000:]
    rows = [json.loads(x) for x in open(prof)]
    two = [r for r in rows if r.get("s") in (None, 512, 1024) or r["type"] in ("header", "footer", "optimizer")]
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(r) + "\n" for r in two))
    one_line(command(fit.main, ["two.jsonl", "-o", "x/m.json"], capsys), "at least 3 per strategy",
             "python -m megatron_paradyse.costmodel fit")
    # report on the lengths the model was fitted on only (nothing held out), with and without
    # --png: one line, not a crash or an empty table
    fitted = [r for r in rows if r.get("s", 0) <= 2048]
    (tmp_path / "fitted.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fitted))
    for png in ([], ["--png", "plots/r.png"]):
        one_line(command(report.main, ["runs/model/m.json", "--profile", "fitted.jsonl"] + png, capsys),
                 "nothing to report")
    # a truncated profile; plan with a corrupt model, shape flags against the model
    (tmp_path / "cut.jsonl").write_text(open(prof).read()[:5000])
    one_line(command(fit.main, ["cut.jsonl", "-o", "y.json"], capsys), "truncated or corrupt")
    (tmp_path / "bad.json").write_text('{"format": "paradyse-costmodel/2", "sha')
    one_line(command(plan.main, ["--cost-model", "bad.json", "--seq-lens", "1k", "--memory-budget", "1"], capsys),
             "truncated or corrupt")
    one_line(command(plan.main, ["--cost-model", "runs/model/m.json", "--hidden-size", "256", "--seq-lens", "1k",
                                 "--memory-budget", "1"], capsys), "--hidden-size 256 (the model: 128)")
    # lengths beyond the profile: one warning with the factor
    res = command(plan.main, ["--cost-model", "runs/model/m.json", "--seq-lens", "1k,8k", "--memory-budget", "1"], capsys)
    assert res.returncode == 0 and res.stderr.count("4.0x the longest length the cost model m.json was fitted on (2048") == 1, res.out
    assert "Traceback" not in res.out


def test_bench_makes_its_folder_and_checks_it_first(tmp_path, monkeypatch, capsys):
    from megatron_paradyse.bench.__main__ import main as bench

    monkeypatch.chdir(tmp_path)
    res = command(bench, ["--simulate", "--quiet", "--out", "runs/bench"], capsys)
    assert res.returncode == 0 and (tmp_path / "runs/bench/simulation.json").is_file(), res.out[-3000:]
    (tmp_path / "afile").write_text("")
    one_line(command(bench, ["--out", "afile/bench"], capsys), "--out afile/bench: cannot write there",
             "python -m megatron_paradyse.bench")


def test_the_trainer_warns_once_beyond_the_profiled_lengths(caplog):
    """The shipped demo model (fitted up to 8192 tokens at p = 4) asked for --seq-length 65536."""
    import logging

    from megatron_paradyse.training.arguments import parse_args
    from megatron_paradyse.training.planning import planner_from_args

    argv = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "8", "--ffn-hidden-size", "512",
            "--vocab-size", "258", "--seq-length", "65536", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--tensor-model-parallel-size", "4",
            "--sequence-parallel", "--mock-data", "--paradyse", "--paradyse-memory-budget", "1"]
    caplog.set_level(logging.WARNING, logger="megatron_paradyse")
    logging.getLogger("megatron_paradyse").propagate = True
    planner_from_args(parse_args(argv, world_size=4))
    said = [r.getMessage() for r in caplog.records if "the longest length the cost model" in r.getMessage()]
    assert len(said) == 1 and "8.0x the longest length the cost model demo_p4.json was fitted on (8192" in said[0], said


@pytest.mark.slow(reason="the check inside the user's torchrun; tests/test_check.py runs the check's own launcher")
def test_the_check_under_torchrun_makes_its_folder(tmp_path):
    res = run(torchrun(2) + ["-m", "megatron_paradyse.check", "--backend", "gloo", "--sections", "env"], tmp_path,
              timeout=180)
    assert res.returncode == 0 and (tmp_path / "runs/check/check.json").is_file(), res.out[-3000:]
    lines = json.loads((tmp_path / "runs/check/check.json").read_text())["lines"]
    assert lines and all(x["section"] == "env" for x in lines)


# ----------------------------------------------------------------------------- the launcher and the trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The CPU launcher at NPROC=2 with its defaults and the user's --train-iters 4 (refused
    against the launcher's own warm-up before), a time-limited job: --exit-interval 3 saves a
    checkpoint after iteration 3 and exits cleanly."""
    d = tmp_path_factory.mktemp("launcher2")
    res = run(["bash", LAUNCHER, "--train-iters", "4", "--exit-interval", "3", "--save", "ck"], d, timeout=240,
              NPROC="2")
    return d, res


def test_the_cpu_launcher_defaults_train_at_two_ranks(trained):
    d, res = trained
    assert res.returncode == 0, res.out[-4000:]
    assert "iteration        3/       4" in res.out and (d / "ck" / "iter_0000003").is_dir()
    # --exit-interval 3: saved and exited with status 0 after iteration 3, every rank
    assert "> exiting at iteration 3 (--exit-interval 3)" in res.out and "iteration        4/" not in res.out
    assert not (d / "ck" / "iter_0000004").exists()
    # the budget fits only part of --seq-length: the mock documents were cut to it, no planning error
    assert re.search(r"--mock-data: documents of up to \d+ tokens, the longest sequence any plan fits", res.out)
    assert "Transformer Engine and Apex" not in res.out and "Apex is not installed" not in res.out
    no_traceback_of_ours(res.out)


def test_the_users_flags_replace_the_launchers_defaults(tmp_path):
    """The launcher's argv (``PYTHON=echo`` prints it: the flag check's line, then torchrun's):
    a plan of the user's drops the planner's flags, a warm-up in iterations the warm-up
    fraction; the flags it builds then pass validation at NPROC=4."""
    from megatron_paradyse.training.arguments import parse_args

    res = run(["bash", LAUNCHER, "--paradyse-plan", "ring,metp,tp_sp,ulysses", "--lr-warmup-iters", "1",
               "--train-iters", "3"], tmp_path, NPROC="4", PYTHON="echo")
    check, launch = res.stdout.splitlines()[-2:]
    assert res.returncode == 0 and "torch.distributed.run" in launch
    argv = check.split()[1:]
    assert "--paradyse-planner" not in argv and "--lr-warmup-fraction" not in argv and "--paradyse" in argv
    args = parse_args(argv, world_size=4)
    assert args.paradyse_plan == "ring,metp,tp_sp,ulysses" and args.lr_warmup_iters == 1 and args.train_iters == 3


def test_bad_flags_through_the_launcher_are_one_line_before_torchrun(tmp_path):
    res = run(["bash", LAUNCHER, "--no-such-flag", "1"], tmp_path, NPROC="2", timeout=120)
    one_line(res, "unrecognized arguments: --no-such-flag", "pretrain_gpt_paradyse.py")
    assert "torch.distributed" not in res.out  # torchrun never started


def _trainer_under_torchrun(cwd, extra, n=2, timeout=180):
    argv = TINY + ["--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--vocab-size", "128",
                   "--tensor-model-parallel-size", str(n), "--sequence-parallel", "--mock-data",
                   "--hidden-dropout", "0", "--attention-dropout", "0", "--distributed-backend", "gloo"]
    return run(torchrun(n) + [TRAINER] + argv + extra, cwd, timeout=timeout)


def test_a_budget_nothing_fits_is_refused_at_start_up_under_torchrun(tmp_path):
    res = _trainer_under_torchrun(tmp_path, ["--paradyse", "--paradyse-memory-budget", "0.0001"])
    line = one_line(res, "fits no micro-batch", "pretrain_gpt_paradyse.py", code=1)
    assert "the leanest uniform plan" in line and "GiB" in line and "iteration" not in res.stdout
    torchrun_summary_names(res, line.split(": error: ")[1])


@pytest.mark.slow(reason="an emptied checkpoint tracker under torchrun: one more launcher world")
def test_an_empty_tracker_is_one_line(trained, tmp_path):
    # the launcher's checkpoint with its tracker emptied: a user's mistake naming the file
    d, _ = trained
    ck = tmp_path / "ck"
    shutil.copytree(d / "ck", ck)
    (ck / "latest_checkpointed_iteration.txt").write_text("")
    res = run(["bash", LAUNCHER, "--train-iters", "4", "--load", "ck"], tmp_path, NPROC="2", timeout=240)
    line = one_line(res, "latest_checkpointed_iteration.txt should hold the last complete iteration",
                    "pretrain_gpt_paradyse.py", code=1)
    assert "the file is empty" in line


@pytest.mark.slow(reason="one more launcher world; the last complete checkpoint itself: "
                         "test_training.py::test_interrupted_save_never_becomes_the_latest")
def test_ctrl_c_names_the_last_complete_checkpoint(tmp_path):
    proc = subprocess.Popen(["bash", LAUNCHER, "--train-iters", "200", "--save", "ck", "--save-interval", "1"],
                            cwd=tmp_path, env=user_env(NPROC="2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    seen = []
    deadline = time.monotonic() + 180
    for line in proc.stdout:  # wait for a second checkpoint, then press Ctrl-C (the whole process group)
        seen.append(line)
        if "saved checkpoint at iteration        2" in line or time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(seen) + rest
    said = [ln for ln in out.splitlines() if "interrupted (Ctrl-C)" in ln]
    assert len(said) == 1, out[-4000:]
    from megatron_paradyse.training.checkpointing import read_tracker

    it = read_tracker(str(tmp_path / "ck"))
    assert it is not None and it >= 2
    assert f"the last complete checkpoint is ck/iter_{it:07d} (iteration {it}): resume with --load ck" in said[0]
    no_traceback_of_ours(out)


# ----------------------------------------------------------------------------- validation (in-process)


def test_mistakes_found_at_argument_validation(tmp_path):
    from megatron_paradyse.data import write_indexed_dataset
    from megatron_paradyse.errors import UserError
    from megatron_paradyse.training.arguments import parse_args

    base = TINY + ["--micro-batch-size", "1", "--train-iters", "3", "--lr", "1e-3", "--vocab-size", "128",
                   "--tensor-model-parallel-size", "2", "--sequence-parallel", "--hidden-dropout", "0",
                   "--attention-dropout", "0"]
    write_indexed_dataset(str(tmp_path / "d"), [list(range(50)), list(range(80))], 128)
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    (tmp_path / "bad.bin").write_bytes(b"")
    cut = tmp_path / "cut.json"
    cut.write_text(open(os.path.join(MODELS, "demo_p4.json")).read()[:300])
    cases = [
        (["--data-path", str(tmp_path / "bad")], "bad.idx is not a megatron-core index"),
        (["--data-path", str(tmp_path / "none")], "none.idx not found"),
        (["--mock-data", "--paradyse", "--paradyse-cost-model", str(cut)], "truncated or corrupt"),
        (["--mock-data", "--paradyse", "--paradyse-cost-model", os.path.join(MODELS, "demo_p2.json")],
         "was made for another model shape: num_layers: model 4 vs run 2"),
        (["--mock-data", "--seq-length", "255", "--position-embedding-type", "learned_absolute",
          "--max-position-embeddings", "255"], "give --max-position-embeddings 256"),
        (["--mock-data", "--lr-warmup-iters", "3"], "--lr-warmup-iters 3 must be below --lr-decay-iters 3"),
        (["--mock-data", "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "1"], "give one of"),
        (["--mock-data", "--save", str(tmp_path / "d.bin" / "ck")], "--save"),
    ]
    for extra, needle in cases:
        with pytest.raises(UserError, match=re.escape(needle)):
            parse_args(base + extra, world_size=2)
    args = parse_args(base + ["--data-path", str(tmp_path / "d"), "--lr-warmup-fraction", "0.1",
                              "--save", str(tmp_path / "new" / "ck"), "--paradyse-run-report",
                              str(tmp_path / "rep")], world_size=2)
    assert args.lr_warmup_fraction == 0.1 and (tmp_path / "new" / "ck").is_dir() and (tmp_path / "rep").is_dir()
