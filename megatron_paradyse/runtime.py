"""The process's one place for what the plugin changes at run time: the patch registry, the
runtime options and the kernel caches.

Patches. Every attribute the plugin replaces in megatron-core or torch is a :class:`Patch`
(a target object, an attribute name, the replacement), installed under a name with
:func:`install` and put back with :func:`restore` / :func:`restore_all`; both are idempotent.
:func:`original` is what the attribute was before (the patched functions call it), and
:func:`installed` lists what is in place. The names used by the package:

* ``dispatch``: megatron's ``DotProductAttention.__init__``, the ``SelfAttention`` / ``MLP`` /
  ``TransformerLayer`` / ``GPTModel`` forwards (``parallel/dispatch.py``);
* ``recompute``: ``tensor_parallel.checkpoint`` (``parallel/recompute.py``);
* ``groups``: ``parallel_state.initialize_model_parallel`` (``parallel/groups.py``);
* ``grad_order``: ``DistributedDataParallel.__init__`` (``parallel/grad_order.py``);
* ``sp_norm``: ``WrappedTorchNorm.__new__`` builds the sequence-parallel torch norm
  (``norms.py``; the Megatron-LM entry point and the CPU shims);
* ``megatron_lm``: the Megatron-LM entry point's hooks into ``megatron.training``
  (``training/megatron_lm/hooks.py``);
* ``p2p_shapes``: ``P2PCommunicator._communicate_shapes`` (``training/p2p_shapes.py``);
* ``trace:<id>``: ``ProcessGroup``'s collectives and ``batch_isend_irecv`` while a
  ``trace.Recorder`` records;
* ``fake_collectives``: ``torch.distributed``'s collectives on the fake backend
  (``costmodel/measure.py``);
* ``checkpoint_results_queue``: megatron's ``filesystem_async._results_queue`` during a save
  (``training/checkpointing/save.py``);
* ``import_megatron``: ``torch.compile`` while megatron-core is imported (deferred to each
  compiled function's first call: :func:`import_megatron_core`);
* ``cpu_compat:<shim>`` / ``cpu_compat_training:<shim>``: the CPU shims, never restored (a
  CPU rank keeps them): recorded by name (:func:`mark`), their attributes not one by one.

Options. :class:`RuntimeOptions` is what a step's kernels read that is not in the plan: weight
prefetch, the attention kernel choice, determinism. The trainers build one from their flags
and pass it to :func:`set_options` before anything runs; :func:`options` is the current one,
:func:`using` changes fields for a block (the node check, tests).

Caches. :func:`cache` is a named dict kept here (the attention kernel choice and its
fallbacks, ``parallel/kernel_select.py``; a pipeline step's queued p2p shapes,
``training/p2p_shapes.py``), so that module-level state lives in one object.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Patch:
    """``setattr(target, attribute, replacement)`` while installed; the attribute as it was
    (or its absence) afterwards."""

    target: object
    attribute: str
    replacement: object

    def describe(self) -> str:
        t = self.target
        owner = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or type(t).__name__
        module = getattr(t, "__module__", None) if isinstance(t, type) else None
        return f"{module + '.' if module else ''}{owner}.{self.attribute}"


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """What the plugin's kernels read besides the plan; one object, built by the trainers.

    ``prefetch``: the ZeRO strategies' weight gathers prefetched (``parallel/prefetch.py``;
    ``--paradyse-no-prefetch`` turns it off). ``flash_attn``: flash-attn's kernels where
    installed (off: torch's kernels only). ``kernel``: one attention kernel family run wherever
    its rules allow (``parallel/kernel_select.py``; None: the default order). ``deterministic``:
    flash-attn's deterministic backward (None: torch's global setting,
    ``torch.are_deterministic_algorithms_enabled()``, which Megatron-LM's
    ``--deterministic-mode`` sets)."""

    prefetch: bool = True
    flash_attn: bool = True
    kernel: str | None = None
    deterministic: bool | None = None

    def is_deterministic(self) -> bool:
        if self.deterministic is not None:
            return self.deterministic
        import torch

        return torch.are_deterministic_algorithms_enabled()


class _Registry:
    """The process's patches (name -> :class:`_Installed`, in install order), options and caches."""

    def __init__(self):
        self.lock = threading.RLock()
        self.patches: dict = {}
        self.options = RuntimeOptions()
        self.caches: dict = {}


_REGISTRY = _Registry()


def _raw(target, attribute):
    """The attribute as the target itself holds it (a class's own ``__dict__`` entry: a
    staticmethod stays one, an inherited attribute is absent), else missing."""
    d = getattr(target, "__dict__", None)
    if d is not None:
        return d.get(attribute, _MISSING)
    return getattr(target, attribute, _MISSING)


class _Installed:
    """One name's patches as applied: ``(patch, raw attribute before)`` in order, and the
    originals by ``(target, attribute)``."""

    __slots__ = ("applied", "originals", "permanent")

    def __init__(self, permanent: tuple = ()):
        self.applied, self.originals, self.permanent = [], {}, permanent


