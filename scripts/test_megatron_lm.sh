#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py with the plugin, on both release lines, all checks
# (tests/test_megatron_lm.py with PARADYSE_MEGATRON_LM_FULL=1):
#
#   core_v0.16.1  megatron-core 0.16.1 in .venv (scripts/setup_env.sh), Megatron-LM's
#                 megatron/training from ../shared/fixtures/megatron-lm-core_v0.16.1
#   core_v0.19.0  megatron-core 0.19.x (its wheel ships megatron/training) in .venv-019
#
# megatron-core 0.19.x requires Python >= 3.12, but the only CPU torch wheel this machine has
# is cp311: on Python 3.12, `pip install torch==2.13.0` fetches torch's CUDA build plus about
# 15 nvidia-* packages (cudnn, cublas, nccl, ...; several GB). So .venv-019 is a Python 3.11
# venv with megatron-core's sdist installed with --ignore-requires-python --no-deps, triton
# (its megatron.core imports need it) and tests/megatron_lm_py311 (typing.override for
# Python 3.11) on PYTHONPATH. With a Python 3.12 that has a CPU torch, point
# PARADYSE_PYTHON_019 at it and a plain `pip install megatron-core` gives 0.19.x.
#
# Usage: bash scripts/test_megatron_lm.sh [016|019|all] [pytest args]   (default: all)
# A user's own checkout: MEGATRON_LM_PATH=/path/to/Megatron-LM bash scripts/test_megatron_lm.sh 016
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LINE="${1:-all}"
[ $# -gt 0 ] && shift
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore PARADYSE_MEGATRON_LM_FULL=1
cd "$ROOT"
status=0

if [ "$LINE" = 016 ] || [ "$LINE" = all ]; then
  PY="$(bash scripts/setup_env.sh | tail -1)"
  echo "== Megatron-LM core_v0.16.1 line: $("$PY" -c 'import megatron.core as m; print("megatron-core", m.__version__)')"
  "$PY" -m pytest -q -rs tests/test_megatron_lm.py "$@" || status=1
fi

if [ "$LINE" = 019 ] || [ "$LINE" = all ]; then
  VENV="${PARADYSE_VENV_019:-$ROOT/.venv-019}"
  VERSION="${MCORE_VERSION:-0.19.2}"
  BASE="${PARADYSE_PYTHON_019:-python3}"
  if [ ! -x "$VENV/bin/python" ]; then
    "$BASE" -m venv "$VENV"
  fi
  if ! "$VENV/bin/python" -c "import megatron.core, triton, six, regex, yaml, pytest" >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q "torch==${PARADYSE_TORCH_VERSION:-2.13.0}"
    "$VENV/bin/pip" install -q numpy "packaging>=24.2" einops psutil pytest six regex pyyaml
    "$VENV/bin/pip" install -q --ignore-requires-python --no-deps "megatron-core==$VERSION"
    "$VENV/bin/pip" install -q triton
  fi
  echo "== Megatron-LM core_v0.19.0 line: $("$VENV/bin/python" -c 'import sys, megatron.core as m; print("megatron-core", m.__version__, "on Python", sys.version.split()[0])')"
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -m pytest -q -rs tests/test_megatron_lm.py "$@" || status=1
fi
exit $status
