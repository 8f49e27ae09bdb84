"""The entry points: ``python -m megatron_paradyse.training.megatron_lm SCRIPT ...`` runs
Megatron-LM's script as ``__main__`` with the hooks; ``pretrain_gpt_paradyse.py
--paradyse-trainer megatron`` runs Megatron-LM 0.16's ``pretrain()`` with ParaDySe's providers."""
from __future__ import annotations

import inspect
import os
import sys

import torch

from ... import cpu_compat_training, logs
from ...device import select
from ...errors import exit_on_user_error
from ...norms import install_sp_norm
from .hooks import install_hooks, original
from .providers import paradyse_datasets_provider, paradyse_model_provider


def megatron_training_available() -> bool:
    try:
        import megatron.training  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or 0.17+ on Python 3.11 (typing.override)
        return False
    return True


def _select_device(argv) -> None:
    """The device decision from Megatron-LM's ``--distributed-backend`` (its default nccl; gloo
    without CUDA), made before Megatron initialises: the allocator settings and the current
    device on GPUs, the CPU shims on CPU ranks. With sequence parallelism megatron's
    ``WrappedTorchNorm`` (the local spec's RMSNorm on every image) builds the SP torch norm."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    for i, a in enumerate(argv):
        if a == "--distributed-backend" and i + 1 < len(argv):
            backend = argv[i + 1]
        elif a.startswith("--distributed-backend="):
            backend = a.split("=", 1)[1]
    select(backend)
    if backend == "gloo":
        cpu_compat_training.apply()
    if "--sequence-parallel" in argv:
        install_sp_norm()


def run_script(script: str, argv: list) -> None:
    """Run Megatron-LM's ``script`` as ``__main__`` with ``argv``, with the hooks installed."""
    script = os.path.abspath(script)
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_paradyse.training.megatron_lm: no such script: {script}")
    sys.path.insert(0, os.path.dirname(script))  # its gpt_builders / model_provider / megatron/
    _select_device(argv)
    install_hooks()
    sys.argv = [script] + list(argv)
    # Not runpy.run_path: it would make the script ``sys.modules["__main__"]``, and the
    # processes that megatron's checkpoint writer starts with multiprocessing "spawn" (its
    # result-queue manager) would re-import the script, without the hooks and shims (and
    # import torch and megatron again). ``__main__`` stays the entry module (this package's
    # ``__main__.py``), with its spec and file hidden while the script runs, so spawned helpers
    # re-import nothing: they need nothing from ``__main__``.
    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec")
    namespace = {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__,
                 "__package__": None, "__spec__": None, "__cached__": None, "__doc__": None}
    main_module = sys.modules["__main__"]
    hidden = {k: main_module.__dict__.pop(k) for k in ("__file__",) if k in main_module.__dict__}
    spec, main_module.__spec__ = getattr(main_module, "__spec__", None), None
    try:
        exec(code, namespace)  # noqa: S102 - running the user's training script is the point
    finally:
        main_module.__spec__ = spec
        main_module.__dict__.update(hidden)


def main(argv=None) -> None:
    """``python -m megatron_paradyse.training.megatron_lm SCRIPT ARGS``; the package's docstring
    without a script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or not argv[0].endswith(".py"):
        print(sys.modules[__package__].__doc__)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    logs.setup()  # the plugin's lines (rank 0's [paradyse] iteration lines) beside Megatron-LM's
    with exit_on_user_error(f"{os.path.basename(argv[0])} (megatron_paradyse)"):
        run_script(argv[0], argv[1:])
    close_process_group()


def close_process_group() -> None:
    """After the script returned on this rank: meet the others, then destroy the process group
    (Megatron-LM's ``pretrain()`` leaves it up), so that no communicator thread outlives the
    interpreter: a gloo group still alive at exit aborted a rank of a finished pipeline run
    now and then ("terminate called without an active exception", exit status 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def megatron_lm_main() -> None:
    """``pretrain_gpt_paradyse.py --paradyse-trainer megatron``: Megatron-LM's ``pretrain()``
    with a local-spec GPT, ParaDySe's forward step and document datasets (needs
    ``megatron.training`` of Megatron-LM 0.16; ran on core_v0.16.1, equal to its own
    ``pretrain_gpt.py``). For 0.19 and later, use :func:`main` with Megatron-LM's script."""
    from megatron.core.enums import ModelType

    logs.setup()
    _select_device(sys.argv[1:])
    install_hooks()
    from megatron.training import pretrain

    first = next(iter(inspect.signature(original(sys.modules["megatron.training.training"], "pretrain"))
                      .parameters))
    if first != "train_valid_test_dataset_provider":  # 0.19+: pretrain(cfg_container, ...)
        raise SystemExit("pretrain_gpt_paradyse.py --paradyse-trainer megatron supports Megatron-LM "
                         "0.16's pretrain() only; with Megatron-LM >= 0.19 run its own script: "
                         "torchrun ... -m megatron_paradyse.training.megatron_lm "
                         "/path/to/Megatron-LM/pretrain_gpt.py <flags> --paradyse-document-data ...")
    with exit_on_user_error("pretrain_gpt_paradyse.py"):
        pretrain(paradyse_datasets_provider, paradyse_model_provider, ModelType.encoder_or_decoder,
                 None, args_defaults={"tokenizer_type": "NullTokenizer"})
