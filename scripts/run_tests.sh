#!/usr/bin/env bash
# Set up (or reuse) the checkout's venv, then run the whole test suite on CPU gloo ranks.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)"
cd "$ROOT"
# PYTHON: the venv's interpreter for the scripts the tests launch (scripts/*.sh read it), not
# the one the venv was made from
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore PYTHON="$PY"
# two test files side by side (pytest-xdist; a file's tests stay together, so its shared worlds
# are built once): the suite is CPU-bound on one core at a time, and CI has two.
# PARADYSE_TEST_WORKERS=0 runs it in one process.
WORKERS="${PARADYSE_TEST_WORKERS:-2}"
XDIST=()
if [ "$WORKERS" != "0" ]; then XDIST=(-n "$WORKERS" --dist loadfile); fi
exec "$PY" -m pytest -q "${XDIST[@]}" tests "$@"
