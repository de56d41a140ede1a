#!/usr/bin/env bash
# Create or reuse a virtualenv and install megatron_het with its pinned dependencies.
#   VENV=path   where the virtualenv lives (default: .venv in the repository)
#   PYTHON=exe  interpreter used to create it (default: python3)
# A torch already importable in the environment (a CUDA or ROCm build, say) is kept;
# otherwise torch==2.13.0 is installed. Installing the package builds csrc/'s fused kernels
# (setup.py; a failed build leaves the torch references and says so), and the table of which
# implementation each op uses is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtualenv $VENV"
    # system site-packages stay visible so that a torch the user already has is reused
    "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.megatron_het_installed"
# (csrc/ too: a changed kernel source rebuilds the extension)
WANT="$( (cat requirements.txt setup.py pyproject.toml; find csrc -type f | LC_ALL=C sort \
    | xargs cat) | sha256sum | cut -d' ' -f1)"
# (find_spec, not import: importing torch takes seconds, and this runs before every make target)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$PY" -c "
import importlib.util as u, sys
sys.exit(not (u.find_spec('torch') and u.find_spec('megatron_het')))" 2>/dev/null; then
    exit 0
fi
# --no-compile: byte-compiling every installed module (transformers' thousands) takes half the
# install; a module is compiled when first imported instead (the make targets let Python
# write its bytecode cache).
PIP=("$PY" -m pip install --disable-pip-version-check --no-compile -q)
if "$PY" -c "import torch" 2>/dev/null; then
    echo "[setup] keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
    echo "[setup] installing $TORCH_PIN"
    "${PIP[@]}" "$TORCH_PIN"
fi
echo "[setup] installing pinned dependencies"
"${PIP[@]}" -r requirements.txt
echo "[setup] installing megatron_het and building its kernels (csrc/)"
"${PIP[@]}" --no-deps --no-build-isolation -e .
"$PY" -m megatron_het.kernels | sed 's/^/[setup] /'
echo "$WANT" > "$STAMP"
echo "[setup] ready: $VENV"
