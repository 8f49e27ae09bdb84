#!/usr/bin/env bash
# Set up (or reuse) the checkout's venv, then run the whole test suite on CPU gloo ranks.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)"
cd "$ROOT"
# PYTHON: the venv's interpreter for the scripts the tests launch (scripts/*.sh read it), not
# the one the venv was made from
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore PYTHON="$PY"
exec "$PY" -m pytest -q tests "$@"
