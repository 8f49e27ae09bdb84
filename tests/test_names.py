"""No two classes of the package share a name (read with ``ast``, nothing imported): a class
name says which class it is, in docs, tracebacks and type hints, without its module."""
from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "megatron_paradyse"


def class_names(root: Path = ROOT) -> dict:
    """``{class name: [file:line, ...]}`` of every class defined under ``root`` (nested ones too)."""
    seen = collections.defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                seen[node.name].append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return seen


def test_no_two_classes_share_a_name():
    names = class_names()
    assert len(names) > 50  # the package's classes were found
    repeated = {name: where for name, where in names.items() if len(where) > 1}
    assert not repeated, f"class names defined more than once: {repeated}"


def test_a_repeated_name_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("class Links:\n    pass\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    class Links:\n        pass\n")
    assert class_names(pkg)["Links"] == ["pkg/a.py:1", "pkg/sub/b.py:2"]
