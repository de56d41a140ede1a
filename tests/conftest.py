import os
import pathlib

# Where some code still asks torch.cuda.is_available(), torch answers from NVML (it reads this
# variable at every call), which leaves the CUDA driver uninitialised in this process, so the
# workers forked later can still use CUDA. The GPU probe below does not rely on it.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.gpu import device_present  # noqa: E402

# Keep the suite deterministic and light on a 2-core machine: one thread per pytest-xdist
# worker (the workers share the cores), at most two in a single-process run.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER")
                      else max(1, min(2, os.cpu_count() or 1)))

TESTS = pathlib.Path(__file__).resolve().parent
DISTRIBUTED, GPU = TESTS / "distributed", TESTS / "gpu"


def pytest_collection_modifyitems(config, items):
    for item in items:
        parents = pathlib.Path(str(item.fspath)).resolve().parents
        # Multi-process tests (forked gloo workers) are left out of the fast loop.
        if DISTRIBUTED in parents:
            item.add_marker(pytest.mark.distributed)
        if GPU in parents:  # everything under tests/gpu/ needs a device
            item.add_marker(pytest.mark.gpu)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    # Decided without initialising CUDA here (see tests/gpu/__init__.py); asked only when a
    # selected test needs a device.
    if not gpu_items or device_present():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA/ROCm device present")
    for item in gpu_items:
        item.add_marker(skip_gpu)
