"""No function or method of the package, the benchmarks or the scripts is over 80 lines, counted
from its ``def`` line to the last line of its body (``ast``'s ``end_lineno``; decorators aside,
nested functions counted in the one holding them and again on their own)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 80


def _files() -> list:
    """The package's modules, the benchmarks' and the top-level scripts' Python files."""
    return (sorted((ROOT / "megatron_paradyse").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
            + sorted((ROOT / "scripts").glob("*.py")))


def long_functions(limit: int = LIMIT) -> list:
    """``path:line name (n lines)`` of every function longer than ``limit`` lines."""
    out = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_is_over_80_lines():
    assert len(_files()) > 50
    assert not long_functions(), "split these into short functions:\n" + "\n".join(long_functions())


def test_the_count():
    """A function of exactly ``LIMIT`` lines passes, one more fails (the counting itself)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT - 1))
    node = ast.parse(f"def f():\n{body}\n").body[0]
    assert node.end_lineno - node.lineno + 1 == LIMIT
