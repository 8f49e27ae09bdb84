"""``python -m megatron_paradyse.check`` in its short CPU form (what CI runs of it): launched as a
user launches it, on 2 gloo ranks, every section; and its refusals of bad flags."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check(args, tmp_path, timeout=400):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "megatron_paradyse.check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_short_cpu_form_passes_every_section(tmp_path):
    out = tmp_path / "check.json"
    res = _check(["--backend", "gloo", "--nproc", "2", "--quick", "--out", str(out)], tmp_path)
    lines = json.loads(out.read_text())["lines"]
    by = {}
    for x in lines:
        by.setdefault(x["section"], []).append(x)
    assert set(by) == {"env", "comm", "kernels", "exactness", "timing", "profile", "training"}, res.stdout[-3000:]
    # five strategies and three mixed plans in fp32 (one recomputes layers); the mixes together
    # use every strategy
    exact = [x for x in by["exactness"] if x["name"].startswith("fp32")]
    assert len(exact) == 8 and any(":rc" in x["name"] for x in exact) and all(x["data"]["grad"] < 1e-5 for x in exact)
    mixed = [x["name"] for x in exact if "*" in x["name"]]
    assert all(any(n in m for m in mixed) for n in ("tp_sp", "ulysses", "ring", "colossal", "metp"))
    # timing lines are reported, not asserted (tests never judge speed); everything else passes
    judged = [x for x in lines if x["status"] != "INFO" and not x["name"].startswith("time at")]
    assert all(x["status"] == "PASS" for x in judged), [x for x in judged if x["status"] != "PASS"]
    assert any(x["name"].startswith("time at held-out") for x in by["profile"])
    # timing: every strategy at the quick lengths and on one pack, then the sanity line
    timed = [x for x in by["timing"] if "ms" in x["data"]]
    assert len(timed) == 5 * 3 and all(v > 0 for x in timed for v in x["data"]["ms"].values())
    assert by["timing"][-1]["name"] == "measurements" and any("pack" in x["name"] for x in timed)
    assert by["training"][0]["data"]["rows"] and "over" in by["training"][0]["detail"]
    # the comm section: every path against the host's values, two replicas' buckets in one order
    comm = {x["name"]: x for x in by["comm"]}
    assert comm["communicators"]["data"]["groups"] > 0
    assert [x["status"] for x in by["comm"] if x["name"] != "communicators"] == ["PASS"] * 6, by["comm"]
    assert "passed" in res.stdout and str(out) in res.stdout


def test_bad_flags_are_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    """The command's ``main`` (what ``python -m megatron_paradyse.check`` runs), in this process:
    one line and exit status 2, before anything is launched."""
    import pytest

    from megatron_paradyse.check.__main__ import main

    monkeypatch.chdir(tmp_path)
    for argv, needle in ((["--backend", "gloo", "--nproc", "2", "--num-attention-heads", "5"], "num-attention-heads"),
                         (["--backend", "gloo", "--sections", "exactness,nope"], "unknown section"),
                         (["--backend", "gloo", "--timing-seqs", "64,65"], "--timing-seqs"),
                         (["--backend", "gloo", "--no-such-flag"], "--no-such-flag")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and err.count("error:") == 1, err
    assert not (tmp_path / "runs").exists()  # nothing launched, nothing written
