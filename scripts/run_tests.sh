#!/usr/bin/env bash
# Set up (or reuse) the checkout's venv, then run the whole test suite on CPU gloo ranks.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)"
cd "$ROOT"
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
exec "$PY" -m pytest -q tests "$@"
