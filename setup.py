"""megatron_paradyse: ParaDySe per-batch, per-layer parallel-strategy switching for megatron-core."""
from setuptools import find_packages, setup

setup(
    name="megatron_paradyse",
    version="0.1.0",
    description="Hot-switching of per-layer parallel strategies for megatron-core (ParaDySe)",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_paradyse", "megatron_paradyse.*"]),
    # cost models: interconnect / hardware constants and the shipped profiles + fitted models
    package_data={"megatron_paradyse.costmodel": ["README.md", "configs/*.json", "models/*.json",
                                                  "models/*.jsonl"]},
    python_requires=">=3.10",
    install_requires=[
        # Install torch first and explicitly (scripts/setup_env.sh does): a bare requirement
        # lets pip pick a multi-GB CUDA build on a machine without one.
        "torch>=2.6",
        # 0.16.1 on Python 3.11; 0.17+ (tested API: 0.19.x) need Python 3.12.
        "megatron-core>=0.16.1",
        "xgboost-cpu>=2.0; platform_system=='Linux' and platform_machine=='x86_64'",
        "scikit-learn>=1.3",
        "scipy",  # the cost-model fit (non-negative least squares); scikit-learn needs it anyway
        "numpy",
        "einops",
        "packaging",
        # megatron's distributed-checkpoint writer needs psutil; without it a save hangs.
        "psutil",
    ],
    extras_require={
        # Megatron-LM's megatron/training imports these (tests/test_megatron_lm.py runs it).
        # Not triton (about 1 GB): without it and without CUDA, cpu_compat_training stands in
        # for the one module that imports it (megatron-core's batch-invariant kernels).
        "megatron-lm": ["six", "regex", "pyyaml"],
        "test": ["pytest>=7", "pytest-xdist", "matplotlib", "six", "regex", "pyyaml", "tensorboard"],
        "plots": ["matplotlib"],
        # --tensorboard-dir (torch.utils.tensorboard writes, tests read back); --wandb-project: pip install wandb
        "tensorboard": ["tensorboard"],
        # GPU machines: flash-attn builds against the installed CUDA torch. Transformer Engine
        # must be installed with its torch part ("transformer-engine[pytorch]"): the bare
        # meta package makes `import megatron.core` crash. Never install the PyPI package
        # named "apex" (an unrelated web toolkit); NVIDIA apex is built from source.
        "gpu": ["flash-attn>=2.7,<2.9", "transformer-engine[pytorch]"],
    },
    py_modules=["pretrain_gpt_paradyse"],
)
