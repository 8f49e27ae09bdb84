#!/usr/bin/env bash
# The benchmark of docs/benchmark.md: every system (stock megatron-core TP+SP, the five
# strategies as uniform static plans, ParaDySe heuristic and optimal, the per-batch oracle) on
# the same batches of the stdlib corpus under one memory budget, in one run on p = 4 CPU gloo
# ranks; then each system's longest sequence within the budget; then the H100 simulation.
#   scripts/bench.sh                       # writes runs/bench/{bench.json,bench.log,*.png,simulation.json}
#   OUT=results/benchmark/default scripts/bench.sh    # what docs/benchmark.md commits
#   STEPS=8 BUDGET_MIB=48 scripts/bench.sh --systems tp_sp,metp   # extra flags go to the bench
# With pipeline stages (PP > 1; world = PP x P ranks, default P=2): STEPS steps of MICRO
# documents in flight under 1F1B (default 8 x 4), no length search, no simulation:
#   PP=2 OUT=results/benchmark/pipeline scripts/bench.sh      # docs/benchmark.md, "Pipeline stages"
# The same under megatron's interleaved schedule, VPP model chunks per stage:
#   PP=2 VPP=2 OUT=results/benchmark/pipeline_interleaved scripts/bench.sh   # "Interleaved pipeline schedule"
# With context parallelism (CP > 1; world = CP x P ranks, default P=2): STEPS documents up to
# 8192 tokens, every static in-node strategy x CP but colossal (its s x s score rows are far over
# any budget here, and it is the slowest) and the planners, no search, no simulation:
#   CP=2 OUT=results/benchmark/cp scripts/bench.sh            # docs/benchmark.md, "Context parallelism"
# Both (world = PP x CP x P ranks): STEPS steps of MICRO documents up to 4096 tokens under 1F1B,
# each stage's layers under CP, the CP systems:
#   PP=2 CP=2 OUT=results/benchmark/pipeline_cp scripts/bench.sh   # docs/benchmark.md, "CP with pipeline stages"
# Dynamic CP (world = POOL x P ranks, default a pool of 4 nodes x P=2): STEPS steps of GBS documents
# up to 2048 tokens, every system of bench/dynamic_cp.py (ParaDySe x Dynamic CP, ParaDySe at each
# fixed C, megatron's Dynamic CP policy, every static strategy x fixed C) and the oracle:
#   DCP=1 OUT=results/benchmark/dynamic_cp scripts/bench.sh   # docs/benchmark.md, "Dynamic CP"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)"
OUT="${OUT:-$ROOT/runs/bench}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
cd "$ROOT"
mkdir -p "$OUT"
start=$(date +%s)
if [ "${DCP:-0}" = 1 ]; then
  "$PY" -m megatron_paradyse.bench --dynamic-cp-pool "${POOL:-4}" --p "${P:-2}" --steps "${STEPS:-3}" \
    --global-batch "${GBS:-8}" --seq-length 2048 --memory-budget-mib "${BUDGET_MIB:-12.5}" \
    --repeats "${REPEATS:-1}" --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
  echo "> scripts/bench.sh took $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
  exit 0
fi
if [ "${CP:-1}" -gt 1 ] && [ "${PP:-1}" -gt 1 ]; then
  "$PY" -m megatron_paradyse.bench --pp "$PP" --cp "$CP" --p "${P:-2}" --steps "${STEPS:-8}" \
    --pp-microbatches "${MICRO:-4}" --seq-length 4096 --memory-budget-mib "${BUDGET_MIB:-17.5}" --out "$OUT" \
    --systems "${SYSTEMS:-tp_sp,ulysses,ring,metp,tp_sp+rc,ulysses+rc,ring+rc,metp+rc,paradyse_heuristic,paradyse_optimal}" \
    "$@" 2>&1 | tee "$OUT/bench.log"
  echo "> scripts/bench.sh took $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
  exit 0
fi
if [ "${CP:-1}" -gt 1 ]; then
  "$PY" -m megatron_paradyse.bench --cp "$CP" --p "${P:-2}" --steps "${STEPS:-16}" --seq-length 8192 \
    --memory-budget-mib "${BUDGET_MIB:-34}" --out "$OUT" \
    --systems "${SYSTEMS:-tp_sp,ulysses,ring,metp,tp_sp+rc,ulysses+rc,ring+rc,metp+rc,paradyse_heuristic,paradyse_optimal}" \
    "$@" 2>&1 | tee "$OUT/bench.log"
  echo "> scripts/bench.sh took $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
  exit 0
fi
if [ "${PP:-1}" -gt 1 ]; then
  "$PY" -m megatron_paradyse.bench --pp "$PP" --vpp "${VPP:-1}" --p "${P:-2}" --steps "${STEPS:-8}" \
    --pp-microbatches "${MICRO:-4}" --seq-length 4096 --memory-budget-mib "${BUDGET_MIB:-28.5}" \
    --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
  echo "> scripts/bench.sh took $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
  exit 0
fi
"$PY" -m megatron_paradyse.bench --p "${P:-4}" --steps "${STEPS:-12}" --seq-length 4096 \
  --memory-budget-mib "${BUDGET_MIB:-28}" --max-seq-len-search --search-probes 4 --search-cap 16384 \
  --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
"$PY" -m megatron_paradyse.bench --simulate --out "$OUT" 2>&1 | tee -a "$OUT/bench.log"
echo "> scripts/bench.sh took $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
