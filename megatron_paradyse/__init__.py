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
and ``units``; ``runtime`` is the one place for what the plugin changes at run time (every
patch of megatron-core or torch, installed and restored by name; the ``RuntimeOptions`` the
trainers build: prefetch, attention kernels, determinism); ``plan`` is the command ``python -m megatron_paradyse.plan`` (``planner.cli``).
``testing`` holds the multi-rank harness and tiny models for the tests (and the CPU benchmark);
product code never imports it.
"""
from __future__ import annotations

import warnings

# megatron-core's own notices that it runs without Transformer Engine and Apex (four at import,
# more when a model is built, on every rank; both are optional and never installed on CPU),
# 0.19's that absl is missing, and 0.16's deprecation notice for its own default
# cuda_graph_scope ("full", warned at every TransformerConfig): matched exactly, in megatron's
# modules only, before anything imports megatron
for _msg in (r"Transformer Engine and Apex are not installed\. Falling back to ",
             r"Apex is not installed\. Falling back to Torch Norm",
             r"absl\.logging is not installed\. Using logging\.getLogger\(__name__\) instead\.",
             r"full scope is deprecated\. Use empty cuda_graph_scope to capture the whole layer\."):
    warnings.filterwarnings("ignore", message=_msg, category=UserWarning, module=r"megatron(\.|$)")

from .runtime import import_megatron_core  # noqa: E402

import_megatron_core()  # before any module of the package imports megatron (runtime.py: why)

from .parallel.dispatch import (check_model, get_plan, install, installed, set_plan, supports_model,  # noqa: E402
                                uninstall, unwrap)
from .parallel.plans import describe  # noqa: E402
from .parallel.strategies import REGISTRY, STRATEGIES, supports  # noqa: E402
from .runtime import RuntimeOptions  # noqa: E402

__version__ = "0.1.0"

__all__ = ["install", "uninstall", "installed", "set_plan", "get_plan", "describe", "unwrap",
           "supports", "supports_model", "check_model", "STRATEGIES", "REGISTRY", "RuntimeOptions",
           "__version__"]
