"""Tests that need a CUDA/ROCm device: marked ``gpu``, run in the GPU session only (``make
test-gpu``; every other session hides the GPUs, see tests/conftest.py) and skipped where no
device is present.

Whether a device is present is decided without initialising CUDA in the test process, because
a process that has initialised the CUDA driver cannot hand it on to forked children (the GPU
session's workers are spawned then: tests/distributed/harness.py).
``torch.cuda.is_available()`` initialises the driver (``cudaGetDeviceCount``), so the question
goes to a child interpreter instead. GPU tests must not touch CUDA at import time either: only
inside the test functions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

import torch

# The child asks the CUDA runtime itself (not NVML alone): a device that torch cannot use
# counts as absent.
PROBE = (
    "import sys, torch; "
    "sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)"
)
PROBE_TIMEOUT_S = 120.0
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def device_present(
    timeout_s: float = PROBE_TIMEOUT_S, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether torch can use a CUDA/ROCm device here (in a process with environment
    ``environ``, default this one's), asked of a child interpreter so that this process never
    initialises CUDA. A torch built without CUDA/ROCm answers False at once; a probe that does
    not finish within ``timeout_s`` counts as no device."""
    if not torch.backends.cuda.is_built():
        return False
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k != NVML_CHECK}
    try:
        probe = subprocess.run(
            [sys.executable, "-c", PROBE], env=env, capture_output=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0
