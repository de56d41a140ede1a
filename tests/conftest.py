import os

import pytest
import torch

# Keep the suite deterministic and light on a 2-core machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA/ROCm device present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
