#!/usr/bin/env bash
# Pretrain llama3-70b on the h200_mi300x mix (scripts/clusters/h200_mi300x.yaml):
# NVIDIA H200 (nodes 0-1) + AMD MI300X (nodes 2-5): 48 devices.
# NCCL inside the H200 nodes, RCCL inside the MI300X nodes; relay bridge between them.
# Plan from: tools/plan.py --cluster scripts/clusters/h200_mi300x.yaml --model llama3-70b \
#     --global-batch-size 1024 --seq-length 4096 --out scripts/h200_mi300x/plan_70b.json
# Modes, flags and variables: --help (the shared body is scripts/common/launch.sh).
#SBATCH --job-name=h200_mi300x-70b
#SBATCH --nodes=6
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
set -euo pipefail

HET_MIX=h200_mi300x
HET_SIZE=70b
HET_CLUSTER=scripts/clusters/h200_mi300x.yaml
HET_PLAN=scripts/h200_mi300x/plan_70b.json
HET_MODEL=llama3-70b
HET_SEQ_LENGTH=4096
HET_NULL_VOCAB=128255      # NullTokenizer ids 0..128254 + eod = the model's 128256 tokens
HET_BRIDGE=relay
HET_LR=1.5e-4
HET_MIN_LR=1.5e-5
HET_WARMUP_ITERS=8000

# The shared body, beside this file's folder (or under the submission directory when
# sbatch runs a copy of this script).
HET_BODY="$(dirname "${BASH_SOURCE[0]}")/../common/launch.sh"
[ -f "$HET_BODY" ] || HET_BODY="${SLURM_SUBMIT_DIR:-$PWD}/scripts/common/launch.sh"
# shellcheck source=../common/launch.sh
source "$HET_BODY"
het_main "$@"
