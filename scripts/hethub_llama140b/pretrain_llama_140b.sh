#!/usr/bin/env bash
# Pretrain llama-140b on the hethub_llama140b mix (scripts/clusters/hethub_llama140b.yaml):
# AMD MI250X (nodes 0-15, 8 GCDs each) + "accelerator-a" (nodes 16-95): 768 devices, the
# HETHUB paper's mix (accelerator-a's figures are assumptions, see the cluster file).
# RCCL inside the AMD nodes, the vendor library behind torch's nccl name inside the
# accelerator-a nodes (its variables go in HET_EXTRA_ENV); relay bridge between them.
# Plan from: tools/plan.py --cluster scripts/clusters/hethub_llama140b.yaml --model llama-140b \
#     --global-batch-size 1024 --seq-length 4096 --out scripts/hethub_llama140b/plan_140b.json
# Modes, flags and variables: --help (the shared body is scripts/common/launch.sh).
#SBATCH --job-name=hethub_llama140b-140b
#SBATCH --nodes=96
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
# No device request above: its kinds are different GRES on most sites (gpu, npu, ...).
# Where Slurm constrains devices, submit a heterogeneous job, one component per node group
# in the cluster file's order (sbatch applies the lines above to the first one only):
#   sbatch --nodes=16 --exclusive --ntasks-per-node=1 --gres=gpu:8 \
#       : --nodes=80 --exclusive --ntasks-per-node=1 --gres=<site-gres>:8 \
#       scripts/hethub_llama140b/pretrain_llama_140b.sh
set -euo pipefail

HET_MIX=hethub_llama140b
HET_SIZE=140b
HET_CLUSTER=scripts/clusters/hethub_llama140b.yaml
HET_PLAN=scripts/hethub_llama140b/plan_140b.json
HET_MODEL=llama-140b
HET_SEQ_LENGTH=4096
HET_NULL_VOCAB=31999      # NullTokenizer ids 0..31998 + eod = the model's 32000 tokens
HET_BRIDGE=relay
HET_LR=1.0e-4
HET_MIN_LR=1.0e-5
HET_WARMUP_ITERS=2000

# The shared body, beside this file's folder (or under the submission directory when
# sbatch runs a copy of this script).
HET_BODY="$(dirname "${BASH_SOURCE[0]}")/../common/launch.sh"
[ -f "$HET_BODY" ] || HET_BODY="${SLURM_SUBMIT_DIR:-$PWD}/scripts/common/launch.sh"
# shellcheck source=../common/launch.sh
source "$HET_BODY"
het_main "$@"
