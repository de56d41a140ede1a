import json
import os
import pathlib
import re

# (megatron_het.perf.measure.worker_processes.HIDING_VARIABLES, spelled out: the GPUs are hidden below
# before anything of the package is imported; checked against it after)
_HIDING = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")

# Where some code still asks torch.cuda.is_available(), torch answers from NVML (it reads this
# variable at every call), which leaves the CUDA driver uninitialised in this process. The GPU
# probe below does not rely on it.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# Two sessions on a GPU host. A process that forks workers (tests/distributed, the
# measurements) must not use a GPU: once CUDA is initialised, or once any backward pass has run
# with a device visible (autograd then starts its per-device threads), a forked child cannot
# run torch code. So every session hides the GPUs from its processes, and the tests run on the
# CPU as on a machine without one, except the GPU session (MEGATRON_HET_TEST_GPU=1, ``make
# test-gpu``), which keeps them visible and runs only the tests marked gpu.
GPU_SESSION_VARIABLE = "MEGATRON_HET_TEST_GPU"
GPU_SESSION = os.environ.get(GPU_SESSION_VARIABLE) == "1"
# The hiding variables as the session found them (kept for pytest-xdist's workers, which
# inherit the hidden ones), to tell "hidden" from "absent" in the GPU tests' skip reason.
HIDDEN_VARIABLE = "MEGATRON_HET_TEST_HIDDEN"
if not GPU_SESSION:
    os.environ.setdefault(HIDDEN_VARIABLE, json.dumps({n: os.environ.get(n) for n in _HIDING}))
    for _name in _HIDING:
        os.environ[_name] = ""


def unhidden_environ() -> dict:
    """This process's environment with the hiding variables as the session found them."""
    env = dict(os.environ)
    for name, value in json.loads(env.get(HIDDEN_VARIABLE, "{}")).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_het.perf.measure.worker_processes import HIDING_VARIABLES  # noqa: E402
from tests.gpu import device_present  # noqa: E402

assert _HIDING == HIDING_VARIABLES, "tests/conftest.py hides other variables than the package"

# Keep the suite deterministic and light on a 2-core machine: one thread per pytest-xdist
# worker (the workers share the cores), at most two in a single-process run.
torch.set_num_threads(
    1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1))
)

TESTS = pathlib.Path(__file__).resolve().parent
DISTRIBUTED, GPU = TESTS / "distributed", TESTS / "gpu"


# A module whose every test is slow says so once, at module level.
MODULE_SLOW = re.compile(r"^pytestmark = pytest\.mark\.slow\b", re.MULTILINE)


def _excluded_markers(config) -> set[str]:
    """The markers ``-m`` leaves out whole: for an expression that is only ``not A and not
    B ...`` (the fast loop's), {A, B, ...}; anything else excludes nothing here."""
    expression = (config.getoption("markexpr") or "").strip()
    parts = [part.strip() for part in expression.split(" and ")] if expression else []
    names = [re.fullmatch(r"not (\w+)", part) for part in parts]
    return {m.group(1) for m in names if m} if names and all(names) else set()


def pytest_ignore_collect(collection_path, config):
    """Do not even import a test module whose every test ``-m`` leaves out: the fast loop then
    skips the imports of tests/distributed and of the modules marked slow whole (megatron-core
    alone takes seconds to import)."""
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    excluded = _excluded_markers(config)
    if not excluded:
        return None
    parents = collection_path.resolve().parents
    if ("distributed" in excluded and DISTRIBUTED in parents) or (
        "gpu" in excluded and GPU in parents
    ):
        return True
    if "slow" in excluded and MODULE_SLOW.search(collection_path.read_text(encoding="utf-8")):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        parents = pathlib.Path(str(item.fspath)).resolve().parents
        # Multi-process tests (forked gloo workers) are left out of the fast loop.
        if DISTRIBUTED in parents:
            item.add_marker(pytest.mark.distributed)
        if GPU in parents:  # everything under tests/gpu/ needs a device
            item.add_marker(pytest.mark.gpu)
    # The modules holding slow tests (multi-process jobs, tens of seconds each) go first, whole,
    # so that pytest-xdist's workers, which take their queues in collection order and steal
    # from each other's ends, finish on short tests instead of one worker's last long one.
    slow_files = {str(item.fspath) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: str(item.fspath) not in slow_files)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if GPU_SESSION:
        only_gpu = pytest.mark.skip(
            reason=f"{GPU_SESSION_VARIABLE}=1 runs the tests marked gpu only"
        )
        for item in items:
            if item.get_closest_marker("gpu") is None:
                item.add_marker(only_gpu)
    # Decided without initialising CUDA here (see tests/gpu/__init__.py); asked only when a
    # selected test needs a device.
    if not gpu_items:
        return
    if GPU_SESSION and device_present():
        return
    if not GPU_SESSION and device_present(environ=unhidden_environ()):
        why = (
            "the GPUs are hidden from this session, whose tests fork workers; make test-gpu "
            f"({GPU_SESSION_VARIABLE}=1) runs the GPU tests"
        )
    else:
        why = "no CUDA/ROCm device present"
    skip_gpu = pytest.mark.skip(reason=why)
    for item in gpu_items:
        item.add_marker(skip_gpu)
