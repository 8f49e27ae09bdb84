"""Count the host stalls of a step: device-to-host reads and blocking host-to-device copies.

On a GPU, reading a device tensor's values on the host (``.item()``, ``.tolist()``, ``bool(t)``,
``.cpu()``) waits for every kernel queued before it; so does a host-to-device copy from
pageable memory (``torch.tensor(values, device="cuda")``). Between a step's first forward and
its optimizer step the plugin must do neither.

:class:`SyncCounter` is a ``TorchDispatchMode`` that records each such operation on a tensor of
the *device* under test (``device_type``: ``"cuda"`` for fake CUDA tensors, ``"meta"`` for a
model run on the meta device, which holds no data at all: any read of its values is a read
the GPU would stall for). A read is answered with zeros so that the run goes on and every
stall is counted, each with the innermost frames of the package or megatron that asked.
"""
from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _on(t, device_type: str) -> bool:
    return torch.is_tensor(t) and t.device.type == device_type


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-3]
              if "megatron_paradyse" in f.filename or "megatron/core" in f.filename]
    return " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))


def _short(path: str) -> str:
    for root in ("megatron_paradyse/", "megatron/core/"):
        if root in path:
            return root + path.rsplit(root, 1)[1]
    return path


class SyncCounter(TorchDispatchMode):
    """Records ``(kind, where)`` for each host stall on ``device_type`` tensors while active:
    ``"read"`` (a value read on the host: ``_local_scalar_dense``, a copy to the CPU) and
    ``"blocking copy"`` (a host-to-device copy without ``non_blocking``)."""

    def __init__(self, device_type: str = "meta"):
        super().__init__()
        self.device_type = device_type
        self.events: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = self.device_type
        if func is aten._local_scalar_dense.default and _on(args[0], dev):
            self.events.append(("read", _where()))
            return False if args[0].dtype == torch.bool else 0
        if func is aten._to_copy.default and _on(args[0], dev):
            target = kwargs.get("device")
            if target is not None and torch.device(target).type == "cpu":
                self.events.append(("read", _where()))
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if func is aten._to_copy.default and torch.is_tensor(args[0]) and args[0].device.type == "cpu":
            target = kwargs.get("device")
            if target is not None and torch.device(target).type == dev and not kwargs.get("non_blocking"):
                self.events.append(("blocking copy", _where()))
        if func is aten.copy_.default and _on(args[1], dev) and args[0].device.type == "cpu":
            self.events.append(("read", _where()))
            return args[0].zero_()
        if func is aten.copy_.default and _on(args[0], dev) and args[1].device.type == "cpu" \
                and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
            self.events.append(("blocking copy", _where()))
        return func(*args, **kwargs)

    def reads(self) -> list:
        return [w for k, w in self.events if k == "read"]

    def blocking_copies(self) -> list:
        return [w for k, w in self.events if k == "blocking copy"]
