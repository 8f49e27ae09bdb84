"""No module-level mutable state outside the registry and the allow-list below; no attribute of
megatron or torch replaced outside the registry but where :data:`DIRECT_PATCHES` says why.

The process's patches, runtime options and caches live in one object
(``megatron_paradyse/runtime.py``). Any other module-level holder of mutable state (a list,
dict or set; an instance of a mutable class defined in the module; a name annotated as a
list, dict or set; a ``global`` statement) must be named in :data:`ALLOWED` with the reason it
is there. Constant tables are better made immutable (tuples, ``types.MappingProxyType``) than
listed. Read with ``ast``; nothing is imported.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "megatron_paradyse"

_MUTABLE_CALLS = {"dict", "list", "set", "bytearray", "deque", "defaultdict", "OrderedDict", "Counter",
                  "local", "Queue", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}
_MUTABLE_NAMES = ("list", "dict", "set", "List", "Dict", "Set", "deque")
_LITERALS = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)

_TABLE = "a constant table, never mutated"
_FLAGS = "a constant list of command-line flags, concatenated into argv lists, never mutated"

# "path relative to megatron_paradyse/:NAME" -> why it may be module-level mutable state
ALLOWED = {
    "runtime.py:_REGISTRY": "the registry itself: the process's patches, runtime options and caches",
    # the process's own state, one value per process by nature
    "device.py:_CHOSEN": "the process's one device decision (select), made once",
    "memory.py:_RUN_PEAKS": "the CUDA allocator's peaks per device before its last reset (the run's peak)",
    "parallel/recompute.py:_STATE": "thread-local: the checkpoints running now on this thread",
    "parallel/groups.py:_STATE": "the weight communicators of this process's world (made collectively once per world)",
    "parallel/buffers.py:_WRITES": "async collectives still writing into pool buffers (waited for before reuse)",
    "parallel/megatron_state.py:_OWNER": "who made megatron's current parallel state (a state made again by its maker is torn down)",
    "parallel/megatron_state.py:_MADE": "the process groups megatron's current parallel state made (destroyed before the next)",
    "parallel/collectives.py:_READY": "the groups whose communicators exist (one all-reduce per group and process)",
    "parallel/dispatch.py:_VERIFIED_CALLS": "the count of set_plan(verify=True) calls: the call index the ranks compare",
    "parallel/prefetch.py:TRACE": "a test hook: None in runs; a test sets a list to record the gathers",
    "training/megatron_lm/iterator.py:_MEGATRON_ITERATORS": "Megatron-LM's data iterators wrapped, by id (Megatron-LM builds them, the hook finds them)",
    "training/megatron_lm/iterator.py:_MEGATRON_PLANNER": "the planner built at Megatron-LM's first step (its hooks have no object to hold it)",
    "training/megatron_lm/iterator.py:_EVAL_MICROBATCHES": "Megatron-LM's evaluation micro-batch count, read by its hooks",
    "training/dims.py:_KEPT": "the layout of a Megatron-LM namespace, by id (its checkpoints pickle the namespace, whose loader refuses a ParallelDims)",
    "training/megatron_lm/schedule.py:_SAID": "a log line said once per process",
    "planner/core.py:_WARNED": "warnings said once per process",
    "bench/host_time.py:QUIET": _TABLE,
    # constant tables and lists, left as literals (never mutated; lists concatenated into argv)
    "model.py:FUSION_SWITCHES": _TABLE, "training/arguments.py:_IGNORED": _TABLE,
    "parallel/strategies/registry.py:REGISTRY": "the strategy registry: one line per strategy file, never mutated at run time",
    "costmodel/measure.py:DEMO_DEFAULTS": _TABLE, "costmodel/report.py:DEFAULT_PLANS": _TABLE,
    "planner/build.py:KINDS": _TABLE, "planner/cli.py:SHAPE_FLAGS": _TABLE,
    "check/__main__.py:GPU_MODEL": _FLAGS, "check/__main__.py:CPU_MODEL": _FLAGS,
    "check/__main__.py:COMMON_MODEL": _FLAGS, "check/comm.py:BUCKET_ARGV": _FLAGS,
    "check/megatron_lm.py:RECOMPUTE": _FLAGS, "bench/host_time.py:STEP_ARGV": _FLAGS,
    "bench/report.py:KINDS": _TABLE, "bench/simulate.py:SAVED_FACTOR": _TABLE,
    "bench/simulate_cp.py:MODELS": _TABLE, "bench/simulate_cp.py:STOCK": _TABLE,
    "bench/simulate_cp.py:DCP_TEXT": _TABLE, "bench/simulate_cp.py:DYNAMIC": _TABLE,
    "bench/simulate_cp.py:NAMES": _TABLE, "bench/simulate_pipeline.py:NAMES": _TABLE,
    "bench/simulate_every_dim.py:NAMES": _TABLE,
    "bench/systems.py:STOCK_RECOMPUTE": _TABLE,
    "testing/spawn.py:PRELOAD": "the modules a spawned test rank imports first (tests only)",
}


def _callee(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)


def _immutable_class(node: ast.ClassDef) -> bool:
    """A frozen dataclass, a NamedTuple, an Enum or an exception: instances hold no changing state."""
    for d in node.decorator_list:
        if isinstance(d, ast.Call) and any(k.arg == "frozen" and getattr(k.value, "value", False) for k in d.keywords):
            return True
    bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
    return bool(bases & {"NamedTuple", "Enum", "IntEnum", "Exception", "RuntimeError", "ValueError"})


def _top_level(body) -> list:
    """Module-level statements, those inside module-level ``if`` / ``try`` / ``with`` included."""
    out = []
    for node in body:
        out.append(node)
        for field in ("body", "orelse", "finalbody", "handlers"):
            if isinstance(node, (ast.If, ast.Try, ast.With)) and hasattr(node, field):
                out += _top_level(getattr(node, field))
        if isinstance(node, ast.ExceptHandler):
            out += _top_level(node.body)
    return out


def mutable_state(root: Path = ROOT) -> dict:
    """``{"path:NAME": what}`` for every module-level holder of mutable state under ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        classes = {n.name: _immutable_class(n) for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in _top_level(tree.body):
            if isinstance(node, ast.Assign):
                targets, value, note = node.targets, node.value, None
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets, value, note = [node.target], node.value, None
                if isinstance(node, ast.AnnAssign) and any(
                        isinstance(n, ast.Name) and n.id in _MUTABLE_NAMES for n in ast.walk(node.annotation)):
                    note = "annotated " + ast.unparse(node.annotation)
            else:
                continue
            what = note
            if isinstance(value, _LITERALS):
                what = type(value).__name__.lower()
            elif isinstance(value, ast.Call):
                name = _callee(value)
                if name in _MUTABLE_CALLS:
                    what = f"{name}()"
                elif name in classes and not classes[name]:
                    what = f"instance of {name}"
            if what is None:
                continue
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name) and n.id != "__all__":
                        found[f"{rel}:{n.id}"] = what
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                for n in node.names:
                    found[f"{rel}:global {n}"] = "global statement"
    return found


