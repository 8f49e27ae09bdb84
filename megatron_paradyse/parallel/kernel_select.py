"""Which attention kernel runs a call: gated by device capability, dtype and head size, tried in
order, with a logged fallback.

Each kernel family states what it can run (:data:`RULES`, from the kernels' own checks:
flash-attn 2.8.3 ``mha_fwd``/``mha_varlen_fwd`` and torch's vendored copy refuse sm < 80,
``head_dim % 8 != 0`` and ``head_dim > 256``; torch's memory-efficient kernel needs the head
dimension aligned to 16 bytes and bf16 needs sm >= 80). :func:`candidates` lists, in the
preferred order, the families that may run a tensor; a family that raises anyway (a check
this table does not know) is marked failed for that device, dtype and head size, logged once,
and the next is tried (:func:`run`). The last family of every list (``math`` on CUDA, the CPU
flash kernel then ``math`` on CPU) runs anything. Out-of-memory errors are never swallowed.

What a call runs also depends on the runtime options (``runtime.RuntimeOptions``: ``kernel``,
one family wherever its rules allow; :func:`only`), and the choices and failures are kept in
the registry's cache ``kernel_select`` (``runtime.cache``), not in this module.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import types

import torch

from .. import runtime

log = logging.getLogger(__name__)

FLASH_ATTN, TORCH_FLASH, TORCH_EFFICIENT, MATH, CPU_FLASH = (
    "flash-attn", "torch flash", "torch efficient", "math", "cpu flash")
ORDER_CUDA = (FLASH_ATTN, TORCH_FLASH, TORCH_EFFICIENT, MATH)
ORDER_CPU = (CPU_FLASH, MATH)
_HALF = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Call:
    """What gates a kernel: device type, compute capability (None: unknown), dtype, head size."""

    device: str
    capability: tuple | None
    dtype: torch.dtype
    head_dim: int

    def key(self) -> tuple:
        return (self.device, self.capability, self.dtype, self.head_dim)


def capability(device) -> tuple | None:
    """``(major, minor)`` of a CUDA device; None where it cannot be read (fake CUDA tensors on a
    CPU-only build): the capability rules are then not applied."""
    try:
        return tuple(torch.cuda.get_device_capability(device))
    except (AssertionError, RuntimeError):
        return None


def call_of(q) -> Call:
    cap = capability(q.device) if q.device.type == "cuda" else None
    return Call(q.device.type, cap, q.dtype, int(q.shape[-1]))


_CACHE = "kernel_select"  # the registry's cache of this module's state


def _state() -> dict:
    """``chosen``: (Call key, flash_attn, kernel option) -> candidates (every block call asks, the
    rules run once); ``failed``: (family, Call key) -> the error that made it fall back;
    ``logged``: the (family, Call key) skips logged once."""
    state = runtime.cache(_CACHE)
    if not state:
        state.update(chosen={}, failed={}, logged=set())
    return state


def _sm80(c: Call) -> str:
    return "" if c.capability is None or c.capability >= (8, 0) else f"sm {c.capability[0]}{c.capability[1]} < 80"


def _flash_rule(c: Call) -> str:
    if c.dtype not in _HALF:
        return f"{c.dtype} is not fp16/bf16"
    if c.head_dim % 8 or c.head_dim > 256:
        return f"head_dim {c.head_dim} is not a multiple of 8 up to 256"
    return _sm80(c)


def _efficient_rule(c: Call) -> str:
    align = 8 if c.dtype in _HALF else 4
    if c.dtype not in _HALF + (torch.float32,):
        return f"{c.dtype} is not fp32/fp16/bf16"
    if c.head_dim % align:
        return f"head_dim {c.head_dim} is not a multiple of {align} for {c.dtype}"
    if c.dtype == torch.bfloat16 and _sm80(c):
        return f"bf16 needs sm >= 80 ({_sm80(c)})"
    if c.capability is not None and c.capability < (5, 0):
        return f"sm {c.capability[0]}{c.capability[1]} < 50"
    return ""


RULES = types.MappingProxyType({FLASH_ATTN: _flash_rule, TORCH_FLASH: _flash_rule,
                                TORCH_EFFICIENT: _efficient_rule, MATH: lambda c: "", CPU_FLASH: lambda c: ""})


@contextlib.contextmanager
def only(family: str):
    """Inside, every call runs ``family`` where its rules allow it (the check runs each kernel
    the device takes, not just the first choice): the runtime options' ``kernel``."""
    with runtime.using(kernel=family):
        yield


def candidates(c: Call, flash_attn: bool) -> list:
    """The families that may run ``c``, in order (``flash_attn``: installed and turned on)."""
    chosen = _state()["chosen"]
    key = (c.key(), flash_attn, runtime.options().kernel)
    got = chosen.get(key)
    if got is None:
        got = chosen[key] = _candidates(c, flash_attn)
    return list(got)


def _candidates(c: Call, flash_attn: bool) -> list:
    order = ORDER_CPU if c.device == "cpu" else ORDER_CUDA
    only_family = runtime.options().kernel
    if only_family is not None:
        order = [f for f in order if f == only_family] or order
    failed = _state()["failed"]
    out = []
    for family in order:
        why = "not installed or turned off" if family == FLASH_ATTN and not flash_attn else RULES[family](c)
        why = why or failed.get((family, c.key()), "")
        if why:
            _log_skip(family, c, why)
        else:
            out.append(family)
    return out


def _log_skip(family: str, c: Call, why: str) -> None:
    if family == FLASH_ATTN and why == "not installed or turned off":
        return  # the usual case: torch's kernels, said once by the check's env section
    key, logged = (family, c.key()), _state()["logged"]
    if key not in logged:
        logged.add(key)
        log.info("attention kernel %s not used for %s %s head_dim %d: %s; falling back",
                 family, c.device, str(c.dtype).replace("torch.", ""), c.head_dim, why)


def run(c: Call, families: list, kernels: dict, *args):
    """``kernels[family](*args)`` for the first of ``families`` that runs; a family that raises
    (not for lack of memory) is marked failed for ``c``, logged, and the next one tried."""
    for i, family in enumerate(families):
        try:
            return kernels[family](*args)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError, NotImplementedError) as err:
            if i == len(families) - 1:
                raise
            state = _state()
            state["chosen"].clear()
            why = state["failed"][(family, c.key())] = \
                f"raised {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            log.warning("attention kernel %s failed for %s %s head_dim %d (%s); falling back to %s",
                        family, c.device, str(c.dtype).replace("torch.", ""), c.head_dim,
                        why, families[i + 1])
    raise RuntimeError(f"no attention kernel can run {c}")


def forget_failures() -> None:
    """Forget the families marked failed (tests; a new device)."""
    runtime.cache(_CACHE).clear()
