"""Which processes hold a context on the GPU while a run goes on, from NVML (``pynvml``, which
``nvidia-ml-py`` installs, else ``nvidia-smi``, which comes with the driver): a CPU rank on a
GPU host must hold none (no CUDA context on GPU 0 beside the GPU ranks', see
:func:`megatron_het.launcher.rank_device.select_local_device`).

A thread samples NVML's compute processes every ``interval_s`` and keeps, per process id, the
variables ``names`` of its environment (``LOCAL_RANK``, which torchrun sets, and a marker the
check gives its own runs, since NVML lists every process on the host's GPUs, other jobs' too).
NVML calls create no CUDA context.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import threading
from collections.abc import Sequence
from typing import Any


def nvml() -> Any | None:
    """The initialised ``pynvml`` module, else :class:`SmiProcesses` where ``nvidia-smi`` is
    on the PATH, else None."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        smi = shutil.which("nvidia-smi")
        return SmiProcesses(smi) if smi else None
    return pynvml


class SmiProcesses:
    """The part of ``pynvml`` the watch uses, from ``nvidia-smi --query-compute-apps=pid``:
    one handle that lists the compute processes of every GPU."""

    def __init__(self, command: str) -> None:
        self.command = command

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        out = subprocess.run(
            [self.command, "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return [_Process(int(line)) for line in out.split() if line.strip().isdigit()]

    def nvmlShutdown(self) -> None:
        pass


class _Process:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def environment_of(pid: int, names: Sequence[str]) -> dict[str, str]:
    """The variables ``names`` that process ``pid`` started with (its ``/proc`` environ);
    empty where the process is gone or not readable (another user's, another namespace's)."""
    try:
        raw = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    found = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        key = name.decode(errors="replace")
        if sep and key in names:
            found[key] = value.decode(errors="replace")
    return found


class GpuProcessWatch:
    """Samples the compute processes of every GPU from a thread between ``start()`` and
    ``stop()``; ``seen`` maps each process id to the variables ``names`` of its environment."""

    def __init__(self, module: Any, names: Sequence[str], interval_s: float = 0.25) -> None:
        self.nvml, self.names, self.interval_s = module, tuple(names), interval_s
        self.seen: dict[int, dict[str, str]] = {}
        self.samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-process-watch", daemon=True)

    def start(self) -> GpuProcessWatch:
        self._thread.start()
        return self

    def stop(self) -> dict[int, dict[str, str]]:
        """Stop sampling (and NVML); what was seen."""
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s + 5)
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass
        with self._lock:
            return dict(self.seen)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        """One sample of every device's compute processes."""
        try:
            count = self.nvml.nvmlDeviceGetCount()
            pids = [
                process.pid
                for index in range(count)
                for process in self.nvml.nvmlDeviceGetComputeRunningProcesses(
                    self.nvml.nvmlDeviceGetHandleByIndex(index)
                )
            ]
        except Exception:
            return
        with self._lock:
            for pid in pids:
                if not self.seen.get(pid):
                    self.seen[pid] = environment_of(pid, self.names)
            self.samples += 1
