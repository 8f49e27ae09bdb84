#!/bin/bash
# Template: ParaDySe pretraining of a ~1.3B GPT on one or more GPU nodes with torchrun,
# in the layout of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh.
# Run on every node (NODE_RANK=0..NUM_NODES-1), or use pretrain_gpt_paradyse_slurm.sh.
# NOT run in this repository's CI (it has no GPU); the CPU path is scripts/pretrain_gpt_paradyse_cpu.sh.
#
#   bash scripts/pretrain_gpt_paradyse_torchrun.sh CHECKPOINT_DIR DATA_PREFIX
#
# DATA_PREFIX is a megatron-core IndexedDataset of token ids (PREFIX.bin/.idx, e.g. from
# Megatron-LM's tools/preprocess_data.py); each document is one sample of its own length.
# PARADYSE=0 trains the stock Megatron TP+SP baseline on the same data and model.

# Megatron: with one hardware queue, TP/SP communication kernels run in issue order and
# overlap with compute as megatron expects (required for sequence parallelism).
export CUDA_DEVICE_MAX_CONNECTIONS=1
# Failures (docs/faults.md). A rank that raises ends the whole job within seconds on its own
# (megatron_paradyse.training.faults.FailFast: it publishes its error through the c10d store,
# aborts its NCCL communicators and exits 1; its peers stop within 0.2 s with exit status 3;
# torchrun tears the node's other workers down as soon as one exits non-zero). What is left
# to NCCL is a collective that errors or never completes (a hung kernel, a rank killed on
# another node when nothing else tears the job down):
#  - TORCH_NCCL_ASYNC_ERROR_HANDLING=1: the watchdog aborts the communicators and ends the
#    process when a collective fails or exceeds --distributed-timeout-minutes, instead of
#    leaving the job hanging (then torchrun / srun --kill-on-bad-exit end the others);
#  - TORCH_NCCL_ENABLE_MONITORING=1 (torch's default): a process whose watchdog itself is stuck
#    is killed after TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (torch's default 480 s).
# TIMEOUT_MINUTES (--distributed-timeout-minutes, default 10 as Megatron-LM's) is only that
# backstop: the longest legitimate wait inside one collective here is a few seconds (a rank
# hashing its checkpoint shards); raise it if rank 0 builds large dataset indices first.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_NCCL_ENABLE_MONITORING=${TORCH_NCCL_ENABLE_MONITORING:-1}
TIMEOUT_MINUTES=${TIMEOUT_MINUTES:-10}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Variable-length micro-batches allocate differently sized activations every step.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# Cluster-specific (uncomment and adapt): interfaces and InfiniBand HCAs for NCCL.
# export NCCL_SOCKET_IFNAME=eth0
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3
# export NCCL_IB_TIMEOUT=19

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
WORLD_SIZE=$((GPUS_PER_NODE * NUM_NODES))
TP=${TP:-8}                      # the switching group size p; world = DP x TP
PARADYSE=${PARADYSE:-1}
PLAN=${PLAN:-"rule:8192=tp_sp,16384=ulysses,24576=colossal*12+metp*12,metp"}

CHECKPOINT_PATH=${1:?checkpoint directory}
DATA_PATH=${2:?IndexedDataset prefix}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 2048
    --ffn-hidden-size 5632
    --num-attention-heads 16
    --group-query-attention
    --num-query-groups 8
    --seq-length 32768
    --max-position-embeddings 32768
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --vocab-size 32000
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size ${GLOBAL_BATCH_SIZE:-64}
    --train-iters 50000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.02
    --clip-grad 1.0
    --bf16
    --lr 3.0e-4
    --lr-decay-style cosine
    --min-lr 3.0e-5
    --lr-warmup-iters 2000
    --accumulate-allreduce-grads-in-fp32
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP
    --sequence-parallel
    --distributed-backend nccl
    --distributed-timeout-minutes $TIMEOUT_MINUTES
)

DATA_ARGS=(
    --data-path $DATA_PATH
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --save-interval 1000
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
)

PARADYSE_ARGS=()
if [ "$PARADYSE" = "1" ]; then
    PARADYSE_ARGS=(--paradyse --paradyse-plan "$PLAN")
fi

# the flags checked for the whole world before torchrun starts: a mistake is one line and exit
# status 2 here (docs/faults.md), not a failed worker in torchrun's summary
PARADYSE_CHECK_FLAGS=1 WORLD_SIZE=$WORLD_SIZE RANK=0 ${PYTHON:-python} $ROOT/pretrain_gpt_paradyse.py \
    ${GPT_MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${MODEL_PARALLEL_ARGS[@]} ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} "${PARADYSE_ARGS[@]}" "${@:3}" || exit $?

torchrun ${DISTRIBUTED_ARGS[@]} $ROOT/pretrain_gpt_paradyse.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} \
    "${PARADYSE_ARGS[@]}" \
    "${@:3}"
