#!/usr/bin/env bash
# Pretrain llama2-70b on the h100_a100 mix (scripts/clusters/h100_a100.yaml):
# NVIDIA H100 (nodes 0-1) + NVIDIA A100-40G (nodes 2-7): 64 devices.
# One vendor: NCCL spans both kinds, so the bridge is direct (set BRIDGE=relay to compare).
# Plan from: tools/plan.py --cluster scripts/clusters/h100_a100.yaml --model llama2-70b \
#     --global-batch-size 1024 --seq-length 4096 --out scripts/h100_a100/plan_70b.json
# Modes, flags and variables: --help (the mix's settings: mix_70b.yaml beside it).
#SBATCH --job-name=h100_a100-70b
#SBATCH --nodes=8
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
exec "$python" -m megatron_het.launcher scripts/h100_a100/mix_70b.yaml "$@"
