"""Test-only: lets megatron-core 0.19.x's ``megatron.training`` import on Python 3.11.

megatron-core >= 0.17 requires Python >= 3.12; its ``megatron/training/models/*.py`` import
``typing.override`` (new in 3.12). ``scripts/test_megatron_lm.sh`` runs the 0.19 line on a
Python 3.11 venv (the only CPU torch wheel on this machine is cp311; on 3.12 pip would fetch
torch's CUDA build and about 15 nvidia-* packages) and puts this folder on PYTHONPATH, so
Python imports this file at start-up. On Python >= 3.12 it does nothing.
"""
import typing

if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override
