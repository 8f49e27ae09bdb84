"""Megatron-LM's own, unmodified ``pretrain_gpt.py`` with ParaDySe: an entry point, no patch.

    torchrun --nproc-per-node 8 -m megatron_paradyse.training.megatron_lm \\
        /path/to/Megatron-LM/pretrain_gpt.py <Megatron-LM flags> \\
        --transformer-impl local --sequence-parallel --paradyse --paradyse-plan "rule:4096=tp_sp,ulysses"

(``--paradyse`` without ``--paradyse-plan``: the planner chooses each micro-batch's plan,
``--paradyse-memory-budget`` and the other planner flags as in ``pretrain_gpt_paradyse.py``.)

The entry point installs hooks into ``megatron.training`` and then runs the user's script
as ``__main__`` (its directory first on ``sys.path``, as ``python
script.py`` would). The hooks (:func:`install_hooks`, idempotent; the patches named
``megatron_lm`` of the registry, ``megatron_paradyse/runtime.py``):

* ``megatron.training.arguments.parse_args`` (and the copy ``initialize.py`` imported): the
  script's ``extra_args_provider`` (ModelOpt's, or none) is composed with
  :func:`add_megatron_lm_args`, so Megatron-LM parses the ``--paradyse*`` flags with its own.
* ``megatron.training.arguments.validate_args``: after Megatron-LM's own validation, the
  ParaDySe flags are checked (plan syntax and length, what each strategy supports for this
  model), locally on every rank, before any process group exists.
* ``megatron.training.pretrain``: the script's ``forward_step`` is wrapped by
  :func:`paradyse_forward_step` (stock when ``--paradyse`` is absent); its datasets provider
  is replaced by :func:`paradyse_datasets_provider` only with ``--paradyse-document-data``
  (one document per sample, variable lengths; for stock and ParaDySe runs alike).
* ``megatron.training.training.get_forward_backward_func``: with pipeline stages
  (``--pipeline-model-parallel-size``, 1F1B or the interleaved schedule over Megatron-LM's
  model chunks) and the plugin's forward step, each schedule call reads its micro-batches
  ahead on every stage (every chunk runs the same ones) and answers megatron's p2p shape
  exchange with their shapes (``schedule.py``).

The modules: ``entry.py`` (the entry points), ``hooks.py`` (the hooks), ``args.py`` (the
flags and their checks), ``providers.py`` (the forward step, datasets and model providers),
``iterator.py`` (the planned iterators), ``batches.py`` (reading a micro-batch: the TP
broadcast, with pipeline stages the first stage's over each pipeline group), ``schedule.py``
(pipeline stages: reading ahead, the p2p shapes).

With ``--context-parallel-size C`` and ``--paradyse`` (one sequence per row or packs; with or
without pipeline stages, ``--cp-comm-type p2p``) the plugin is installed in ``validate_args``, before the model is
built (megatron's local attention refuses CP when built; the strategies attend across CP ranks),
micro-batches are padded to a multiple of 2 x C x TP and each CP rank runs its two chunks
(megatron's ``get_batch_on_this_cp_rank`` order); docs/megatron_lm.md, "Context parallelism".

With ``--hybrid-context-parallel`` (or ``--dynamic-context-parallel``) and ``--paradyse`` the plugin
runs Dynamic CP (``dynamic_cp.py``): Megatron-LM's own is switched off after its validation, the
step's global batch is gathered over the data-parallel pool from Megatron-LM's sampler and
scheduled in rounds by the Dynamic CP planner (or the placeholder schedule under
``--paradyse-plan``), and the schedule runs the step's rounds; docs/megatron_lm.md, "Dynamic CP".

Without ``--paradyse`` (and without ``--paradyse-document-data``) the script runs exactly as
Megatron-LM ships it. With ``--distributed-backend gloo`` (Megatron-LM's default is nccl;
gloo without CUDA) :mod:`megatron_paradyse.cpu_compat_training` is applied first (CPU ranks;
this is how the repository tests it).

Tested on CPU gloo ranks against Megatron-LM's unmodified files at core_v0.16.1 (with
megatron-core 0.16.1) and core_v0.19.0 (with megatron-core 0.19.2); docs/megatron_lm.md says
what ran, on what. On one H100 (p = 1, NCCL): core_v0.16.1's script stock and with
``--paradyse`` gave equal losses (docs/gpu.md).
"""
from __future__ import annotations

from .args import add_megatron_lm_args, check_paradyse_args, compose_args_providers
from .entry import main, megatron_lm_main, megatron_training_available, run_script
from .hooks import install_hooks
from .providers import paradyse_datasets_provider, paradyse_forward_step, paradyse_model_provider

__all__ = ["add_megatron_lm_args", "check_paradyse_args", "compose_args_providers", "install_hooks",
           "main", "megatron_lm_main", "megatron_training_available", "paradyse_datasets_provider",
           "paradyse_forward_step", "paradyse_model_provider", "run_script"]
