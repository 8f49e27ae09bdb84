"""megatron_paradyse: per-batch, per-layer parallel-strategy switching for megatron-core (ParaDySe).

Usage::

    import megatron_paradyse as mp
    mp.install()                      # patch megatron.core; idempotent
    model = GPTModel(...)             # stock, tensor_model_parallel_size=p, sequence_parallel=True
    mp.set_plan(model, "ring")        # or one name per layer

Subpackages, each depending only on those above it:
``parallel`` (strategies, collectives, dispatch, plans) <- ``costmodel`` / ``planner``
(planning) <- ``training`` (data, hooks, trainer, checkpoints, arguments); ``testing`` holds
the multi-rank harness and tiny models for tests and benchmarks.
"""
from __future__ import annotations

from .parallel.dispatch import (check_model, get_plan, install, installed, set_plan, supports_model,
                                uninstall, unwrap)
from .parallel.plans import describe
from .parallel.strategies import REGISTRY, STRATEGIES, supports

__version__ = "0.1.0"

__all__ = ["install", "uninstall", "installed", "set_plan", "get_plan", "describe", "unwrap",
           "supports", "supports_model", "check_model", "STRATEGIES", "REGISTRY", "__version__"]
