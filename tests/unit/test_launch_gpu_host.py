"""Starting processes safely on a GPU host, checked on CPU: the suite's GPU-presence probe
(tests/gpu/__init__.py, used by tests/conftest.py) never asks this process's torch.cuda and
skips the ``gpu`` tests exactly when it finds no device; measurement workers are forked unless
CUDA is initialised here (megatron_het/perf/measure_procs.py)."""
from __future__ import annotations

import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_het.perf.measure_procs import (process_context, report_to_parent,
                                             run_measurement_processes)
import tests.conftest as suite_conftest
import tests.gpu as gpu


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
def test_a_child_interpreter_answers(monkeypatch: pytest.MonkeyPatch, cuda_untouchable: None,
                                     returncode: int, present: bool) -> None:
    calls: list = []
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(gpu.subprocess, "run", fake_run(returncode, calls))
    monkeypatch.setenv(gpu.NVML_CHECK, "1")
    assert gpu.device_present() is present
    (command, kwargs), = calls
    assert command[0] == sys.executable and "torch.cuda.is_available()" in command[-1]
    assert gpu.NVML_CHECK not in kwargs["env"]  # the child asks the CUDA runtime itself


def test_a_build_without_cuda_answers_without_a_child(monkeypatch: pytest.MonkeyPatch,
                                                       cuda_untouchable: None) -> None:
    calls: list = []
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    monkeypatch.setattr(gpu.subprocess, "run", fake_run(0, calls))
    assert gpu.device_present() is False and calls == []


def test_a_probe_that_hangs_counts_as_no_device(monkeypatch: pytest.MonkeyPatch,
                                                cuda_untouchable: None) -> None:
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


@pytest.mark.parametrize("present", [True, False])
def test_gpu_tests_are_skipped_exactly_without_a_device(monkeypatch: pytest.MonkeyPatch,
                                                        present: bool) -> None:
    monkeypatch.setattr(suite_conftest, "device_present", lambda: present)
    here = pathlib.Path(__file__)
    marked, cpu_item = FakeItem(here, "gpu"), FakeItem(here)
    in_gpu_dir = FakeItem(suite_conftest.GPU / "test_x.py")  # no marker of its own
    suite_conftest.pytest_collection_modifyitems(SimpleNamespace(),
                                                 [marked, cpu_item, in_gpu_dir])
    assert skipped(marked) is not present and skipped(in_gpu_dir) is not present
    assert not skipped(cpu_item)


def test_no_probe_without_gpu_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    def probe():
        raise AssertionError("probed although no gpu test was selected")
    monkeypatch.setattr(suite_conftest, "device_present", probe)
    suite_conftest.pytest_collection_modifyitems(SimpleNamespace(),
                                                 [FakeItem(pathlib.Path(__file__))])


@pytest.mark.parametrize("initialised, method", [(False, "fork"), (True, "spawn")])
def test_measurement_workers_fork_unless_cuda_is_initialised(
        monkeypatch: pytest.MonkeyPatch, initialised: bool, method: str) -> None:
    cuda_initialised(monkeypatch, initialised)
    assert process_context().get_start_method() == method


def _report_answer(conn) -> None:
    report_to_parent(conn, lambda: 42)


def test_measurement_processes_pick_their_context(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_initialised(monkeypatch, False)
    assert run_measurement_processes(None, _report_answer, [()], 1, 10.0, "timed out",
                                     "failed") == [42]

