#!/usr/bin/env bash
# Pretrain a small GPT on CPU gloo ranks with megatron-core, switching strategies with ParaDySe.
# The layout of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, sized for a laptop:
# the demo's shape (4 layers, hidden 128, 8 heads, ffn 512, sequences up to 4096 tokens); with
# CORPUS=1 on the default corpus, the Python standard library's own .py files (byte-level
# tokens, built into .cache/ on first use; no download), else on synthetic --mock-data.
#
# Usage: scripts/pretrain_gpt_paradyse_cpu.sh [more pretrain_gpt_paradyse.py flags]
#   your flags override the defaults below (e.g. --train-iters 200 --save runs/ck): a default
#   is left out where you give the flag or one it conflicts with (--lr-warmup-iters for the
#   warm-up fraction; --paradyse-plan for the planner's flags). The flags are checked before
#   torchrun starts: a mistake is one line and exit status 2.
# Environment:
#   NPROC=4          gloo ranks (torchrun --nproc-per-node)
#   TP=$NPROC        switching-group size p (world = DP x TP)
#   PARADYSE=1       0: stock Megatron TP+SP (the baseline), same data and model
#   PLANNER=optimal  the planner (heuristic | optimal) choosing each micro-batch's plan under BUDGET
#   BUDGET=...       memory budget in GiB per rank (--paradyse-memory-budget)
#   PLAN=...         a fixed --paradyse-plan instead of the planner (a name, per layer, or a length rule)
#   PACK=none        balanced | greedy: packed micro-batches (--paradyse-pack; needs PARADYSE=1),
#                    DOCS documents per step (--global-batch-size counts documents then)
#   CORPUS=1         train on the default corpus (scripts/run_demo.sh sets it); default: --mock-data
#   DATA_PATH=PREFIX train on your own IndexedDataset (python -m megatron_paradyse.data preprocess)
#   PYTHON=...       the interpreter (default: this checkout's .venv, else the active virtual
#                    environment's, else scripts/setup_env.sh makes the .venv)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then PY="$VIRTUAL_ENV/bin/python"
else PY="$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)"; fi
NPROC="${NPROC:-4}"
TP="${TP:-$NPROC}"
PARADYSE="${PARADYSE:-1}"
# cpu_compat.RANK_ENV: one thread per rank; 2 MiB pages for large CPU tensors (torch's switch)
# and freed memory kept in the process (glibc's), as a GPU's caching allocator keeps it; the
# shipped CPU cost models were profiled with these (docs/costmodel.md, "The CPU allocator")
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 THP_MEM_ALLOC_ENABLE="${THP_MEM_ALLOC_ENABLE:-1}"
export MALLOC_MMAP_MAX_="${MALLOC_MMAP_MAX_:-0}" MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-1099511627776}"
# One rank failing (an exception, or killed) ends every rank within seconds, with its error
# above torchrun's summary (docs/faults.md); gloo notices a dead peer at once, so no NCCL-style
# settings are needed here.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"

DISTRIBUTED_ARGS=(--nproc-per-node "$NPROC" --nnodes 1 --standalone)

GPT_MODEL_ARGS=(
  --num-layers 4 --hidden-size 128 --num-attention-heads 8 --ffn-hidden-size 512
  --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope
  --untie-embeddings-and-output-weights
  --vocab-size 258 --make-vocab-size-divisible-by 128
  --attention-dropout 0.0 --hidden-dropout 0.0
)
given() {  # whether the user's flags hold any of the named flags (as --flag V or --flag=V)
  local a f
  for a in "${USER_ARGS[@]}"; do
    for f in "$@"; do [[ "$a" == "$f" || "$a" == "$f="* ]] && return 0; done
  done
  return 1
}
USER_ARGS=("$@")

TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size "$((2 * NPROC / TP))" --train-iters 30
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine
  --weight-decay 0.01 --clip-grad 1.0 --adam-beta2 0.95 --seed 1234
)
# 10% warm-up of whatever --train-iters you give (Megatron-LM's --lr-warmup-fraction)
given --lr-warmup-iters --lr-warmup-fraction || TRAINING_ARGS+=(--lr-warmup-fraction 0.1)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --sequence-parallel --distributed-backend gloo)
if [ "${CORPUS:-0}" = "1" ] && [ -z "${DATA_PATH:-}" ]; then
  DATA_PATH="$("$PY" -W ignore -m megatron_paradyse.data corpus)"   # built on first use
fi
if [ -n "${DATA_PATH:-}" ]; then
  # natural document lengths; documents above --seq-length are skipped (the log names them)
  DATA_ARGS=(--data-path "$DATA_PATH" --paradyse-long-docs skip)
else
  DATA_ARGS=(--mock-data --paradyse-mock-min-length 8)
fi
# validation every 10 iterations and after training (2 global batches each: Megatron-LM's
# default of 100 would outlast this demo's training)
EVAL_AND_LOGGING_ARGS=(--log-interval 1 --eval-interval 10 --eval-iters 2)
PARADYSE_ARGS=()
if [ "$PARADYSE" = "1" ]; then
  if [ -n "${PLAN:-}" ]; then
    PARADYSE_ARGS=(--paradyse --paradyse-plan "$PLAN")
  elif given --paradyse-plan; then  # your fixed plan: no planner flags beside it
    PARADYSE_ARGS=(--paradyse)
  else
    PARADYSE_ARGS=(--paradyse --paradyse-planner "${PLANNER:-optimal}"
                   --paradyse-memory-budget "${BUDGET:-0.03}")
  fi
  if [ "${PACK:-none}" != "none" ]; then
    PARADYSE_ARGS+=(--paradyse-pack "$PACK" --global-batch-size "${DOCS:-8}")
  fi
fi

ARGS=("${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
      "${EVAL_AND_LOGGING_ARGS[@]}" "${PARADYSE_ARGS[@]}" "$@")
# the flags checked for NPROC ranks before torchrun starts: a mistake is one line and status 2
# here, not a failed worker in torchrun's report
PARADYSE_CHECK_FLAGS=1 WORLD_SIZE="$NPROC" RANK=0 "$PY" "$ROOT/pretrain_gpt_paradyse.py" "${ARGS[@]}"
exec "$PY" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt_paradyse.py" "${ARGS[@]}"
