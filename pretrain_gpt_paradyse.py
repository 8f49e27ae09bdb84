# Pretrain a GPT with megatron-core, switching parallel strategies per batch and per layer (ParaDySe).
"""A drop-in for Megatron-LM's ``pretrain_gpt.py``.

    torchrun --nproc-per-node 4 pretrain_gpt_paradyse.py --tensor-model-parallel-size 4 \\
        --sequence-parallel --num-layers 4 --hidden-size 64 --num-attention-heads 4 ... \\
        --paradyse --paradyse-plan "rule:64=tp_sp,ulysses*2+ring*2"

Without ``--paradyse`` it trains stock Megatron TP+SP (the baseline) on the same data.

Two code paths (``--paradyse-trainer``):

* ``core`` (the default): the training loop of
  ``megatron_paradyse.training`` on megatron-core alone (DDP, get_forward_backward_func,
  finalize_model_grads, get_megatron_optimizer, OptimizerParamScheduler, dist checkpoints).
  With ``--distributed-backend gloo`` (the default without CUDA) the ranks compute on the CPU
  and ``megatron_paradyse.cpu_compat`` is applied. Tested in this repository.
* ``megatron``: Megatron-LM 0.16's own ``pretrain()`` with ParaDySe's model and datasets
  providers and forward step (``megatron.training`` of a Megatron-LM core_v0.16 checkout on
  ``PYTHONPATH``). Ran on CPU gloo ranks with core_v0.16.1: the same losses as Megatron-LM's
  own ``pretrain_gpt.py``. For any Megatron-LM (0.16 and 0.19 tested), running its own
  ``pretrain_gpt.py`` through ``python -m megatron_paradyse.training.megatron_lm`` is the
  supported path (docs/megatron_lm.md).
  ``auto`` picks ``megatron`` where ``megatron.training`` imports and CUDA is present.

The body stays under ``if __name__ == "__main__":``: megatron's checkpoint writer starts a
``multiprocessing`` manager that re-imports this file.
"""
import os
import sys


def _choose_trainer(argv) -> str:
    choice = "core"
    for i, a in enumerate(argv):
        if a == "--paradyse-trainer" and i + 1 < len(argv):
            choice = argv[i + 1]
        elif a.startswith("--paradyse-trainer="):
            choice = a.split("=", 1)[1]
    if choice != "auto":
        return choice
    import torch

    from megatron_paradyse.training.megatron_lm import megatron_training_available

    return "megatron" if torch.cuda.is_available() and megatron_training_available() else "core"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if _choose_trainer(sys.argv[1:]) == "megatron":
        from megatron_paradyse.training.megatron_lm import megatron_lm_main

        megatron_lm_main()
    else:
        from megatron_paradyse.training.trainer import main

        sys.exit(main())
