#!/usr/bin/env bash
# Pretrain llama-140b on the hethub_llama140b mix (scripts/clusters/hethub_llama140b.yaml):
# AMD MI250X (nodes 0-15, 8 GCDs each) + "accelerator-a" (nodes 16-95): 768 devices, the
# HETHUB paper's mix (accelerator-a's figures are assumptions, see the cluster file).
# RCCL inside the AMD nodes, the vendor library behind torch's nccl name inside the
# accelerator-a nodes (its variables go in HET_EXTRA_ENV); relay bridge between them.
# Plan from: tools/plan.py --cluster scripts/clusters/hethub_llama140b.yaml --model llama-140b \
#     --global-batch-size 1024 --seq-length 4096 --out scripts/hethub_llama140b/plan_140b.json
# Modes, flags and variables: --help (the mix's settings: mix_140b.yaml beside it).
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
exec "$python" -m megatron_het.launcher scripts/hethub_llama140b/mix_140b.yaml "$@"
