#!/usr/bin/env bash
# The GPU check: everything in the project that needs a GPU, on one NVIDIA H200 host (16 cores),
# in under 8 minutes. Each check runs in its own process with its own time budget, so one that
# fails or hangs cannot stop the others:
#
#   probe     25 s   torch/CUDA/NCCL, the device and its kind, SDPA backends, flash-attn/apex/liger
#   numerics  20 s   tiny model CUDA vs CPU (fp32), bf16 parameters vs fp32, fused loss vs torch's
#   kernels   30 s   our compiled CUDA ops (csrc/) vs float64 references, fp32 and bf16, at the 7B
#                    layer's shapes; their memory bandwidth vs the device's peak (target >= 80%)
#   relay     25 s   relay bridge round trip of a CUDA tensor (staging; H200 rank <-> CPU rank)
#   mixed    115 s   torchrun pair (1 x H200 + 1 x cpu): pp=2 vs 1 process, resume, dp=2 ZeRO-1;
#                    the CPU ranks hold no CUDA context (NVML)
#   mfu      105 s   ~1B Llama (TinyLlama's shape), bf16, seq 2048, eager and --compile: MFU
#                    (>= 40% compiled); peak memory and step time vs predicted
#   profile   75 s   tools/profile_device.py on CUDA, eager and --compile, each layer against
#                    its roofline
#   bench     65 s   bench/train_step.py: our compiled step vs transformers' Llama (>= 1.0)
#
# No check starts after 460 s. Prints a table (check, status, value, threshold) and writes
# gpu_check.json, gpu_check_table.txt and gpu_check_logs.txt to --out, else $OUT, else
# ./gpu_check_out, rewritten after every check ("finished": false until the last). Exit status
# 0 when no check failed, 1 otherwise.
#
#   scripts/gpu_check.sh                      # all checks
#   scripts/gpu_check.sh --only probe,mfu     # a subset
#   scripts/gpu_check.sh --cpu-only           # no GPU: every check reports SKIP
#   PYTHON=/path/to/python scripts/gpu_check.sh
#
# The Python is $PYTHON, else the first of .venv/bin/python, python3, python whose torch sees a
# GPU, else the first that imports torch. The repository is put on PYTHONPATH, so the package
# need not be installed. Before the checks (not with --cpu-only), the fused kernels (csrc/) are
# built in place for the device when the extension there has no device kernels and torch is
# built for CUDA or ROCm (about 2 minutes on 16 cores, at most 300 s; GPU_CHECK_BUILD=0 skips
# it; a failed build leaves the torch references, and the kernels check then reports SKIP).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

pick_python() {
    local first="" candidate
    for candidate in "$REPO/.venv/bin/python" python3 python; do
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" \
                >/dev/null 2>&1; then
            echo "$candidate"
            return
        elif [ $? -eq 3 ] && [ -z "$first" ]; then
            first="$candidate"
        fi
    done
    [ -n "$first" ] || { echo "error: no Python with torch found; set PYTHON" >&2; exit 2; }
    echo "$first"
}

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    case " $* " in
        *" --cpu-only "*) PY="$(CUDA_VISIBLE_DEVICES= pick_python)" ;;
        *) PY="$(pick_python)" ;;
    esac
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

build_device_kernels() {
    "$PY" -c "
import sys, torch
from megatron_het.kernels.extension import EXTENSION
built = torch.cuda.is_available() and EXTENSION.supports('rms_norm', 'cuda')
sys.exit(0 if built or torch.version.cuda is None and torch.version.hip is None else 3)
" 2>/dev/null && return 0
    echo "== building the fused kernels for the device (csrc/, at most 300 s)"
    local start=$SECONDS
    (cd "$REPO" && MAX_JOBS="$(nproc)" timeout 300 "$PY" setup.py -q build_ext --inplace \
        >"${TMPDIR:-/tmp}/gpu_check_kernel_build.log" 2>&1) \
        || echo "   build failed or timed out; see ${TMPDIR:-/tmp}/gpu_check_kernel_build.log"
    echo "   $((SECONDS - start)) s"
}
case " $* " in
    *" --cpu-only "*) ;;
    *) [ "${GPU_CHECK_BUILD:-1}" = 0 ] || build_device_kernels ;;
esac
exec "$PY" -m tools.gpu_check "$@"
