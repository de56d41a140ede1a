"""Starting processes safely on a GPU host, checked on CPU: the suite's GPU-presence probe
(tests/gpu/__init__.py, used by tests/conftest.py) never asks this process's torch.cuda and
skips the ``gpu`` tests exactly when it finds no device, and only the GPU session sees the GPU;
measurement workers are forked only where a forked child can run autograd
(megatron_het/perf/measure/worker_processes.py)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import megatron_het.perf.measure.worker_processes as measure_procs
import tests.conftest as suite_conftest
import tests.gpu as gpu
from megatron_het.perf.measure.worker_processes import (
    HIDING_VARIABLES,
    fork_is_safe,
    gpus_hidden,
    process_context,
    report_to_parent,
    run_measurement_processes,
)


@pytest.fixture
def cuda_untouchable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every torch.cuda call that could initialise CUDA here fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the probe asked this process's torch.cuda")

    for name in ("is_available", "device_count", "init", "current_device", "is_initialized"):
        monkeypatch.setattr(torch.cuda, name, forbidden)


def cuda_initialised(monkeypatch: pytest.MonkeyPatch, initialised: bool) -> None:
    """torch.cuda as it answers before (False) or after (True) CUDA's initialisation, with
    every call that could initialise it failing the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("asked torch.cuda more than whether it is initialised")

    for name in ("is_available", "device_count", "init", "current_device"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)


def fake_run(returncode: int, calls: list):
    def run(command, **kwargs):
        calls.append((command, kwargs))
        return subprocess.CompletedProcess(command, returncode)

    return run


@pytest.mark.parametrize("returncode, present", [(0, True), (1, False)])
def test_a_child_interpreter_answers(
    monkeypatch: pytest.MonkeyPatch, cuda_untouchable: None, returncode: int, present: bool
) -> None:
    calls: list = []
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(gpu.subprocess, "run", fake_run(returncode, calls))
    monkeypatch.setenv(gpu.NVML_CHECK, "1")
    assert gpu.device_present() is present
    ((command, kwargs),) = calls
    assert command[0] == sys.executable and "torch.cuda.is_available()" in command[-1]
    assert gpu.NVML_CHECK not in kwargs["env"]  # the child asks the CUDA runtime itself


def test_a_build_without_cuda_answers_without_a_child(
    monkeypatch: pytest.MonkeyPatch, cuda_untouchable: None
) -> None:
    calls: list = []
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    monkeypatch.setattr(gpu.subprocess, "run", fake_run(0, calls))
    assert gpu.device_present() is False and calls == []


