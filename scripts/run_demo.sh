#!/usr/bin/env bash
# The README's demo: create or reuse the venv, then train a small GPT through
# pretrain_gpt_paradyse.py --paradyse on 4 CPU gloo ranks (TP = p = 4) over variable-length
# mock documents; each micro-batch's plan follows its length, several plans mix strategies
# per layer, and every iteration prints one Megatron-style line. About a minute on 2 cores.
#   scripts/run_demo.sh                      # ParaDySe
#   PARADYSE=0 scripts/run_demo.sh           # the same run with stock Megatron TP+SP
#   scripts/run_demo.sh --train-iters 100    # extra flags go to pretrain_gpt_paradyse.py
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)"
SAVE="${SAVE:-$ROOT/runs/demo}"
rm -rf "$SAVE"
PYTHON="$PY" NPROC=4 TP=4 exec bash "$ROOT/scripts/pretrain_gpt_paradyse_cpu.sh" \
  --save "$SAVE" --save-interval 12 "$@"
