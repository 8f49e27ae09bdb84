import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")
warnings.filterwarnings("ignore")

from megatron_paradyse.testing.spawn import fake_cuda_available  # noqa: E402

fake_cuda_available()  # PARADYSE_FAKE_CUDA_AVAILABLE=1: the suite as on a GPU host, gloo ranks

from megatron_paradyse import device  # noqa: E402

device.select("gloo")  # this process measures and builds on the CPU too, also on a GPU host


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: extra multi-process worlds, run with -m slow")
