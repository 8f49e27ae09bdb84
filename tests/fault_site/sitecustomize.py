# Test-only (tests/test_faults.py puts this folder on PYTHONPATH): in torchrun workers with
# PARADYSE_FAULT set, install the fault before pretrain_gpt_paradyse.py runs. Nothing else.
import json
import os

if os.environ.get("PARADYSE_FAULT") and "RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
    import sys

    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if not torch.cuda.is_available():
        from megatron_paradyse import cpu_compat

        cpu_compat.apply()
    from tests import faultinject

    faultinject.install(json.loads(os.environ["PARADYSE_FAULT"]))
