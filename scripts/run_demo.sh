#!/usr/bin/env bash
# The README's demo: create or reuse the venv, then train a small GPT (the demo's shape: 4
# layers, hidden 128, 8 heads, sequences up to 4096 tokens) through pretrain_gpt_paradyse.py
# --paradyse on 4 CPU gloo ranks (TP = p = 4) over the Python standard library's own source
# files (real, long-tailed lengths; built into .cache/ on first use, no download). The planner
# picks each micro-batch's per-layer plan under a memory budget small enough that the longest
# documents need memory-lean plans; the documents are packed (--paradyse-pack balanced: several
# documents per micro-batch, attention inside each, packs that fit the budget); every iteration
# prints the lengths, the plan, predicted against measured time and peak; the run ends with a
# summary and writes runs/demo/run_report.png.
#   scripts/run_demo.sh                      # ParaDySe with the planner, packed
#   PACK=none scripts/run_demo.sh            # one document per micro-batch
#   PARADYSE=0 PACK=none scripts/run_demo.sh # stock Megatron TP+SP (stock cannot attend inside packs)
#   BUDGET=0.05 PLANNER=heuristic scripts/run_demo.sh
#   MEMORY_EVERY=1 scripts/run_demo.sh       # the peak on every step (default every 2nd: on CPU the
#                                            # tracker slows its step; the others' times are compared)
#   CALIBRATE=0 scripts/run_demo.sh          # the shipped cost model's times as profiled (default: first
#                                            # rescaled to this host, --paradyse-calibrate, ~10-20 s,
#                                            # then refined online, --paradyse-refine on)
#   scripts/run_demo.sh --train-iters 100    # extra flags go to pretrain_gpt_paradyse.py
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)"
SAVE="${SAVE:-$ROOT/runs/demo}"
rm -rf "$SAVE"
PACK="${PACK:-balanced}"
if [ "${PARADYSE:-1}" != "1" ] && [ "$PACK" != "none" ]; then
  echo "run_demo.sh: stock Megatron (PARADYSE=0) cannot attend inside packs: set PACK=none" >&2
  exit 2
fi
CAL_ARGS=()
if [ "${PARADYSE:-1}" = "1" ] && [ -z "${PLAN:-}" ] && [ "${CALIBRATE:-1}" = "1" ]; then
  # the shipped model was profiled on another host: rescale its times here, then follow the run
  # (online refinement of time and memory, off by default on the CPU)
  CAL_ARGS=(--paradyse-calibrate --paradyse-refine on)
fi
PACK="$PACK" DOCS="${DOCS:-4}" PYTHON="$PY" CORPUS=1 NPROC=4 TP=4 exec bash "$ROOT/scripts/pretrain_gpt_paradyse_cpu.sh" \
  --save "$SAVE" --save-interval 15 --paradyse-run-report "$SAVE" "${CAL_ARGS[@]}" \
  --paradyse-memory-every "${MEMORY_EVERY:-2}" "$@"
