#!/usr/bin/env bash
# Pretrain llama2-70b on the a100_mi250x mix (scripts/clusters/a100_mi250x.yaml):
# NVIDIA A100-80G (nodes 0-3) + AMD MI250X (nodes 4-7, 8 GCDs each): 64 devices.
# NCCL inside the A100 nodes, RCCL inside the MI250X nodes; the relay bridge (host memory +
# gloo/TCP) carries the traffic between them.
# Plan from: tools/plan.py --cluster scripts/clusters/a100_mi250x.yaml --model llama2-70b \
#     --global-batch-size 1024 --seq-length 4096 --out scripts/a100_mi250x/plan_70b.json
# Modes, flags and variables: --help (the mix's settings: mix_70b.yaml beside it).
#SBATCH --job-name=a100_mi250x-70b
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
exec "$python" -m megatron_het.launcher scripts/a100_mi250x/mix_70b.yaml "$@"
