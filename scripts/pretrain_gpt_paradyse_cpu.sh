#!/usr/bin/env bash
# Pretrain a small GPT on CPU gloo ranks with megatron-core, switching strategies with ParaDySe.
# The layout of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, sized for a laptop.
#
# Usage: scripts/pretrain_gpt_paradyse_cpu.sh [more pretrain_gpt_paradyse.py flags]
#   later flags override the defaults below (e.g. --train-iters 200 --save runs/ck)
# Environment:
#   NPROC=4          gloo ranks (torchrun --nproc-per-node)
#   TP=$NPROC        switching-group size p (world = DP x TP)
#   PARADYSE=1       0: stock Megatron TP+SP (the baseline), same data and model
#   PLAN=...         --paradyse-plan (default: a length rule over the registered strategies)
#   DATA_PATH=PREFIX train on an IndexedDataset (one document per sample) instead of --mock-data
#   PYTHON=.venv/bin/python
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-4}"
TP="${TP:-$NPROC}"
PARADYSE="${PARADYSE:-1}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"

if [ -z "${PLAN:-}" ]; then
  # short documents: tp_sp; longer ones: per-layer mixes; the longest: one strategy for all layers
  PLAN="$("$PY" -W ignore -c '
import megatron_paradyse as mp
s = set(mp.STRATEGIES)
if {"colossal", "metp"} <= s:
    print("rule:32=tp_sp,96=ulysses*2+colossal*2,160=ring*2+metp*2,metp")
else:
    print("rule:32=tp_sp,96=ulysses*2+ring*2,ring")')"
fi

DISTRIBUTED_ARGS=(--nproc-per-node "$NPROC" --nnodes 1 --standalone)

GPT_MODEL_ARGS=(
  --num-layers 4 --hidden-size 64 --num-attention-heads 4
  --seq-length 256 --max-position-embeddings 256 --position-embedding-type rope
  --vocab-size 256 --make-vocab-size-divisible-by 64
  --attention-dropout 0.0 --hidden-dropout 0.0
)
TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size "$((4 * NPROC / TP))" --train-iters 24
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 3
  --weight-decay 0.01 --clip-grad 1.0 --adam-beta2 0.95 --seed 1234
)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --sequence-parallel --distributed-backend gloo)
if [ -n "${DATA_PATH:-}" ]; then
  DATA_ARGS=(--data-path "$DATA_PATH")   # an IndexedDataset prefix of token ids < --vocab-size
else
  DATA_ARGS=(--mock-data --paradyse-mock-min-length 8)
fi
EVAL_AND_LOGGING_ARGS=(--log-interval 1)
PARADYSE_ARGS=()
if [ "$PARADYSE" = "1" ]; then
  PARADYSE_ARGS=(--paradyse --paradyse-plan "$PLAN")
fi

exec "$PY" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt_paradyse.py" \
  "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
  "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "${PARADYSE_ARGS[@]}" "$@"
