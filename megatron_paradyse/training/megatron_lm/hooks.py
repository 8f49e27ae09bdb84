"""The hooks into ``megatron.training``: ``parse_args`` and ``validate_args`` (the plugin's flags
and their checks), ``pretrain`` (the forward step and datasets providers),
``get_forward_backward_func`` (pipeline stages: ``schedule.py``), and megatron-core's
``compile_helpers`` where the compiled module ships; installed and removed together."""
from __future__ import annotations

import torch

from ... import runtime
from ...parallel.dispatch import install
from ..arguments import ArgumentError
from ..dims import runtime_options
from .args import check_dynamic_cp_early, check_paradyse_args, compose_args_providers
from .providers import paradyse_datasets_provider, paradyse_forward_step
from .schedule import wrap_get_forward_backward_func

_NAME = "megatron_lm"  # the registry's name of the hooks (``runtime.py``)


def _wrap_parse_args(orig):
    """``parse_args`` with the script's ``extra_args_provider`` composed with the plugin's flags."""
    def parse_args(extra_args_provider=None, *args, **kwargs):
        return orig(compose_args_providers(extra_args_provider), *args, **kwargs)

    parse_args._paradyse = True
    return parse_args


def _wrap_validate_args(orig):
    """``validate_args`` followed by :func:`check_paradyse_args` (its ``ValueError`` a user's
    mistake: one line, exit status 2, through the entry point's ``exit_on_user_error``). With
    ``--paradyse`` the plugin is installed here, before Megatron-LM's model provider builds the
    model: with context parallelism megatron's local ``DotProductAttention`` is built through the
    plugin's patch (stock asserts CP = 1 when built; the strategies attend across CP ranks)."""
    def validate_args(args, *rest, **kwargs):
        try:
            check_dynamic_cp_early(args)  # before Megatron-LM's assertions on --hybrid-context-parallel
        except ValueError as e:
            raise ArgumentError(str(e)) from None
        out = orig(args, *rest, **kwargs)
        try:
            check_paradyse_args(args)
        except ArgumentError:
            raise
        except ValueError as e:
            raise ArgumentError(str(e)) from None
        if getattr(args, "paradyse", False):
            install()
        runtime.set_options(runtime_options(args))  # prefetch, kernels, determinism
        return out

    validate_args._paradyse = True
    return validate_args


def _wrap_pretrain(orig):
    """``pretrain`` with ParaDySe's forward step and, with ``--paradyse-document-data``, datasets."""
    def pretrain(*args, **kwargs):
        args = list(args)
        # 0.16: pretrain(datasets_provider, model_provider, model_type, forward_step, ...);
        # 0.19: pretrain(full_config, datasets_provider, model_type, forward_step, ...).
        ds_index = 0 if callable(args[0]) else 1
        ds = args[ds_index]

        def datasets_provider(*a, vp_stage=None, **k):  # vp_stage: Megatron-LM asserts the keyword (V > 1)
            from megatron.training import get_args

            if vp_stage is not None:
                k["vp_stage"] = vp_stage
            if getattr(get_args(), "paradyse_document_data", False):
                return paradyse_datasets_provider(*a, **k)
            return ds(*a, **k)

        datasets_provider.is_distributed = True  # ours is; the script's sets it too
        args[ds_index] = datasets_provider
        if "forward_step_func" in kwargs:
            kwargs["forward_step_func"] = paradyse_forward_step(kwargs["forward_step_func"])
        else:
            args[3] = paradyse_forward_step(args[3])
        return orig(*args, **kwargs)

    pretrain._paradyse = True
    return pretrain


def _prebuilt_dataset_helpers() -> list:
    """megatron-core's pip wheel ships ``datasets/helpers_cpp`` compiled, without the Makefile
    that ``compile_helpers`` (called by Megatron-LM's ``initialize_megatron`` on rank 0) runs:
    with a wheel's megatron-core, ``make`` fails and Megatron-LM exits. Skip the build when the
    compiled module already imports (a source checkout keeps its own ``make``)."""
    from megatron.core.datasets import utils as dutils

    if getattr(dutils.compile_helpers, "_paradyse", False):
        return []
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return []

    def compile_helpers():
        return None

    compile_helpers._paradyse = True
    return [runtime.Patch(dutils, "compile_helpers", compile_helpers)]


def _wrap_init_process_group(orig):
    """``torch.distributed.init_process_group`` with this rank's GPU as ``device_id`` under NCCL
    (Megatron-LM computes it but does not pass it): the default communicator is created at once
    and megatron's groups are split from it, sharing its resources (``parallel/communicators.py``
    then creates them all, before the budget is measured)."""
    def init_process_group(*args, **kwargs):
        backend = kwargs.get("backend", args[0] if args else None)
        if str(backend).startswith("nccl") and kwargs.get("device_id") is None and torch.cuda.is_available():
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        return orig(*args, **kwargs)

    init_process_group._paradyse = True
    return init_process_group


def install_hooks() -> None:
    """Install the hooks into ``megatron.training`` (idempotent; the registry's patches named
    ``megatron_lm``, ``runtime.py``). Needs ``megatron.training``."""
    if runtime.is_installed(_NAME):
        return
    patches = _prebuilt_dataset_helpers()
    import megatron.training as mt
    from megatron.training import arguments, initialize, training

    for mod in (arguments, initialize):
        if hasattr(mod, "parse_args"):
            patches.append(runtime.Patch(mod, "parse_args", _wrap_parse_args(mod.parse_args)))
        if hasattr(mod, "validate_args"):
            patches.append(runtime.Patch(mod, "validate_args", _wrap_validate_args(mod.validate_args)))
    new = _wrap_pretrain(training.pretrain)
    patches += [runtime.Patch(mod, "pretrain", new) for mod in (training, mt)]
    patches += [
        runtime.Patch(torch.distributed, "init_process_group",
                      _wrap_init_process_group(torch.distributed.init_process_group)),
        # pipeline stages: the schedule's micro-batches read ahead, their p2p shapes (schedule.py)
        runtime.Patch(training, "get_forward_backward_func",
                      wrap_get_forward_backward_func(training.get_forward_backward_func))]
    runtime.install(_NAME, *patches)


def original(module, name: str):
    """What the hook on ``module.name`` replaced."""
    return runtime.original(_NAME, module, name)
