#!/usr/bin/env bash
# Pretrain llama-140b on the hethub_llama140b mix (scripts/clusters/hethub_llama140b.yaml):
# AMD MI250X (nodes 0-15, 8 GCDs each) + "accelerator-a" (nodes 16-95): 768 devices, the
# HETHUB paper's mix (accelerator-a's figures are assumptions, see the cluster file).
# RCCL inside the AMD nodes, the vendor library behind torch's nccl name inside the
# accelerator-a nodes (its variables go in HET_EXTRA_ENV); relay bridge between them.
# Plan: scripts/hethub_llama140b/plan_140b.json, from
#   tools/plan.py --cluster scripts/clusters/hethub_llama140b.yaml --model llama-140b \
#       --global-batch-size 1024 --seq-length 4096 --out scripts/hethub_llama140b/plan_140b.json
# Node order is the cluster file's: NODE_RANK 0 is the first node of its first node group.
#
# Usage:
#   DRY_RUN=1 scripts/hethub_llama140b/pretrain_llama_140b.sh        # validate plan+cluster+model here
#   # on every node (torchrun):
#   NODE_RANK=<n> MASTER_ADDR=<node 0> DATA_PATH=... TOKENIZER_MODEL=... CHECKPOINT_DIR=... \
#       scripts/hethub_llama140b/pretrain_llama_140b.sh
#   # Slurm (96 nodes, listed in the cluster file's order; from the repository root):
#   LAUNCHER=slurm DATA_PATH=... TOKENIZER_MODEL=... CHECKPOINT_DIR=... \
#       sbatch scripts/hethub_llama140b/pretrain_llama_140b.sh
# Flags: --dry-run, --launcher torchrun|slurm, --print-only; other arguments go to
# pretrain_llama.py. All variables are listed in scripts/common/launch.sh.
#SBATCH --job-name=hethub_llama140b-140b
#SBATCH --nodes=96
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

HET_MIX=hethub_llama140b
HET_SIZE=140b
HET_MODEL=llama-140b
HET_SEQ_LENGTH=4096
HET_NULL_VOCAB=31999      # NullTokenizer ids 0..31998 + eod = the model's 32000 tokens
HET_BRIDGE=relay
TRAIN_ITERS="${TRAIN_ITERS:-500000}"
# Batch sizes come from the plan (global batch 1024 sequences of 4096 tokens).
HET_TRAIN_ARGS=(
    --train-iters "$TRAIN_ITERS"
    --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine
    --lr-warmup-iters "${LR_WARMUP_ITERS:-2000}" --lr-decay-iters "$TRAIN_ITERS"
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
    --eval-interval 1000 --eval-iters 10
    --seed "${SEED:-1234}"
)

het_main "$@"
