#!/usr/bin/env bash
# Pretrain llama3-70b on the a100_ascend910b mix (scripts/clusters/a100_ascend910b.yaml):
# NVIDIA A100-80G (nodes 0-3) + Huawei Ascend 910B (nodes 4-11): 96 devices.
# NCCL inside the A100 nodes, HCCL inside the Ascend nodes; relay bridge between them.
# Plan from: tools/plan.py --cluster scripts/clusters/a100_ascend910b.yaml --model llama3-70b \
#     --global-batch-size 1024 --seq-length 4096 --out scripts/a100_ascend910b/plan_70b.json
# Modes, flags and variables: --help (the shared body is scripts/common/launch.sh).
#SBATCH --job-name=a100_ascend910b-70b
#SBATCH --nodes=12
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
# No device request above: its kinds are different GRES on most sites (gpu, npu, ...).
# Where Slurm constrains devices, submit a heterogeneous job, one component per node group
# in the cluster file's order (sbatch applies the lines above to the first one only):
#   sbatch --nodes=4 --exclusive --ntasks-per-node=1 --gres=gpu:8 \
#       : --nodes=8 --exclusive --ntasks-per-node=1 --gres=npu:8 \
#       scripts/a100_ascend910b/pretrain_llama_70b.sh
set -euo pipefail

HET_MIX=a100_ascend910b
HET_SIZE=70b
HET_CLUSTER=scripts/clusters/a100_ascend910b.yaml
HET_PLAN=scripts/a100_ascend910b/plan_70b.json
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