def install(name: str, *patches: Patch) -> bool:
    """Apply ``patches`` in order under ``name``; nothing if ``name`` is installed already.
    Returns whether it applied them."""
    with _REGISTRY.lock:
        if name in _REGISTRY.patches:
            return False
        done = _Installed()
        try:
            for p in patches:
                before = _raw(p.target, p.attribute)
                done.originals.setdefault((p.target, p.attribute), getattr(p.target, p.attribute, None))
                setattr(p.target, p.attribute, p.replacement)
                done.applied.append((p, before))
        except BaseException:
            _put_back(done)
            raise
        _REGISTRY.patches[name] = done
        return True


def mark(name: str, *described: str) -> bool:
    """Record ``name`` as installed for good (patches applied by their owner and never restored:
    the CPU shims); ``described``: what they change. Returns False if it was recorded."""
    with _REGISTRY.lock:
        if name in _REGISTRY.patches:
            return False
        _REGISTRY.patches[name] = _Installed(permanent=tuple(described) or (name,))
        return True


def _put_back(done: _Installed) -> None:
    for p, before in reversed(done.applied):
        if before is _MISSING:
            try:
                delattr(p.target, p.attribute)
            except AttributeError:
                pass
        else:
            setattr(p.target, p.attribute, before)


def restore(name: str) -> bool:
    """Put back what ``name``'s patches replaced (reverse order); nothing if not installed.
    Names recorded with :func:`mark` stay. Returns whether anything was restored."""
    with _REGISTRY.lock:
        done = _REGISTRY.patches.get(name)
        if done is None or done.permanent:
            return False
        del _REGISTRY.patches[name]
        _put_back(done)
        return True


def restore_all() -> list:
    """Restore every restorable name, the last installed first; returns their names."""
    with _REGISTRY.lock:
        return [n for n in reversed(list(_REGISTRY.patches)) if restore(n)]


def is_installed(name: str) -> bool:
    return name in _REGISTRY.patches


def installed() -> dict:
    """``{name: [what each patch replaces, e.g. "megatron.core.transformer.mlp.MLP.forward"]}``
    in install order."""
    with _REGISTRY.lock:
        return {n: list(done.permanent) or [p.describe() for p, _ in done.applied]
                for n, done in _REGISTRY.patches.items()}


def original(name: str, target, attribute: str):
    """``target.attribute`` as it was before ``name`` patched it (KeyError if it did not)."""
    done = _REGISTRY.patches.get(name)
    if done is None or (target, attribute) not in done.originals:
        raise KeyError(f"{name!r} has not patched {attribute!r} of {target!r}")
    return done.originals[(target, attribute)]


# ---------------------------------------------------------------------------------- options

def options() -> RuntimeOptions:
    """The process's runtime options (defaults until a trainer sets them)."""
    return _REGISTRY.options


def set_options(opts: RuntimeOptions) -> RuntimeOptions:
    """Make ``opts`` the process's options; returns the previous ones."""
    if not isinstance(opts, RuntimeOptions):
        raise TypeError(f"RuntimeOptions expected, got {type(opts).__name__}")
    with _REGISTRY.lock:
        old, _REGISTRY.options = _REGISTRY.options, opts
    return old


@contextlib.contextmanager
def using(**changes):
    """``with using(prefetch=False): ...``: the options with ``changes`` inside, as before after."""
    old = set_options(dataclasses.replace(options(), **changes))
    try:
        yield options()
    finally:
        set_options(old)


# ----------------------------------------------------------------------------------- caches

def cache(name: str) -> dict:
    """The process's dict named ``name`` (made empty on first use)."""
    got = _REGISTRY.caches.get(name)
    if got is None:
        with _REGISTRY.lock:
            got = _REGISTRY.caches.setdefault(name, {})
    return got


# ------------------------------------------------------------------------ importing megatron

def _deferred_compile(compile_fn):
    """``torch.compile`` that compiles a plain function on its first call instead of at
    decoration: the compiled function is the same, but importing a module that decorates
    functions with it no longer imports torch's compiler stack (dynamo and inductor, seconds
    per process). Anything else (modules, other callables) goes to ``compile_fn`` at once."""
    import functools
    import inspect

    def deferred(fn=None, **kwargs):
        if fn is None:  # @torch.compile(mode=...)
            return lambda f: deferred(f, **kwargs)
        if not inspect.isfunction(fn):
            return compile_fn(fn, **kwargs)
        compiled = []

        @functools.wraps(fn)
        def call(*args, **kw):
            if not compiled:
                compiled.append(compile_fn(fn, **kwargs))
            return compiled[0](*args, **kw)
        return call
    return deferred


def import_megatron_core() -> None:
    """Import megatron-core with ``torch.compile`` deferred (patch ``import_megatron``, put back
    once it is imported): megatron binds its ``jit_fuser`` to ``torch.compile`` at import and
    decorates a dozen fusions with it, which imports torch's compiler stack in every process
    though a run with fusions off never calls one. Each fusion now compiles on its first call,
    as before. Nothing if megatron-core is imported already."""
    import sys

    if "megatron.core" in sys.modules:
        return
    import torch

    install("import_megatron", Patch(torch, "compile", _deferred_compile(torch.compile)))
    try:
        import megatron.core  # noqa: F401
    finally:
        restore("import_megatron")
