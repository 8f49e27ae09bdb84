#!/usr/bin/env bash
# Create (or reuse) the checkout's virtual environment .venv with the CPU stack.
# torch is installed first and pinned, so pip takes the CPU build instead of a multi-GB CUDA one.
# Usage: source scripts/setup_env.sh   (or run it; it prints the venv's python)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PARADYSE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.paradyse-installed"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$ROOT/setup.py" -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q "torch==${PARADYSE_TORCH_VERSION:-2.13.0}"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
echo "$VENV/bin/python"
