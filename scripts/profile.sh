#!/usr/bin/env bash
# Profile one decoder layer per strategy and fit the cost model.
#
#   bash scripts/profile.sh OUTDIR [profile flags...]
#
# Without torchrun this spawns --nproc gloo ranks on this machine (CPU); under torchrun
# (WORLD_SIZE set) it uses the launched ranks, e.g. on a GPU node:
#   torchrun --nproc-per-node 8 -m megatron_paradyse.costmodel profile --tensor-model-parallel-size 8 \
#       --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 \
#       --ffn-hidden-size 14336 --swiglu --disable-bias-linear --normalization RMSNorm --bf16 \
#       --seqs 1024,2048,4096,8192,16384,32768 -o prof.jsonl
# The model flags are the trainer's (Megatron-LM names, fusion switches included): give the ones
# the training command gives, so that the profiled layer is the trained one.
# Single-device mode (one GPU plays one rank of p): --fake-world 8 --fake-rank 0 --interconnect nvlink4
# The demo's shape on this CPU (what the package ships, held-out lengths measured in the same
# session and left out of the fit), p = 4:
#   FIT_FLAGS="--holdout-seqs 384,768,1536,3072,6144 --holdout-largest" bash scripts/profile.sh runs/costmodel \
#       --p 4 --seqs 128,256,384,512,768,1024,1536,2048,3072,4096,6144,8192,16384 --repeats 5 --memory-limit 4G
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/profile.sh OUTDIR [profile flags...]}
shift
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
start=$(date +%s)
$PY -m megatron_paradyse.costmodel profile --num-layers 4 --hidden-size 128 --num-attention-heads 8 \
    --ffn-hidden-size 512 --vocab-size 258 "$@" -o "$OUT/profile.jsonl"
# shellcheck disable=SC2086
$PY -m megatron_paradyse.costmodel fit "$OUT/profile.jsonl" -o "$OUT/model.json" ${FIT_FLAGS:-}
echo "profile + fit took $(( $(date +%s) - start )) s; model: $OUT/model.json"
