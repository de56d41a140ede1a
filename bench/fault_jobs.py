"""A torchrun job on the emulated cluster that a fault can be injected into (EMULATION).

Used by bench/faults.py and tests/test_faults_cli.py: start the job, wait until it has logged
some iterations, send a signal to the worker of one rank (or to a whole node: its torchrun agent
and workers), and collect its output with the time every line arrived. A multi-node job runs
one torchrun agent per node on this host (:func:`node_torchrun`).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from megatron_het.perf.measure.worker_processes import free_loopback_port

REPO = pathlib.Path(__file__).resolve().parent.parent

CLUSTER = REPO / "scripts" / "clusters" / "cpu_emulated.yaml"
PLAN = REPO / "scripts" / "plans" / "cpu_emulated_dp2_fast_heavy.json"  # logging rank: 2
MODEL_FLAGS = (
    "--model",
    "tiny",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "300",
    "--seq-length",
    "32",
    "--lr",
    "1e-3",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
)
# EMULATION: the emulated kinds on two nodes (ranks 0-1 emu-fast on node 0, 2-3 emu-slow on
# node 1): a multi-node job on this host, one torchrun agent and supervisor per node
TWO_NODE_CLUSTER = """\
name: two_nodes_emulated
node_groups:
  - {name: fast, accelerator: emu-fast, nodes: 1, devices_per_node: 2,
     nic_bandwidth_gbit_per_s: 10}
  - {name: slow, accelerator: emu-slow, nodes: 1, devices_per_node: 2,
     nic_bandwidth_gbit_per_s: 10}
links:
  - {groups: [fast, slow], bandwidth_gbps: 2.0, latency_us: 50, emulated: true}
"""
# EMULATION: cpu_emulated.yaml without rank 1 (one emu-fast device lost)
CLUSTER_WITHOUT_RANK_1 = """\
name: cpu_emulated_without_rank_1
node_groups:
  - {name: fast, accelerator: emu-fast, nodes: 1, devices_per_node: 1,
     nic_bandwidth_gbit_per_s: 10}
  - {name: slow, accelerator: emu-slow, nodes: 1, devices_per_node: 2,
     nic_bandwidth_gbit_per_s: 10, colocate_with: fast}
links:
  - {groups: [fast, slow], bandwidth_gbps: 2.0, latency_us: 50, emulated: true}
"""


def supervised(flags: Sequence[str]) -> list[str]:
    """tools/elastic_run.py over ``pretrain_llama.py`` with ``flags`` (on every device of the
    cluster the flags name)."""
    return [sys.executable, str(REPO / "tools" / "elastic_run.py"), "--", *MODEL_FLAGS, *flags]


def torchrun(nproc: int, flags: Sequence[str]) -> list[str]:
    """The torchrun command of ``pretrain_llama.py`` on ``nproc`` local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "pretrain_llama.py",
        *MODEL_FLAGS,
        *flags,
    ]


def free_port() -> int:
    """A port of the loopback interface free now, with the 3 after it (a supervisor's
    relaunches take the next ports)."""
    return free_loopback_port(span=4)


def node_torchrun(
    node_rank: int, nnodes: int, nproc: int, port: int, flags: Sequence[str]
) -> list[str]:
    """Node ``node_rank``'s torchrun of ``pretrain_llama.py`` in a job of ``nnodes`` nodes of
    ``nproc`` ranks each, with static rendezvous at 127.0.0.1:``port``: node 0's agent serves
    the job's store (as the launcher, megatron_het/launcher/, starts each node)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "pretrain_llama.py",
        *MODEL_FLAGS,
        *flags,
    ]


def train_losses(metrics: pathlib.Path) -> dict[int, float]:
    """Iteration -> training loss from a metrics file."""
    return {
        r["iteration"]: r["loss"]
        for r in map(json.loads, metrics.read_text().splitlines())
        if r.get("split", "train") == "train"
    }


class Job:
    """A running torchrun job; its stdout and stderr lines are kept with their arrival time."""

    def __init__(self, cmd: Sequence[str]) -> None:
        self.cmd = list(cmd)
        self.launcher = subprocess.Popen(
            self.cmd,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: dict[str, list[tuple[float, str]]] = {"stdout": [], "stderr": []}
        self._readers = [
            threading.Thread(target=self._read, args=(name, stream), daemon=True)
            for name, stream in (("stdout", self.launcher.stdout), ("stderr", self.launcher.stderr))
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str, stream) -> None:
        for line in stream:
            self.lines[name].append((time.monotonic(), line.rstrip("\n")))

    def text(self, name: str) -> str:
        return "\n".join(line for _, line in self.lines[name])

    def wait_for_iterations(
        self, metrics: pathlib.Path, count: int, timeout_s: float = 120
    ) -> None:
        """Block until ``metrics`` holds ``count`` lines; AssertionError if the job ends or
        does not get there in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= count):
            if self.launcher.poll() is not None:
                self.wait(5)
                raise AssertionError(f"the job ended first:\n{self.text('stderr')[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("the job did not reach iteration {count}")
            time.sleep(0.05)

    def worker_pid(self, rank: int) -> int:
        """The pid of the worker with RANK=rank (a child of torchrun, which may itself run
        under a supervisor)."""
        todo = [self.launcher.pid]
        while todo:
            pid = todo.pop()
            try:
                children = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except FileNotFoundError:
                continue
            for child in children:
                try:
                    environ = pathlib.Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                except FileNotFoundError:
                    continue
                if f"RANK={rank}".encode() in environ:
                    return int(child)
                todo.append(int(child))
        raise AssertionError(f"no worker with RANK={rank}")

    def processes(self) -> list[int]:
        """The launcher and all its descendants (torchrun's workers run in sessions of their
        own, so a signal to the launcher's process group misses them); none once the launcher
        has been waited for (its pid may be another process's by then)."""
        if self.launcher.returncode is not None:
            return []
        found, todo = [], [self.launcher.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                tasks = list(pathlib.Path(f"/proc/{pid}/task").iterdir())
            except FileNotFoundError:
                continue
            for task in tasks:
                try:
                    todo += [int(c) for c in (task / "children").read_text().split()]
                except FileNotFoundError:
                    pass
        return found

    def send_all(self, signum: int) -> float:
        """Send ``signum`` to the launcher and every descendant at once (a whole node: its
        agent and workers); returns the monotonic time."""
        for pid in self.processes():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        return time.monotonic()

    def send(self, rank: int, signum: int) -> float:
        """Send ``signum`` to rank ``rank``'s worker; returns the monotonic time."""
        os.kill(self.worker_pid(rank), signum)
        return time.monotonic()

    def wait(self, timeout_s: float) -> int:
        """Wait for the job (killing it, workers included, after ``timeout_s``); returns its
        exit status."""
        try:
            self.launcher.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.send_all(signal.SIGKILL)
            self.launcher.wait()
        for reader in self._readers:
            reader.join(timeout=5)
        return self.launcher.returncode

    def first_line_time(self, name: str, needle: str) -> float | None:
        """Arrival time of the first ``name`` line containing ``needle`` (None: none)."""
        return next((t for t, line in self.lines[name] if needle in line), None)
