#!/bin/bash
# Multi-node training under Slurm: one torchrun agent per node (srun), c10d rendezvous on the first node.
#
#   sbatch --nodes 4 examples/distributed/slurm_train.sh data-bin/wikitext-103 [more toolkit-train flags]
#
# Each node runs GPUS_PER_NODE workers (one per GPU); ranks 0..N*G-1 are assigned by the rendezvous.
# HSDP: --ddp-backend fully_sharded --sharding-strategy hybrid_shard shards within a node and
# replicates across nodes (the default --shard-group-size is the ranks of one node).
#
#SBATCH --job-name=toolkit-lm
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out

set -euo pipefail

DATA=${1:?usage: sbatch slurm_train.sh DATA_BIN [toolkit-train flags]}
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
SAVE_DIR=${SAVE_DIR:-checkpoints/${SLURM_JOB_NAME}}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=${RDZV_PORT:-29500}
mkdir -p logs "$SAVE_DIR"

# NCCL over InfiniBand is picked automatically; uncomment to pin the interface / debug.
# export NCCL_SOCKET_IFNAME=ib0
# export NCCL_DEBUG=WARN
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# Fail fast instead of hanging on a lost rank (torch >= 2.2 name of the old NCCL_ASYNC_ERROR_HANDLING).
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1

# --max-restarts: torchrun restarts all workers (resuming from checkpoint_last) after a failure.
srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
    torchrun \
        --nnodes "$SLURM_NNODES" \
        --nproc-per-node "$GPUS_PER_NODE" \
        --rdzv-backend c10d \
        --rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" \
        --rdzv-id "$SLURM_JOB_ID" \
        --max-restarts 2 \
        "$(python -c 'import shutil, sys; print(shutil.which("toolkit-train") or sys.exit("toolkit-train not on PATH"))')" \
        "$DATA" \
        --task language_modeling --arch transformer_lm_gpt2_small \
        --ddp-backend fully_sharded --sharding-strategy hybrid_shard \
        --bf16 --checkpoint-activations \
        --optimizer adam --adam-betas '(0.9, 0.98)' --lr 0.0005 --clip-norm 1.0 \
        --lr-scheduler inverse_sqrt --warmup-updates 2000 \
        --tokens-per-sample 1024 --max-tokens 8192 --update-freq 1 --max-update 100000 \
        --save-dir "$SAVE_DIR" --use-sharded-state --save-interval-updates 1000 --keep-interval-updates 3 \
        --heartbeat-timeout 600 \
        --log-format json --log-interval 50 \
        "$@"
