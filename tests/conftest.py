import logging
import os
import warnings

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")
warnings.filterwarnings("ignore")

from megatron_paradyse.testing.spawn import fake_cuda_available, fork_server_for_ranks  # noqa: E402

fake_cuda_available()  # PARADYSE_FAKE_CUDA_AVAILABLE=1: the suite as on a GPU host, gloo ranks
fork_server_for_ranks()  # the profiler's and the report's ranks too: torch and megatron imported once

from megatron_paradyse import device  # noqa: E402

device.select("gloo")  # this process measures and builds on the CPU too, also on a GPU host


def pytest_configure(config):
    config.addinivalue_line("markers", "slow(reason): extra multi-process worlds, run with -m slow")


# the files that take longest here, longest first: pytest-xdist (scripts/run_tests.sh, two
# workers, a file's tests on one worker) hands files out in collection order, so the long ones
# start first and the short ones fill in around them instead of one long file running alone at
# the end (``--durations=0`` shows the times)
LONGEST_FIRST = ("test_megatron_lm.py", "test_training.py", "test_check.py", "test_readme.py",
                 "test_costmodel_profile.py", "test_faults.py",
                 "test_training_packed.py", "test_training_cp.py", "test_first_hour.py",
                 "test_planner_packs.py", "test_costmodel_analytic.py", "test_recompute_exact.py",
                 "test_strategies_exact.py", "test_calibrate.py", "test_bench.py")


# The 8-rank pipeline world last: beside Megatron-LM's torchrun jobs (about 70 threads a rank) the
# two took 225 s and 209 s on the 2 cores where each alone takes under a minute; at the end it runs
# beside the short files.
LAST = ("test_training_pipeline.py",)


def _file_rank(item) -> int:
    name = item.path.name if hasattr(item, "path") else str(item.fspath).rsplit("/", 1)[-1]
    if name in LAST:
        return len(LONGEST_FIRST) + 1 + LAST.index(name)
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """The long files first (:data:`LONGEST_FIRST`; a file's own order kept). A test marked
    ``slow`` runs only when ``-m slow`` selects it (its marker says why it is left out of the
    default suite, which stays under 10 minutes: what else covers it)."""
    items.sort(key=_file_rank)  # stable: each file's tests stay in their order
    if "slow" in (config.getoption("-m") or ""):
        return
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is not None:
            why = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "")
            item.add_marker(pytest.mark.skip(reason=f"slow, run with -m slow{': ' + why if why else ''}"))


@pytest.fixture(autouse=True)
def _package_logging():
    """A command line's ``main`` called in a test sets up the package's logging
    (``megatron_paradyse.logs.setup``: handlers, level, no propagation to the root logger);
    the next test gets it back as it was (``caplog`` reads the root logger)."""
    logger = logging.getLogger("megatron_paradyse")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate
