import os
import pathlib

import pytest
import torch

# Keep the suite deterministic and light on a 2-core machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

DISTRIBUTED = pathlib.Path(__file__).resolve().parent / "distributed"


def pytest_collection_modifyitems(config, items):
    # Multi-process tests (forked gloo workers) are left out of the fast loop.
    for item in items:
        if DISTRIBUTED in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.distributed)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA/ROCm device present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
