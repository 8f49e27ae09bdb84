"""megatron_paradyse: per-batch, per-layer parallel-strategy switching for megatron-core (ParaDySe).

Usage::

    import megatron_paradyse as mp
    mp.install()                      # patch megatron.core; idempotent
    model = GPTModel(...)             # stock, tensor_model_parallel_size=p, sequence_parallel=True
    mp.set_plan(model, "ring")        # or one name per layer
"""
from __future__ import annotations

from .patch import describe, get_plan, install, installed, set_plan, uninstall
from .strategies import REGISTRY, STRATEGIES, supports

__version__ = "0.1.0"

__all__ = ["install", "uninstall", "installed", "set_plan", "get_plan", "describe",
           "supports", "STRATEGIES", "REGISTRY", "__version__"]
