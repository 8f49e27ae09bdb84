"""The README fits a screen or two (at most 120 lines), its commands run as written, its numbers
are the results index's, and its flags table names every ``--paradyse*`` flag.

Every line of the README's ``bash`` blocks is a command (``\\`` continuations joined, trailing
``# comments`` dropped). A block runs here, in order, in a fresh clone of this repository
(``git clone`` of HEAD, the package's virtual environment active as after
``source .venv/bin/activate``), unless one of its commands needs what this machine lacks or
takes longer than a test may: GPUs or a Megatron-LM checkout (``torchrun``, ``/path/to``,
``<...>`` placeholders, the GPU check), the demo and the test suite themselves (run by CI and by
hand), or data of the user's (``my_docs``). Each command must exit 0 without a traceback.

Every measured number of the README stands in its "Measured" table, whose rows are, in order,
the ``readme`` rows of ``results/index.json``: each row's numbers (of its first two cells, in
order) must be the values of the index entries the row names, and its link the row's run
(``tests/test_results.py`` reads each value again from its run's files). Outside that table and
the code blocks no line may quote a measured-looking number (a ratio, a percentage, a pass
count, a time or a size), so that no number of the README can go stale unchecked.
"""
from __future__ import annotations

import json
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
    assert len(text.splitlines()) <= 120
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


NUMBER = re.compile(r"(?<![\w.\-])\d+(?:\.\d+)?")
MEASURED_LOOKING = re.compile(r"(?<![\w.\-])\d+(?:\.\d+)?(?:x\b|\s?%|\s(?:passed|failed|skipped)\b|"
                              r"\s?(?:ms|s|min|minutes|seconds|MiB|GiB|TFLOP/s)\b)")


def _measured_rows(text: str) -> list:
    """The rows of the README's "Measured" table: (cells, link target of the last cell)."""
    section = re.search(r"^## Measured\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "the README has no '## Measured' section"
    rows = []
    for line in section.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("what", "") or set(cells[0]) <= set("-"):
            continue
        link = re.search(r"\]\(([^)]+)\)", cells[2])
        rows.append((cells, link.group(1) if link else None))
    return rows


def readme_number_errors(text: str, index: dict) -> list:
    """Where the README's numbers differ from the results index (empty: they match)."""
    errors, rows, want = [], _measured_rows(text), index["readme"]
    if len(rows) != len(want):
        errors.append(f"the Measured table has {len(rows)} rows, results/index.json {len(want)}")
    for (cells, link), row in zip(rows, want):
        got = [float(n) for n in NUMBER.findall(cells[0] + " | " + cells[1])]
        expected = [float(index["numbers"][n]["value"]) for n in row["numbers"]]
        if got != expected:
            errors.append(f"{cells[0]!r}: the README says {got}, results/index.json {expected} ({row['numbers']})")
        if link != row["run"]:
            errors.append(f"{cells[0]!r}: links {link}, the index's run is {row['run']}")
    body = re.sub(r"```.*?```", "", text, flags=re.S)
    body = re.sub(r"^## Measured\n.*?(?=^## )", "", body, flags=re.S | re.M)
    for n, line in enumerate(body.splitlines(), 1):
        errors += [f"a measured-looking number outside the Measured table: {m.group(0)!r} in {line.strip()[:80]!r}"
                   for m in MEASURED_LOOKING.finditer(line)]
    return errors


def test_readme_numbers_are_the_results_index():
    text = open(os.path.join(ROOT, "README.md")).read()
    with open(os.path.join(ROOT, "results", "index.json")) as f:
        index = json.load(f)
    assert not readme_number_errors(text, index), "\n".join(readme_number_errors(text, index))
    # the check sees a changed number, two swapped rows and a number quoted elsewhere
    first = _measured_rows(text)[0][0][1]
    bumped = re.sub(r"\d+\.\d+", lambda m: f"{float(m.group(0)) + 0.01:.2f}", first, count=1)
    assert readme_number_errors(text.replace(first, bumped), index)
    rows = [" | ".join(cells) for cells, _ in _measured_rows(text)]
    swapped = text.replace(rows[2], "@@").replace(rows[3], rows[2]).replace("@@", rows[3])
    assert swapped != text and readme_number_errors(swapped, index)
    assert readme_number_errors(text.replace("## Two commands\n", "## Two commands\n\nIt is 1.9x faster.\n"), index)


def test_readme_flags_table_names_every_paradyse_flag():
    flags = set()
    for rel in ("megatron_paradyse/training/arguments.py", "megatron_paradyse/training/megatron_lm/args.py"):
        with open(os.path.join(ROOT, rel)) as f:
            flags |= set(re.findall(r"add_argument\(\s*\"(--paradyse[\w-]*)\"", f.read()))
    assert "--paradyse" in flags and "--paradyse-document-data" in flags and len(flags) > 20
    text = open(os.path.join(ROOT, "README.md")).read()
    table = {f for line in text.splitlines() if line.startswith("| `--paradyse")
             for f in re.findall(r"`(--paradyse[\w-]*)", re.split(r"(?<!\\)\|", line)[1])}
    assert flags == table, f"missing from the README's flags table: {sorted(flags - table)}; unknown: {sorted(table - flags)}"
