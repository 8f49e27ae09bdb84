"""The README fits a screen or two (at most 200 lines) and its commands run as written.

Every line of the README's ``bash`` blocks is a command (``\\`` continuations joined, trailing
``# comments`` dropped). A block runs here, in order, in a fresh clone of this repository
(``git clone`` of HEAD, the package's virtual environment active as after
``source .venv/bin/activate``), unless one of its commands needs what this machine lacks or
takes longer than a test may: GPUs or a Megatron-LM checkout (``torchrun``, ``/path/to``,
``<...>`` placeholders, the GPU check), the demo and the test suite themselves (run by CI and by
hand), or data of the user's (``my_docs``). Each command must exit 0 without a traceback.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_HERE = ("torchrun", "/path/to", "<your", "scripts/run_demo.sh", "scripts/run_tests.sh", "scripts/check.sh",
            "pip install", "my_docs")


def blocks(text: str) -> list:
    """The commands of each ```bash block (continuations joined, comments dropped)."""
    out = []
    for body in re.findall(r"```bash\n(.*?)```", text, re.S):
        cmds, cur = [], ""
        for line in body.splitlines():
            line = re.sub(r"\s+#.*$", "", line).rstrip()
            if line.endswith("\\"):
                cur += line[:-1] + " "
                continue
            cur += line
            if cur.strip():
                cmds.append(" ".join(cur.split()))
            cur = ""
        out.append(cmds)
    return out


def runnable(cmds: list) -> bool:
    return all(not any(k in c for k in NOT_HERE) for c in cmds)


def test_readme_fits_and_its_short_commands_run(tmp_path):
    text = open(os.path.join(ROOT, "README.md")).read()
    assert len(text.splitlines()) <= 200
    todo = [b for b in blocks(text) if runnable(b)]
    assert sum(len(b) for b in todo) >= 4, todo  # the "Try it" block at least
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", ROOT, str(clone)], check=True)
    venv = sys.prefix
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "PYTHON")}
    env.update(VIRTUAL_ENV=venv, PATH=os.path.join(venv, "bin") + os.pathsep + env.get("PATH", ""))
    for cmds in todo:
        for cmd in cmds:
            res = subprocess.run(["bash", "-c", cmd], cwd=clone, env=env, capture_output=True, text=True, timeout=300)
            out = res.stdout + res.stderr
            assert res.returncode == 0 and "Traceback" not in out, f"$ {cmd}\n{out[-3000:]}"
