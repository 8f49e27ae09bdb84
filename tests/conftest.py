import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")
warnings.filterwarnings("ignore")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: extra multi-process worlds, run with -m slow")
