"""One command per node of a test network, each inside its node's namespace (``testnet.py run``).

The command is a template: ``{node}`` (the node's index, torchrun's ``--node-rank``),
``{nnodes}``, ``{nproc}`` (the node's ranks in the cluster file), ``{master_addr}`` (node 0's
address) and ``{address}`` (the node's own) are replaced in every argument; nothing else is
touched. Each node's process runs under ``ip netns exec`` with ``GLOO_SOCKET_IFNAME=eth0``
(the namespaces share the machine's hostname, which resolves to loopback, so gloo must be
told its interface), in its own session, with its output in ``<log_dir>/node<K>.log``. All
are waited for until a deadline; past it every node's processes are killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_het.errors import UserError
from megatron_het.testnet.topology import TestnetNode, TestnetPlan

PLACEHOLDERS = ("{node}", "{nnodes}", "{nproc}", "{master_addr}", "{address}")
INTERFACE = "eth0"


def node_command(template: Sequence[str], plan: TestnetPlan, node: TestnetNode) -> list[str]:
    """``template`` with the placeholders of ``node`` filled in."""
    values = {
        "{node}": str(node.node),
        "{nnodes}": str(len(plan.nodes)),
        "{nproc}": str(node.nproc),
        "{master_addr}": plan.nodes[0].address,
        "{address}": node.address,
    }
    out = []
    for arg in template:
        for key, value in values.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out


@dataclass(frozen=True)
class NodeResult:
    node: int
    returncode: int
    log: Path


def run_on_nodes(
    plan: TestnetPlan,
    template: Sequence[str],
    log_dir: Path,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> list[NodeResult]:
    """Start ``template`` on every node at once and wait for all of them (at most
    ``timeout_s``; then every node's process group is killed and a UserError says so)."""
    if not template:
        raise UserError("testnet.py run needs a command after '--'")
    log_dir.mkdir(parents=True, exist_ok=True)
    extra = {"GLOO_SOCKET_IFNAME": INTERFACE, **(env or {})}
    started: list[tuple[TestnetNode, subprocess.Popen[bytes], Path]] = []
    try:
        for node in plan.nodes:
            log = log_dir / f"node{node.node}.log"
            argv = ["ip", "netns", "exec", node.namespace, "env"]
            argv += [f"{k}={v}" for k, v in extra.items()]
            argv += node_command(template, plan, node)
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            started.append((node, proc, log))
        deadline = time.monotonic() + timeout_s
        results = []
        for node, proc, log in started:
            left = max(0.0, deadline - time.monotonic())
            try:
                results.append(NodeResult(node.node, proc.wait(timeout=left), log))
            except subprocess.TimeoutExpired:
                raise UserError(
                    f"testnet run: node {node.node} did not finish in {timeout_s:g} s "
                    f"(its output: {log}); every node's processes were stopped"
                ) from None
        return results
    finally:
        for _, proc, _ in started:
            if proc.poll() is None:
                _kill_session(proc)


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


__all__ = ["PLACEHOLDERS", "NodeResult", "node_command", "run_on_nodes"]
