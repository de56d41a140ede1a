#!/usr/bin/env bash
# The device compilers the tests compile csrc/'s kernels with (to objects; no GPU needed):
# nvcc (CUDA, for sm_80 and sm_90) is looked for in CUDA_HOME, on PATH and in /usr/local/cuda*;
# hipcc (HIP, for gfx90a) is installed here from the distribution's packages (Debian's hipcc)
# when it is missing, apt-get exists and we are root. Anything else only says what is missing:
# the tests then skip those targets with the reason (under CI=true they fail instead).
set -uo pipefail
if command -v hipcc >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "[toolchains] hipcc not found and not installable here (needs root and apt-get);" \
        "the HIP compile tests will skip"
    exit 0
fi
echo "[toolchains] installing hipcc (Debian's package, ~15 s)"
if ! DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends \
        hipcc >/tmp/megatron_het_hipcc_install.log 2>&1; then
    # the package lists may be missing on a fresh machine
    DEBIAN_FRONTEND=noninteractive timeout 300 apt-get update -q >/dev/null 2>&1
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends \
        hipcc >/tmp/megatron_het_hipcc_install.log 2>&1 \
        || echo "[toolchains] hipcc install failed (see /tmp/megatron_het_hipcc_install.log)"
fi
exit 0
