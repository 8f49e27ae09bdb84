"""The multi-rank harness itself: results come back, failures carry tracebacks, hangs time out."""
import time

import pytest

from megatron_paradyse.testing.spawn import WorldError, run_world


def _echo(rank, world, base):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "sum": t.item() + base}


def _raise_on_rank_one(rank, world):
    import torch.distributed as dist

    if rank == 1:
        raise RuntimeError("planted failure on rank one")
    dist.barrier()  # the healthy rank blocks: the harness must still end the world
    return rank


def _hang_on_rank_zero(rank, world):
    import torch.distributed as dist

    if rank == 0:
        time.sleep(3600)
    dist.barrier()
    return rank


def test_results_come_back_per_rank():
    out = run_world(_echo, 3, 10.0, timeout=120)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["sum"] == 13.0 for o in out)


def test_failing_rank_reports_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(WorldError) as info:
        run_world(_raise_on_rank_one, 2, timeout=120, grace=3)
    msg = str(info.value)
    assert "rank 1 failed" in msg
    assert "planted failure on rank one" in msg and "Traceback" in msg
    assert time.monotonic() - t0 < 60


def test_hung_rank_fails_within_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorldError) as info:
        run_world(_hang_on_rank_zero, 2, timeout=6)
    elapsed = time.monotonic() - t0
    assert "did not finish" in str(info.value)
    assert elapsed < 30, elapsed


def _write_pid_and_sleep(rank, world, folder):
    import os
    import pathlib

    pathlib.Path(folder, f"rank{rank}").write_text(str(os.getpid()))
    time.sleep(3600)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may not reap orphans at once)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False


@pytest.mark.slow(reason="waits for orphaned ranks to notice their parent is gone")
def test_ranks_end_when_their_parent_is_killed(tmp_path):
    """A parent killed by SIGKILL runs no cleanup: its ranks notice and end themselves within
    seconds instead of computing on (a killed profile's ranks once did, beside the next one)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("from megatron_paradyse.launch import run_ranks\n"
            "from tests.test_harness import _write_pid_and_sleep\n"
            f"run_ranks(_write_pid_and_sleep, 2, {str(tmp_path)!r}, timeout=600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": root})
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("rank*"))) < 2 and time.monotonic() < deadline and parent.poll() is None:
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*")]
    parent.kill()
    parent.wait()
    assert len(pids) == 2, "the ranks did not start"
    deadline = time.monotonic() + 15
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [p for p in pids if _running(p)]
    for p in alive:  # do not leave them behind if the test fails
        os.kill(p, 9)
    assert not alive, f"ranks {alive} outlived their killed parent"


def _start_env(rank, world):
    import torch.distributed as dist

    with open("/proc/self/environ", "rb") as f:  # the environment the process was started with
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    # no rank leaves before every rank has connected: a rank that exits at once can close its
    # socket while a slower peer is still inside gloo's connectFullMesh (seen under load)
    dist.barrier()
    return env


def test_cpu_launcher_exports_the_allocator_settings():
    """torchrun's ranks get their environment from the launcher script, not from RANK_ENV: its
    defaults must be the allocator settings the shipped cost models were profiled with."""
    import os
    import re

    from megatron_paradyse.cpu_compat import ALLOCATOR_ENV

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "scripts", "pretrain_gpt_paradyse_cpu.sh")) as f:
        script = f.read()
    exported = dict(re.findall(r'(\w+)="\$\{\1:-([^}]*)\}"', script))
    assert {k: exported.get(k) for k in ALLOCATOR_ENV} == ALLOCATOR_ENV


def test_ranks_start_with_the_cpu_rank_environment():
    """torch reads THP_MEM_ALLOC_ENABLE at its first allocation: it must be there at exec."""
    import os

    from megatron_paradyse.cpu_compat import RANK_ENV

    before = os.environ.get("THP_MEM_ALLOC_ENABLE")
    out = run_world(_start_env, 2, timeout=120)
    want = {k.encode(): v.encode() for k, v in RANK_ENV.items()}
    assert RANK_ENV["THP_MEM_ALLOC_ENABLE"] == "1"
    for env in out:
        assert {k: env.get(k) for k in want} == want
    assert os.environ.get("THP_MEM_ALLOC_ENABLE") == before  # the parent's own is restored


def test_a_world_gloo_could_not_connect_starts_once_more(monkeypatch):
    """Only a world whose every failing rank failed inside ``init_process_group`` while gloo
    connected the ranks is started again, once; any other failure is raised at once."""
    from megatron_paradyse.testing import spawn

    connect = ("--- rank 0 failed ---\n  File x, in init_process_group\nRuntimeError: Gloo "
               f"{spawn.CONNECT_FAILED} with ... Connection closed by peer")
    calls, retried = [], []

    def fake(errors):
        def run_ranks(fn, n, *a, **k):
            calls.append(n)
            if errors:
                raise spawn.WorldError(errors.pop(0))
            return ["ok"] * n
        return run_ranks

    monkeypatch.setattr(spawn, "run_ranks", fake([connect]))
    assert spawn._ranks(None, 2, on_retry=lambda: retried.append(1)) == ["ok", "ok"]
    assert calls == [2, 2] and retried == [1]
    for other in (connect + "\n--- ranks [1] did not finish within the 5 s timeout; killed ---",
                  "--- rank 1 failed ---\nAssertionError: in the test", connect + "\n" + connect):
        calls.clear()
        monkeypatch.setattr(spawn, "run_ranks", fake([other, other]))
        with pytest.raises(spawn.WorldError):
            spawn._ranks(None, 2)
        assert calls == ([2] if "did not finish" in other or "Assertion" in other else [2, 2])
