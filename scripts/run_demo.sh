#!/usr/bin/env bash
# The README's demo: create or reuse the venv, then train a small GPT (the demo's shape: 4
# layers, hidden 128, 8 heads, sequences up to 4096 tokens) through pretrain_gpt_paradyse.py
# --paradyse on 4 CPU gloo ranks (TP = p = 4) over the Python standard library's own source
# files (real, long-tailed lengths; built into .cache/ on first use, no download). The planner
# picks each micro-batch's per-layer plan under a memory budget small enough that the longest
# documents need memory-lean plans; every iteration prints the lengths, the plan, predicted
# against measured time and peak; the run ends with a summary and writes runs/demo/run_report.png.
#   scripts/run_demo.sh                      # ParaDySe with the planner
#   PARADYSE=0 scripts/run_demo.sh           # the same run with stock Megatron TP+SP
#   BUDGET=0.05 PLANNER=heuristic scripts/run_demo.sh
#   scripts/run_demo.sh --train-iters 100    # extra flags go to pretrain_gpt_paradyse.py
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)"
SAVE="${SAVE:-$ROOT/runs/demo}"
rm -rf "$SAVE"
PYTHON="$PY" CORPUS=1 NPROC=4 TP=4 exec bash "$ROOT/scripts/pretrain_gpt_paradyse_cpu.sh" \
  --save "$SAVE" --save-interval 15 --paradyse-run-report "$SAVE" "$@"
