"""Per-micro-batch state is built once per micro-batch, not per layer or per METP head group
(#37 item 2): the tensors the plugin makes from host values during a packed micro-batch's
forward and backward (``torch.tensor`` / ``torch.as_tensor`` called from the plugin's code: on a
GPU each is a host-to-device copy) are counted, for models of 2 and 4 layers. The count must
not grow with the layers. Every strategy, at p = 2, on a pack whose documents cross ranks.
"""
import pytest

import megatron_paradyse as mp
from megatron_paradyse.testing.spawn import run_world

from .test_packed_exact import _pack, _params

LENGTHS = (3, 30, 1, 20, 10)
LAYERS = (2, 4)


def _counting():
    """Patch torch.tensor / torch.as_tensor to count calls made from megatron_paradyse's code."""
    import sys

    import torch

    seen = {"n": 0}
    real = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

    def wrap(fn):
        def call(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("megatron_paradyse."):
                seen["n"] += 1
            return fn(*args, **kwargs)
        return call
    for name, fn in real.items():
        setattr(torch, name, wrap(fn))
    return seen, lambda: [setattr(torch, n, f) for n, f in real.items()]


def _clear_layout_caches():
    """Start each count from empty layout caches (a layout, and its device tensors, is reused by
    later micro-batches with the same boundaries)."""
    from megatron_paradyse.parallel import context, pack_layout

    for fn in (pack_layout.packed_layout, context.inner_layout, context.joint_layout):
        fn.cache_clear()


def run_counts(rank, world, strategies):
    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    mp.install()
    counts = {}
    for layers in LAYERS:
        spec = T.TinyGPT(num_layers=layers, hidden_size=64, num_attention_heads=4)
        model = T.build_gpt(spec, world)
        tokens, labels, positions = _pack(LENGTHS, spec.vocab_size, 3)
        for name in strategies:
            mp.set_plan(model, name)
            _clear_layout_caches()
            for _ in range(2):  # two micro-batches: each its own PackedSeqParams
                seen, undo = _counting()
                try:
                    loss = model(tokens, positions, None, labels=labels, packed_seq_params=_params(LENGTHS))
                    loss.float().sum().backward()
                finally:
                    undo()
                counts.setdefault(name, []).append(seen["n"])
    return counts


@pytest.mark.parametrize("world", [2])
def test_host_built_tensors_per_micro_batch_do_not_grow_with_layers(world):
    strategies = list(mp.STRATEGIES)
    for counts in run_world(run_counts, world, strategies, timeout=300):
        for name, (a2, b2, a4, b4) in counts.items():
            # per micro-batch the same for 2 and 4 layers (a later one may find its layout cached)
            assert (a2, b2) == (a4, b4) and b2 <= a2 <= 2, (
                f"{name}: host-built tensors per micro-batch {counts[name]} (layers 2, 2, 4, 4)")
