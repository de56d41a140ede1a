#!/usr/bin/env bash
# Pretrain llama3-70b on the h200_mi300x mix (scripts/clusters/h200_mi300x.yaml):
# NVIDIA H200 (nodes 0-1) + AMD MI300X (nodes 2-5): 48 devices.
# NCCL inside the H200 nodes, RCCL inside the MI300X nodes; relay bridge between them.
# Plan from: tools/plan.py --cluster scripts/clusters/h200_mi300x.yaml --model llama3-70b \
#     --global-batch-size 1024 --seq-length 4096 --out scripts/h200_mi300x/plan_70b.json
# Modes, flags and variables: --help (the mix's settings: mix_70b.yaml beside it).
#SBATCH --job-name=h200_mi300x-70b
#SBATCH --nodes=6
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
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
exec "$python" -m megatron_het.launcher scripts/h200_mi300x/mix_70b.yaml "$@"
