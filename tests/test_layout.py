"""The package's dependencies point one way and form no cycle (read with ``ast``, nothing imported).

device <- model <- parallel <- costmodel <- planner <- data <- training <- check / bench: a
lower layer never imports a higher one, and product code (everything but ``bench``, the
CPU benchmark launcher) never imports the test helpers in ``testing``. Imports inside
functions count too: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = "megatron_paradyse"
ROOT = Path(__file__).resolve().parent.parent / PKG

# subpackage -> subpackages it must never import
FORBIDDEN = {
    "parallel": {"costmodel", "planner", "data", "training", "testing", "bench", "check"},
    "costmodel": {"planner", "data", "training", "testing", "bench", "check"},
    "planner": {"data", "training", "testing", "bench", "check"},
    "data": {"training", "testing", "bench", "check"},
    "training": {"testing", "bench", "check"},
    "check": {"testing", "bench"},
    "device": {"parallel", "costmodel", "planner", "data", "training", "testing", "bench", "check"},
    "model": {"parallel", "costmodel", "planner", "data", "training", "testing", "bench", "check"},
    "launch": {"parallel", "costmodel", "planner", "data", "training", "testing", "bench", "check"},
    "memory": {"model", "parallel", "costmodel", "planner", "data", "training", "testing", "bench", "check"},
    "norms": {"device", "model", "parallel", "costmodel", "planner", "data", "training", "testing", "bench",
              "check"},
    "paths": {"device", "model", "launch", "parallel", "costmodel", "planner", "data", "training",
              "testing", "bench", "check"},
    "units": {"device", "model", "launch", "memory", "norms", "paths", "parallel", "costmodel", "planner",
              "data", "training", "testing", "bench", "check"},
}


def _modules() -> dict:
    """Dotted module name -> path, for every .py file of the package."""
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict) -> set:
    """The package modules that module ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:  # `import a.b.c` depends on the deepest existing module
                t = t.rpartition(".")[0]
            if t.startswith(PKG) and t != name:
                out.add(t)
    return out


def _graph() -> dict:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _layer(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def test_dependencies_point_one_way():
    graph = _graph()
    assert len(graph) > 20 and f"{PKG}.parallel.dispatch" in graph
    bad = [f"{m} imports {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
           if _layer(t) in FORBIDDEN.get(_layer(m), ())]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_modules():
    """No strongly connected component of more than one module (Tarjan), package ``__init__``
    re-exports excluded: importing a submodule runs its parents' ``__init__`` by necessity."""
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in _graph().items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_no_committed_file_holds_an_absolute_path_of_a_machine():
    """Logs, JSON, profiles and docs record paths relative to the repository or the output
    folder (``megatron_paradyse.paths``); the tests, which build such paths on purpose, aside."""
    import re
    import subprocess

    root = ROOT.parent
    try:
        files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                               check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file
        files = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]
    pattern = re.compile(r"(/work/|/root/|/home/[a-z]|/tmp/[A-Za-z])")
    bad = []
    for name in files:
        if name.startswith("tests/") or name.endswith((".png", ".bin", ".idx")):
            continue
        try:
            text = (root / name).read_text(errors="ignore")
        except OSError:
            continue
        bad += [f"{name}: {m.group(0)}" for m in pattern.finditer(text)][:1]
    assert not bad, bad


def test_recorded_paths_are_relative():
    import os

    from megatron_paradyse.paths import recorded, shown, shown_argv

    here = os.getcwd()
    assert shown(os.path.join(here, "runs", "x")) == os.path.join("runs", "x")
    assert recorded("/elsewhere/out/p.jsonl") == os.path.join("...", "p.jsonl") and shown("rel") == "rel"
    assert shown_argv(["--out", os.path.join(here, "a"), "--x=/w/b", "-o", "/q/p.jsonl"]) == \
        "--out a --x=.../b -o .../p.jsonl"
