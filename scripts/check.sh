#!/usr/bin/env bash
# The first thing to run on a GPU node: the communication paths and communicators (comm), every
# strategy against stock megatron-core, a short
# profile and fit, planned training steps near the device's capacity, and (with
# MEGATRON_LM_PATH) Megatron-LM's own pretrain_gpt.py with and without --paradyse.
#
#   bash scripts/check.sh                       # every GPU of this node (nccl), default model
#   bash scripts/check.sh --nproc 8 --hidden-size 4096 --num-attention-heads 32 ...
#   MEGATRON_LM_PATH=/path/to/Megatron-LM bash scripts/check.sh
#   bash scripts/check.sh --backend gloo --quick   # the short CPU form (what CI runs)
#
# On a GPU node it uses the python on PATH (yours, with a CUDA torch and megatron-core; set
# PYTHON to choose another); without CUDA it sets up the checkout's CPU venv. Prints a table,
# writes runs/check/check.json (--out), exits 1 if a line failed (README: "Checking a GPU node").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch, megatron.core, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  PY="$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)"
fi
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
# NCCL as a first multi-GPU run wants it: errors end the job instead of hanging it, and a hang
# leaves each rank's last collectives behind (torch's flight recorder, dumped on timeout); the
# comm section's own groups time out after 2 minutes
export CUDA_DEVICE_MAX_CONNECTIONS=1 TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export TORCH_NCCL_TRACE_BUFFER_SIZE="${TORCH_NCCL_TRACE_BUFFER_SIZE:-20000}"
export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$ROOT/runs/check/nccl_trace_rank_}"
mkdir -p "$ROOT/runs/check"
exec "$PY" -m megatron_paradyse.check "$@"
