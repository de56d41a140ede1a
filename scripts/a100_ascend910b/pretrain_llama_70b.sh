#!/usr/bin/env bash
# Pretrain llama3-70b on the a100_ascend910b mix (scripts/clusters/a100_ascend910b.yaml):
# NVIDIA A100-80G (nodes 0-3) + Huawei Ascend 910B (nodes 4-11): 96 devices.
# NCCL inside the A100 nodes, HCCL inside the Ascend nodes; relay bridge between them.
# Plan from: tools/plan.py --cluster scripts/clusters/a100_ascend910b.yaml --model llama3-70b \
#     --global-batch-size 1024 --seq-length 4096 --out scripts/a100_ascend910b/plan_70b.json
# Modes, flags and variables: --help (the mix's settings: mix_70b.yaml beside it).
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

# The repository: two levels above this script, or the submission directory (sbatch runs a
# copy of it); the interpreter: $PYTHON, else the repository's .venv, else python3.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
[ -f "$repo/pretrain_llama.py" ] || repo="${SLURM_SUBMIT_DIR:-$PWD}"
if [ ! -f "$repo/pretrain_llama.py" ]; then
    echo "error: cannot find the repository root; run the script from its checkout or" \
        "sbatch it from the repository root" >&2
    exit 2
fi
python="${PYTHON:-$repo/.venv/bin/python}"
[ -n "${PYTHON:-}" ] || [ -x "$python" ] || python=python3
cd "$repo"
exec "$python" -m megatron_het.launcher scripts/a100_ascend910b/mix_70b.yaml "$@"
