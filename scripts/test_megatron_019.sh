#!/usr/bin/env bash
# Run the test suite against megatron-core 0.19.x on Python 3.11 (its wheels need 3.12).
# The sdist is forced onto 3.11 with --ignore-requires-python --no-deps; importing it needs
# triton. On Python 3.12 a plain `pip install megatron-core` gives 0.19.x directly.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PARADYSE_VENV_019:-$ROOT/.venv-019}"
VERSION="${MCORE_VERSION:-0.19.2}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# six, regex, pyyaml: Megatron-LM's megatron/training (tests/test_megatron_lm.py); the same
# venv as scripts/test_megatron_lm.sh 019, which installs a subset
if ! "$VENV/bin/python" -c "import megatron.core, triton, sklearn, xgboost, matplotlib, six, regex, yaml" >/dev/null 2>&1; then
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q numpy "packaging>=24.2" einops psutil pytest scikit-learn xgboost-cpu matplotlib six regex pyyaml
  "$VENV/bin/pip" install -q --ignore-requires-python --no-deps "megatron-core==$VERSION"
  "$VENV/bin/pip" install -q triton
fi
cd "$ROOT"
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m pytest -q tests "$@"
