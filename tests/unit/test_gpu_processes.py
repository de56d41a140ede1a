"""The GPU check's watch of the processes holding a GPU context (NVML faked), and the row it
gives the mixed pair."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tools.gpu_check import gpu_processes, mixed_pair
from tools.gpu_check.context import CheckContext, Options
from tools.gpu_check.gpu_processes import GpuProcessWatch, environment_of
from tools.gpu_check.report import FAIL, PASS, SKIP, RowWriter

NAMES = ("LOCAL_RANK", mixed_pair.RUN_MARKER)


class FakeNvml:
    """Two devices; device 1 lists ``pids`` (as NVML's process records)."""

    def __init__(self, pids: list[int], fail_first: int = 0) -> None:
        self.pids, self.fail_first, self.shut = pids, fail_first, False

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list:
        if self.fail_first:
            self.fail_first -= 1
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        return [SimpleNamespace(pid=pid) for pid in self.pids] if handle == 1 else []

    def nvmlShutdown(self) -> None:
        self.shut = True


def sleeper(**env: str) -> subprocess.Popen:
    """A child with ``env`` added, returned once it runs (its /proc environ is its own only
    after the exec)."""
    base = {k: v for k, v in os.environ.items() if k not in NAMES}
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
        env={**base, **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "up"
    return child


def test_the_environment_a_process_started_with() -> None:
    child = sleeper(LOCAL_RANK="1")
    try:
        assert environment_of(child.pid, NAMES) == {"LOCAL_RANK": "1"}
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert environment_of(2**22 + 7, NAMES) == {}  # no such process


def test_the_watch_keeps_every_process_seen_and_skips_failed_samples() -> None:
    ranked, plain = sleeper(LOCAL_RANK="0", **{mixed_pair.RUN_MARKER: "t"}), sleeper()
    try:
        fake = FakeNvml([ranked.pid, plain.pid], fail_first=1)
        watch = GpuProcessWatch(fake, NAMES, interval_s=0.01).start()
        deadline = time.monotonic() + 10
        while watch.samples < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        seen = watch.stop()
    finally:
        for child in (ranked, plain):
            child.kill()
            child.wait()
            child.stdout.close()
    assert seen == {ranked.pid: {"LOCAL_RANK": "0", mixed_pair.RUN_MARKER: "t"}, plain.pid: {}}
    assert watch.samples >= 2 and fake.shut


def rank(local: str, token: str = "ours") -> dict:
    return {"LOCAL_RANK": local, mixed_pair.RUN_MARKER: token}


@pytest.mark.parametrize(
    "seen, status",
    [
        ({1: rank("0"), 2: rank("0")}, PASS),
        ({1: rank("0"), 2: rank("1")}, FAIL),
        ({1: rank("0"), 2: rank("1", token="another job")}, PASS),  # not this check's run
        ({1: {}, 2: rank("1", token="another job")}, SKIP),  # none of ours identified
        ({}, SKIP),
        (None, SKIP),
    ],
)
def test_the_cpu_context_row(tmp_path: pathlib.Path, seen, status) -> None:
    ctx = CheckContext(
        RowWriter(str(tmp_path / "rows.jsonl")), tmp_path, time.monotonic() + 60, Options()
    )
    mixed_pair._cpu_context_row(ctx, seen, 12, "ours", no_nvml=seen is None)
    (row,) = ctx.rows.rows
    assert (row.check, row.status) == ("mixed.cpu-context", status)


def test_without_pynvml_nvidia_smi_lists_the_processes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\n[ "$1" = "--query-compute-apps=pid" ] || exit 3\nprintf "4242\\n77\\n"\n'
    )
    smi.chmod(0o755)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not importable
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    module = gpu_processes.nvml()
    assert isinstance(module, gpu_processes.SmiProcesses)
    handle = module.nvmlDeviceGetHandleByIndex(0)
    assert [p.pid for p in module.nvmlDeviceGetComputeRunningProcesses(handle)] == [4242, 77]
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert gpu_processes.nvml() is None
