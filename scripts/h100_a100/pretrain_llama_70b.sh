#!/usr/bin/env bash
# Pretrain llama2-70b on the h100_a100 mix (scripts/clusters/h100_a100.yaml):
# NVIDIA H100 (nodes 0-1) + NVIDIA A100-40G (nodes 2-7): 64 devices.
# One vendor: NCCL spans both kinds, so the bridge is direct (set BRIDGE=relay to compare).
# Plan from: tools/plan.py --cluster scripts/clusters/h100_a100.yaml --model llama2-70b \
#     --global-batch-size 1024 --seq-length 4096 --out scripts/h100_a100/plan_70b.json
# Modes, flags and variables: --help (the shared body is scripts/common/launch.sh).
#SBATCH --job-name=h100_a100-70b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
set -euo pipefail

HET_MIX=h100_a100
HET_SIZE=70b
HET_CLUSTER=scripts/clusters/h100_a100.yaml
HET_PLAN=scripts/h100_a100/plan_70b.json
HET_MODEL=llama2-70b
HET_SEQ_LENGTH=4096
HET_NULL_VOCAB=31999      # NullTokenizer ids 0..31998 + eod = the model's 32000 tokens
HET_BRIDGE=direct
HET_LR=1.5e-4
HET_MIN_LR=1.5e-5
HET_WARMUP_ITERS=2000

# The shared body, beside this file's folder (or under the submission directory when
# sbatch runs a copy of this script).
HET_BODY="$(dirname "${BASH_SOURCE[0]}")/../common/launch.sh"
[ -f "$HET_BODY" ] || HET_BODY="${SLURM_SUBMIT_DIR:-$PWD}/scripts/common/launch.sh"
# shellcheck source=../common/launch.sh
source "$HET_BODY"
het_main "$@"
