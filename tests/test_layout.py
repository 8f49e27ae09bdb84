"""The package's dependencies follow the layer table of ``megatron_paradyse/README.md`` (the one
statement of the rules; read with ``ast``, nothing imported) and form no cycle.

Each table row names a module or folder of the package and what of the package it may import
("nothing", a list, "every row above", "every row above but X", "except M" for a single
allowed module of an otherwise excluded folder). Every module of the package must belong to
a row. Imports inside functions count too: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = "megatron_paradyse"
ROOT = Path(__file__).resolve().parent.parent / PKG


def _rules() -> dict:
    """``{row: (allowed rows, allowed single modules)}`` from the README's layer table."""
    rows, order = {}, []
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`").removesuffix(".py").removesuffix("/")
        allowed, modules = set(), set()
        rule = cells[2]
        if rule.startswith("every row above"):
            allowed |= set(order)
            but = re.search(r"but (.*?)(?: except |$)", rule)
            if but:
                allowed -= set(re.findall(r"`([\w./]+)`", but.group(1)))
            extra = re.sub(r"every row above( but .*?(?= except |$))?", "", rule)
        else:
            extra = rule
        excepted = re.findall(r"except `([\w.]+)`", extra)
        modules |= {f"{PKG}.{m}" for m in excepted}
        extra = re.sub(r"except `[\w.]+`", "", extra)
        allowed |= {x.removesuffix(".py").removesuffix("/") for x in re.findall(r"`([\w./]+)`", extra)}
        rows[name] = (allowed, modules)
        order.append(name)
    return rows


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


def _layer(mod: str) -> str:
    """The table row of a package module: its folder or root module (``__init__`` for the package)."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_layer_table_is_complete_and_obeyed():
    rules, graph = _rules(), _graph()
    assert len(graph) > 20 and f"{PKG}.parallel.dispatch" in graph and len(rules) > 15
    missing = sorted({_layer(m) for m in graph} - set(rules))
    assert not missing, f"modules of no row in megatron_paradyse/README.md's layer table: {missing}"
    bad = []
    for mod, targets in sorted(graph.items()):
        layer = _layer(mod)
        allowed, modules = rules[layer]
        for t in sorted(targets):
            if _layer(t) != layer and _layer(t) not in allowed and t not in modules:
                bad.append(f"{mod} imports {t} (row {layer!r} may import {sorted(allowed) or 'nothing'})")
    assert not bad, "\n".join(bad)


def test_the_rules_as_read():
    """The table says what the READMEs promise: product code never imports testing/, the
    parallel layer nothing above it, and nothing but the entry points imports training/."""
    rules = _rules()
    product = [r for r in rules if r != "testing"]
    assert all("testing" not in rules[r][0] for r in product)
    assert rules["parallel"][0] == {"device", "units", "runtime", "layout"} and rules["units"][0] == set()
    assert [r for r in rules if "training" in rules[r][0]] == ["check", "bench"]
    assert rules["testing"][1] == {f"{PKG}.check.compare"} and "check" not in rules["testing"][0]


def test_no_import_cycle_between_modules():
    """No strongly connected component of more than one module (Tarjan), imports inside
    functions included. A module importing a name of its own package (``from . import
    build_planner`` in ``planner/x.py``) depends on that package's ``__init__``, which imports
    its modules to re-export them: that is a cycle too (a function-local import only hides
    it). Running a parent's ``__init__`` before a submodule, which Python does by necessity,
    is no edge: only import statements are."""
    graph = _graph()
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


def test_the_planner_package_init_only_re_exports():
    """``planner/__init__.py`` holds its docstring, imports and ``__all__``, nothing else: the
    code lives in its modules."""
    tree = ast.parse((ROOT / "planner" / "__init__.py").read_text())
    for node in tree.body:
        doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        names = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
        assert doc or names or isinstance(node, (ast.Import, ast.ImportFrom)), ast.dump(node)[:200]
def _args_violations() -> list:
    """Where a module of a row above ``training/`` in the layer table takes or reads the
    trainers' parsed flags (the ``argparse`` namespace, named ``args`` by both trainers).

    The rule, per function (methods and nested functions each on their own):

    * no parameter is named ``args``, unless the function also takes ``kwargs``: then ``args``
      are the positional arguments of a wrapped call (a dispatch hook, a worker's call);
    * ``args`` is read as a namespace (``args.x``, ``getattr``/``setattr``/``hasattr``/``vars``
      of it) only in a function that binds it itself from ``<parser>.parse_args(...)`` or
      ``parse_known_args(...)``: a module's own command line parsing its own argv keeps its
      namespace inside that function.
    """
    rows = list(_rules())
    below = set(rows[:rows.index("training")])
    bad = []
    for name, path in sorted(_modules().items()):
        if _layer(name) not in below:
            continue
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = fn.args
            params = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
            where = f"{path.relative_to(ROOT.parent)}:{fn.lineno} {fn.name}"
            if "args" in params and "kwargs" not in params and (a.kwarg is None or a.kwarg.arg != "kwargs"):
                bad.append(f"{where}: takes a parameter named args")
            body = [n for stmt in fn.body for n in ast.walk(stmt)]
            parses = any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "args"
                                                           for t in n.targets)
                         and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Attribute)
                         and n.value.func.attr in ("parse_args", "parse_known_args") for n in body)
            if parses:
                continue
            reads = [n.lineno for n in body
                     if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "args")
                     or (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                         and n.func.id in ("getattr", "setattr", "hasattr", "vars") and n.args
                         and isinstance(n.args[0], ast.Name) and n.args[0].id == "args")]
            if reads and ("args" in params or not parses):
                bad.append(f"{where}: reads args as a namespace (lines {sorted(set(reads))})")
    return bad


def test_no_args_below_training():
    """Below ``training/`` (the rows above it in the layer table: ``model.py``, ``parallel/``,
    ``costmodel/``, ``planner/``, ``data/``, ...) no function takes the trainers' parsed flags:
    the parallel layout arrives as ``layout.ParallelDims``, the data settings as
    ``layout.DataConfig``, the model as ``model.ModelFlags`` or a ``TransformerConfig``, the
    rest as explicit values (see :func:`_args_violations` for the rule as checked)."""
    bad = _args_violations()
    assert not bad, f"{len(bad)} functions below training/ take or read args:\n" + "\n".join(bad)


# ---------------------------------------------------------------- the README's structure counts

COUNTS = "## Structure counts"


def structure_counts() -> dict:
    """Per row of the layer table: ``(modules, lines, rows it imports)`` as the code has them."""
    rules, mods, graph = _rules(), _modules(), _graph()
    out = {}
    for row in rules:
        names = [m for m in mods if _layer(m) == row]
        lines = sum(len(mods[m].read_text().splitlines()) for m in names)
        uses = {_layer(t) for m in names for t in graph[m]} - {row}
        out[row] = (len(names), lines, tuple(r for r in rules if r in uses))
    return out


def counts_markdown() -> str:
    """The README's table of :func:`structure_counts` (``python tests/test_layout.py`` prints it)."""
    rows = ["| row | modules | lines | imports from the package |", "|---|---|---|---|"]
    for row, (n, lines, uses) in structure_counts().items():
        shown = ", ".join(f"`{u}`" for u in uses) or "nothing"
        rows.append(f"| {row} | {n} | {lines} | {shown} |")
    return "\n".join(rows)


def _readme_counts() -> dict:
    text = (ROOT / "README.md").read_text()
    assert COUNTS in text, f"megatron_paradyse/README.md has no {COUNTS!r} section"
    out = {}
    for line in text.split(COUNTS, 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].isdigit():
            uses = tuple(re.findall(r"`([\w.]+)`", cells[3]))
            out[cells[0]] = (int(cells[1]), int(cells[2]), uses)
    return out


def test_the_structure_counts_are_current():
    """The package README's structure counts hold: per row, its modules and the rows it imports
    exactly, its lines within 10% (regenerate the table with ``python tests/test_layout.py``)."""
    have, said = structure_counts(), _readme_counts()
    assert set(said) == set(have), f"rows: README {sorted(said)} vs code {sorted(have)}"
    bad = [f"{row}: README {said[row]} vs code {have[row]}" for row in have
           if said[row][0] != have[row][0] or said[row][2] != have[row][2]
           or abs(said[row][1] - have[row][1]) > 0.1 * have[row][1]]
    assert not bad, "the structure counts are stale (python tests/test_layout.py prints them):\n" + "\n".join(bad)


if __name__ == "__main__":
    print(counts_markdown())
