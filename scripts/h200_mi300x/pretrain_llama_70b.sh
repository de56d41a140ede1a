#!/usr/bin/env bash
# Pretrain llama3-70b on the h200_mi300x mix (scripts/clusters/h200_mi300x.yaml):
# NVIDIA H200 (nodes 0-1) + AMD MI300X (nodes 2-5): 48 devices.
# NCCL inside the H200 nodes, RCCL inside the MI300X nodes; relay bridge between them.
# Plan: scripts/h200_mi300x/plan_70b.json, from
#   tools/plan.py --cluster scripts/clusters/h200_mi300x.yaml --model llama3-70b \
#       --global-batch-size 1024 --seq-length 4096 --out scripts/h200_mi300x/plan_70b.json
# Node order is the cluster file's: NODE_RANK 0 is the first node of its first node group.
# Llama 3's tokenizer is not SentencePiece: pre-tokenize the data to ids below 128255 and
# leave TOKENIZER_MODEL unset (NullTokenizer).
#
# Usage:
#   DRY_RUN=1 scripts/h200_mi300x/pretrain_llama_70b.sh        # validate plan+cluster+model here
#   # on every node (torchrun):
#   NODE_RANK=<n> MASTER_ADDR=<node 0> DATA_PATH=... TOKENIZER_MODEL=... CHECKPOINT_DIR=... \
#       scripts/h200_mi300x/pretrain_llama_70b.sh
#   # Slurm (6 nodes, listed in the cluster file's order; from the repository root):
#   LAUNCHER=slurm DATA_PATH=... TOKENIZER_MODEL=... CHECKPOINT_DIR=... \
#       sbatch scripts/h200_mi300x/pretrain_llama_70b.sh
# Flags: --dry-run, --launcher torchrun|slurm, --print-only; other arguments go to
# pretrain_llama.py. All variables are listed in scripts/common/launch.sh.
#SBATCH --job-name=h200_mi300x-70b
#SBATCH --nodes=6
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

HET_MIX=h200_mi300x
HET_SIZE=70b
HET_MODEL=llama3-70b
HET_SEQ_LENGTH=4096
HET_NULL_VOCAB=128255      # NullTokenizer ids 0..128254 + eod = the model's 128256 tokens
HET_BRIDGE=relay
TRAIN_ITERS="${TRAIN_ITERS:-500000}"
# Batch sizes come from the plan (global batch 1024 sequences of 4096 tokens).
HET_TRAIN_ARGS=(
    --train-iters "$TRAIN_ITERS"
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine
    --lr-warmup-iters "${LR_WARMUP_ITERS:-8000}" --lr-decay-iters "$TRAIN_ITERS"
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
    --eval-interval 1000 --eval-iters 10
    --seed "${SEED:-1234}"
)

het_main "$@"