def test_a_probe_that_hangs_counts_as_no_device(
    monkeypatch: pytest.MonkeyPatch, cuda_untouchable: None
) -> None:
    def hang(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(gpu.subprocess, "run", hang)
    assert gpu.device_present(timeout_s=1.0) is False


class FakeItem:
    def __init__(self, path: pathlib.Path, *markers: str) -> None:
        self.fspath, self.markers = path, [getattr(pytest.mark, m) for m in markers]

    def add_marker(self, marker) -> None:
        self.markers.append(marker)

    def get_closest_marker(self, name: str):
        return next((m for m in self.markers if m.name == name), None)


def skipped(item: FakeItem) -> bool:
    return item.get_closest_marker("skip") is not None


def skip_reason(item: FakeItem) -> str:
    return item.get_closest_marker("skip").kwargs["reason"]


@pytest.mark.parametrize("present", [True, False])
def test_the_gpu_session_runs_gpu_tests_alone_exactly_with_a_device(
    monkeypatch: pytest.MonkeyPatch, present: bool
) -> None:
    monkeypatch.setattr(suite_conftest, "GPU_SESSION", True)
    monkeypatch.setattr(suite_conftest, "device_present", lambda **kwargs: present)
    here = pathlib.Path(__file__)
    marked, cpu_item = FakeItem(here, "gpu"), FakeItem(here)
    in_gpu_dir = FakeItem(suite_conftest.GPU / "test_x.py")  # no marker of its own
    suite_conftest.pytest_collection_modifyitems(SimpleNamespace(), [marked, cpu_item, in_gpu_dir])
    assert skipped(marked) is not present and skipped(in_gpu_dir) is not present
    assert "runs the tests marked gpu only" in skip_reason(cpu_item)


@pytest.mark.parametrize("present", [True, False])
def test_other_sessions_hide_the_gpu_and_say_where_gpu_tests_run(
    monkeypatch: pytest.MonkeyPatch, present: bool
) -> None:
    asked = []
    monkeypatch.setattr(suite_conftest, "GPU_SESSION", False)
    monkeypatch.setattr(
        suite_conftest, "device_present", lambda environ: asked.append(environ) or present
    )
    monkeypatch.setenv(
        suite_conftest.HIDDEN_VARIABLE, '{"CUDA_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": null}'
    )
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    here = pathlib.Path(__file__)
    marked, cpu_item = FakeItem(here, "gpu"), FakeItem(here)
    suite_conftest.pytest_collection_modifyitems(SimpleNamespace(), [marked, cpu_item])
    assert skipped(marked) and not skipped(cpu_item)
    assert ("make test-gpu" in skip_reason(marked)) is present
    # the device is asked about with the variables as the session found them
    (environ,) = asked
    assert environ["CUDA_VISIBLE_DEVICES"] == "1" and "HIP_VISIBLE_DEVICES" not in environ
    # and this session's processes (this one included) see no GPU
    assert all(os.environ[name] == "" for name in HIDING_VARIABLES)


def test_no_probe_without_gpu_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    def probe(**kwargs):
        raise AssertionError("probed although no gpu test was selected")

    monkeypatch.setattr(suite_conftest, "device_present", probe)
    suite_conftest.pytest_collection_modifyitems(
        SimpleNamespace(), [FakeItem(pathlib.Path(__file__))]
    )


@pytest.mark.parametrize(
    "initialised, built, nodes, hidden, method",
    [
        (False, False, True, {}, "fork"),  # a CPU-only torch
        (True, True, True, {}, "spawn"),  # CUDA initialised here: a child could not use it
        (False, True, True, {}, "spawn"),  # a GPU torch with devices visible: autograd threads
        (False, True, True, {"CUDA_VISIBLE_DEVICES": "0"}, "spawn"),
        (False, True, True, {"HIP_VISIBLE_DEVICES": ""}, "spawn"),  # not CUDA's variable
        (False, True, True, {"CUDA_VISIBLE_DEVICES": ""}, "fork"),  # hidden: no device threads
        (False, True, False, {}, "fork"),  # a GPU build of torch on a host without a GPU
    ],
)
def test_measurement_workers_fork_only_where_a_child_can_run_autograd(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: pathlib.Path,
    initialised: bool,
    built: bool,
    nodes: bool,
    hidden: dict,
    method: str,
) -> None:
    cuda_initialised(monkeypatch, initialised)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    monkeypatch.setattr(torch.version, "hip", None)
    node = tmp_path / "nvidiactl"
    if nodes:
        node.touch()
    monkeypatch.setattr(measure_procs, "GPU_DEVICE_NODES", (str(node),))
    for name in HIDING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in hidden.items():
        monkeypatch.setenv(name, value)
    assert process_context().get_start_method() == method
    assert fork_is_safe() is (method == "fork")


@pytest.mark.parametrize(
    "hidden, expected",
    [
        ({"ROCR_VISIBLE_DEVICES": ""}, True),
        ({"HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": ""}, True),
        ({"HIP_VISIBLE_DEVICES": ""}, False),  # some ROCm releases ignore it alone
        ({}, False),
    ],
)
def test_a_rocm_build_needs_its_own_variables_hidden(
    monkeypatch: pytest.MonkeyPatch, hidden: dict, expected: bool
) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert gpus_hidden(hidden) is expected


def _report_answer(conn) -> None:
    report_to_parent(conn, lambda: 42)


def test_measurement_processes_pick_their_context(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_initialised(monkeypatch, False)
    assert run_measurement_processes(
        None, _report_answer, [()], 1, 10.0, "timed out", "failed"
    ) == [42]
