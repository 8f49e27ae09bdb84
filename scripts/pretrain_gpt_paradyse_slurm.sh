#!/bin/bash
# Template: ParaDySe pretraining on a SLURM cluster, one torchrun per node (c10d rendezvous).
# Submit:   sbatch scripts/pretrain_gpt_paradyse_slurm.sh CHECKPOINT_DIR DATA_PREFIX
# The model, training and ParaDySe flags are those of pretrain_gpt_paradyse_torchrun.sh,
# which this script runs on every node. NOT run in this repository's CI (no GPU).
#SBATCH --job-name=paradyse-gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail
ROOT=${PARADYSE_ROOT:-$SLURM_SUBMIT_DIR}
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-6000}
export NUM_NODES=$SLURM_JOB_NUM_NODES
export GPUS_PER_NODE=${GPUS_PER_NODE:-8}

# NCCL / megatron settings (also exported by the torchrun template on each node; see its
# comments and docs/faults.md): a failed or stuck collective ends the process instead of
# hanging it, and --kill-on-bad-exit=1 below ends every node's tasks as soon as one exits
# non-zero (a rank killed on one node cannot leave the other nodes waiting in NCCL).
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export TORCH_NCCL_ENABLE_MONITORING=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# one task per node; each sets NODE_RANK from SLURM_NODEID and starts torchrun. The arguments
# travel as bash -c's positional parameters, each one word as given (a plan such as
# "rule:4096=tp_sp,ulysses*12+ring*12" is neither split nor globbed).
srun --kill-on-bad-exit=1 bash -c 'NODE_RANK=$SLURM_NODEID exec bash "$0" "$@"' \
    "$ROOT/scripts/pretrain_gpt_paradyse_torchrun.sh" "$@"
