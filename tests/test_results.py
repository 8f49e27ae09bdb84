"""``results/`` holds the measured runs; ``results/README.md`` indexes every one of them and
``results/index.json`` the numbers the top-level README quotes. Each number of the index is read
again here from the run file it names (a JSON value, a count of a check's lines, or a log's
line), so the index cannot drift from its runs.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"


def index() -> dict:
    return json.loads((RESULTS / "index.json").read_text())


def derive(entry: dict):
    """An index entry's number, read from its source file by its rule."""
    source = ROOT / entry["source"]
    if "regex" in entry:
        return float(re.findall(entry["regex"], source.read_text())[-1])
    data = json.loads(source.read_text())
    if "count_status" in entry:
        return float(sum(1 for line in data["lines"] if line["status"] == entry["count_status"]))
    for key in entry["path"]:
        data = data[key]
    value = float(data)
    if entry.get("unit") == "MiB":
        value /= 2 ** 20
    if entry.get("round") is not None:
        value = round(value, entry["round"])
    return value


def test_every_number_of_the_index_is_read_from_its_run():
    numbers = index()["numbers"]
    assert len(numbers) >= 10
    bad = []
    for name, entry in numbers.items():
        assert entry["source"].startswith("results/") and (ROOT / entry["source"]).is_file(), (name, entry["source"])
        got = derive(entry)
        if got != float(entry["value"]):
            bad.append(f"{name}: index {entry['value']}, {entry['source']} gives {got}")
    assert not bad, "\n".join(bad)


def test_the_readme_rows_name_numbers_of_the_index():
    idx = index()
    for row in idx["readme"]:
        assert row["numbers"] and all(n in idx["numbers"] for n in row["numbers"]), row
        assert (ROOT / row["run"]).exists(), row["run"]


def test_the_results_readme_indexes_every_run():
    """Every folder or file of a run directly under results/ (and under results/benchmark/,
    results/gpu/) is linked from results/README.md, and every link there resolves."""
    text = (RESULTS / "README.md").read_text()
    links = set(re.findall(r"\]\(([^)#\s]+)", text))
    for link in links:
        assert (RESULTS / link).exists(), f"results/README.md links a missing {link}"
    linked = {str((RESULTS / l).resolve()).rstrip("/") for l in links}
    runs = [p for p in RESULTS.iterdir() if p.name not in ("README.md", "index.json")]
    for group in ("benchmark", "gpu"):
        runs = [p for p in runs if p.name != group] + list((RESULTS / group).iterdir())
    missing = [str(p.relative_to(ROOT)) for p in runs if str(p.resolve()) not in linked]
    assert not missing, f"runs not in results/README.md: {missing}"