def test_no_module_level_mutable_state_outside_the_registry_and_the_allow_list():
    found = mutable_state()
    assert len(found) > 10, "the scan found almost nothing: is it reading the package?"
    bad = sorted(f"{k} ({v})" for k, v in found.items() if k not in ALLOWED)
    assert not bad, ("module-level mutable state outside runtime.py's registry; move it there, make it "
                     "immutable (a tuple, types.MappingProxyType), or add it to ALLOWED with the reason:\n"
                     + "\n".join(bad))


def test_the_allow_list_has_no_stale_entry_and_says_why():
    found = mutable_state()
    stale = sorted(k for k in ALLOWED if k not in found)
    assert not stale, f"ALLOWED names state that is gone (remove them): {stale}"
    assert all(isinstance(v, str) and len(v) > 10 for v in ALLOWED.values())


def test_the_scan_sees_each_kind(tmp_path):
    (tmp_path / "m.py").write_text(
        "import collections\nclass C:\n    pass\n"
        "A = []\nB: list | None = None\nC_ = collections.deque()\nD = C()\nE = (1, 2)\n__all__ = ['x']\n"
        "def f():\n    global G\n")
    assert set(mutable_state(tmp_path)) == {"m.py:A", "m.py:B", "m.py:C_", "m.py:D", "m.py:global G"}


# Where the package may still assign attributes of megatron or torch directly (every other
# replacement is a patch of the registry, runtime.py): "path" for a whole module, or
# "path:target expression", with the reason.
DIRECT_PATCHES = {
    "runtime.py": "the registry itself applies and restores every patch",
    "cpu_compat.py": "the CPU shims: applied for good on CPU ranks only, listed in the registry (cpu_compat:<shim>)",
    "cpu_compat_training.py": "the Megatron-LM CPU shims: as cpu_compat.py (cpu_compat_training:<shim>)",
    "testing/spawn.py": "the test harness's fake torch.cuda.is_available (tests only, before anything runs)",
    "costmodel/measure.py:parallel_state._GLOBAL_MEMORY_BUFFER": "megatron's own global buffer made afresh, as megatron's initialisation makes it",
}


def direct_patches(root: Path = ROOT) -> dict:
    """``{"path:target": line}`` for every assignment, ``setattr`` or ``delattr`` on an attribute
    of a name imported from torch or megatron, anywhere in a module (functions included)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        names = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                names |= {(a.asname or a.name).split(".")[0] for a in n.names
                          if a.name.split(".")[0] in ("torch", "megatron")}
            elif isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] in ("torch", "megatron"):
                names |= {a.asname or a.name for a in n.names}

        def base(e):
            while isinstance(e, ast.Attribute):
                e = e.value
            return e.id if isinstance(e, ast.Name) else None

        for n in ast.walk(tree):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                n, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(e, ast.Attribute) and base(e) in names:
                        found[f"{rel}:{ast.unparse(e)}"] = n.lineno
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("setattr", "delattr") \
                    and n.args and base(n.args[0]) in names:
                found[f"{rel}:{n.func.id}({ast.unparse(n.args[0])})"] = n.lineno
    return found


def test_megatron_and_torch_are_patched_through_the_registry_only():
    found = direct_patches()
    bad = sorted(f"{k} (line {v})" for k, v in found.items()
                 if k not in DIRECT_PATCHES and k.split(":")[0] not in DIRECT_PATCHES)
    assert not bad, ("attributes of megatron or torch replaced outside the registry; make them "
                     "runtime.Patch(target, attribute, replacement) installed with runtime.install:\n"
                     + "\n".join(bad))
    stale = [k for k in DIRECT_PATCHES if ":" in k and k not in found]
    assert not stale, f"DIRECT_PATCHES names assignments that are gone (remove them): {stale}"
