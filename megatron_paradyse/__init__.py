"""megatron_paradyse: per-batch, per-layer parallel-strategy switching for megatron-core (ParaDySe).

Usage::

    import megatron_paradyse as mp
    mp.install()                      # patch megatron.core; idempotent
    model = GPTModel(...)             # stock, tensor_model_parallel_size=p, sequence_parallel=True
    mp.set_plan(model, "ring")        # or one name per layer

Layers, each importing only those before it (``tests/test_layout.py`` checks):
``device`` (the process's device) <- ``model`` (the stock GPT builder) <- ``parallel``
(strategies, collectives, dispatch, plans) <- ``costmodel`` <- ``planner`` <- ``data``
(datasets, the length-aware sampler, micro-batches) <- ``training`` (trainers, Megatron-LM
hooks, checkpoints, arguments) <- ``check`` / ``bench`` (the node check, the benchmark).
Beside them, importing only ``device`` and one another: ``launch`` (spawning ranks),
``cpu_compat`` / ``cpu_compat_training`` (megatron-core / Megatron-LM on CPU gloo ranks),
``memory`` (peak memory of a region), ``norms`` (the sequence-parallel torch norm), ``paths``
and ``units``; ``plan`` is the command ``python -m megatron_paradyse.plan`` (``planner.cli``).
``testing`` holds the multi-rank harness and tiny models for the tests (and the CPU benchmark);
product code never imports it.
"""
from __future__ import annotations

from .parallel.dispatch import (check_model, get_plan, install, installed, set_plan, supports_model,
                                uninstall, unwrap)
from .parallel.plans import describe
from .parallel.strategies import REGISTRY, STRATEGIES, supports

__version__ = "0.1.0"

__all__ = ["install", "uninstall", "installed", "set_plan", "get_plan", "describe", "unwrap",
           "supports", "supports_model", "check_model", "STRATEGIES", "REGISTRY", "__version__"]
