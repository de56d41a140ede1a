#!/usr/bin/env bash
# Pretrain llama2-70b on the h100_a100 mix (scripts/clusters/h100_a100.yaml):
# NVIDIA H100 (nodes 0-1) + NVIDIA A100-40G (nodes 2-7): 64 devices.
# One vendor: NCCL spans both kinds, so the bridge is direct (set BRIDGE=relay to compare).
# Plan: scripts/h100_a100/plan_70b.json, from
#   tools/plan.py --cluster scripts/clusters/h100_a100.yaml --model llama2-70b \
#       --global-batch-size 1024 --seq-length 4096 --out scripts/h100_a100/plan_70b.json
# Node order is the cluster file's: NODE_RANK 0 is the first node of its first node group.
#
# Usage:
#   DRY_RUN=1 scripts/h100_a100/pretrain_llama_70b.sh        # validate plan+cluster+model here
#   # on every node (torchrun):
#   NODE_RANK=<n> MASTER_ADDR=<node 0> DATA_PATH=... TOKENIZER_MODEL=... CHECKPOINT_DIR=... \
#       scripts/h100_a100/pretrain_llama_70b.sh
#   # Slurm (8 nodes, listed in the cluster file's order; from the repository root):
#   LAUNCHER=slurm DATA_PATH=... TOKENIZER_MODEL=... CHECKPOINT_DIR=... \
#       sbatch scripts/h100_a100/pretrain_llama_70b.sh
# Flags: --dry-run, --launcher torchrun|slurm, --print-only; other arguments go to
# pretrain_llama.py. All variables are listed in scripts/common/launch.sh.
#SBATCH --job-name=h100_a100-70b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail

# The repository: two levels above this file, or the submission directory under sbatch (which
# runs a copy of the script).
HET_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ ! -f "$HET_REPO/scripts/common/launch.sh" ]; then
    HET_REPO="${SLURM_SUBMIT_DIR:-$PWD}"
fi
# shellcheck source=../common/vendor_env.sh
source "$HET_REPO/scripts/common/vendor_env.sh"
# shellcheck source=../common/launch.sh
source "$HET_REPO/scripts/common/launch.sh"

HET_MIX=h100_a100
HET_SIZE=70b
HET_MODEL=llama2-70b
HET_SEQ_LENGTH=4096
HET_NULL_VOCAB=31999      # NullTokenizer ids 0..31998 + eod = the model's 32000 tokens
HET_BRIDGE=direct
TRAIN_ITERS="${TRAIN_ITERS:-500000}"
# Batch sizes come from the plan (global batch 1024 sequences of 4096 tokens).
HET_TRAIN_ARGS=(
    --train-iters "$TRAIN_ITERS"
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine
    --lr-warmup-iters "${LR_WARMUP_ITERS:-2000}" --lr-decay-iters "$TRAIN_ITERS"
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
    --eval-interval 1000 --eval-iters 10
    --seed "${SEED:-1234}"
)

het_main "$@"
