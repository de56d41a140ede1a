"""tools/testnet.py for real: namespaces on a bridge, shaped by tc, reachable from each other,
and removed again, also when a run left them behind (root and iproute2; skipped elsewhere)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator

import pytest

from megatron_het.testnet import netns

REPO = pathlib.Path(__file__).resolve().parents[1]
THREE_NODES = REPO / "scripts" / "clusters" / "testnet_3nodes.yaml"
TESTNET = [sys.executable, str(REPO / "tools" / "testnet.py")]


def _netns_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    name = f"mht-probe{secrets.token_hex(2)}"
    try:
        made = subprocess.run(["ip", "netns", "add", name], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"iproute2 does not run here ({exc})"
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    return None


pytestmark = [pytest.mark.netns]
_PROBLEM = _netns_problem()
if _PROBLEM is not None:
    pytestmark.append(pytest.mark.skip(reason=_PROBLEM))


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TESTNET, *args], capture_output=True, text=True, timeout=120, cwd=REPO, check=False
    )


@pytest.fixture
def run_id() -> Iterator[str]:
    """A fresh run id ("pt" and 4 hex digits); its network is removed after the test."""
    run = f"pt{secrets.token_hex(2)}"
    try:
        yield run
    finally:
        netns.down(run)


def in_namespace(namespace: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def htb_classes(run_id: str, node: int) -> str:
    """``tc class show`` of the node's eth0."""
    return subprocess.run(
        ["tc", "-n", f"mht-{run_id}-n{node}", "class", "show", "dev", "eth0"],
        capture_output=True, text=True, timeout=20, check=True,
    ).stdout  # fmt: skip


def test_up_connects_the_nodes_shapes_them_and_down_removes_everything(run_id: str) -> None:
    up = run_tool("up", "--cluster", str(THREE_NODES), "--scale", "0.1", "--run-id", run_id)
    assert up.returncode == 0, up.stderr
    assert f"testnet {run_id}: 3 node(s) of testnet_3nodes" in up.stdout
    status = run_tool("status")
    assert f"{run_id}: testnet_3nodes, 3 node(s), 3 namespace(s) present" in status.stdout
    # node 0 reaches node 2 over the bridge: a TCP connection between the namespaces
    assert _reaches(run_id, 0, 2, 5998)
    # the link between the kinds: its own HTB class at 0.5 GB/s x 0.1, for node 2's address
    classes = htb_classes(run_id, 0)
    assert re.search(r"class htb 1:100 parent 1:1 .*rate 400Mbit", classes), classes
    assert re.search(r"class htb 1:10 parent 1:1 .*rate 1Gbit", classes), classes
    down = run_tool("down", "--run-id", run_id)
    assert down.returncode == 0 and f"mht-{run_id}-n2" in down.stdout, down.stderr
    assert not [ns for ns in netns._namespaces() if run_id in ns]
    assert not netns.state_path(run_id).exists()


def test_a_second_up_of_a_run_is_one_line(run_id: str) -> None:
    assert run_tool("up", "--cluster", str(THREE_NODES), "--run-id", run_id).returncode == 0
    again = run_tool("up", "--cluster", str(THREE_NODES), "--run-id", run_id)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"error: testnet {run_id} is already up; run 'tools/testnet.py down --run-id {run_id}'"
        " first"
    ]


def test_what_a_crashed_run_left_is_found_and_removed(run_id: str) -> None:
    # a run whose up died before it recorded anything: a namespace and a bridge of its names
    subprocess.run(["ip", "netns", "add", f"mht-{run_id}-n0"], check=True, timeout=20)
    subprocess.run(["ip", "link", "add", f"mhtb{run_id}", "type", "bridge"], check=True, timeout=20)
    namespaces, bridges = netns.leftovers()
    assert f"mht-{run_id}-n0" in namespaces and f"mhtb{run_id}" in bridges
    assert f"leftover mht-{run_id}-n0" in run_tool("status").stdout
    removed = netns.down(run_id)
    assert removed == [f"mht-{run_id}-n0", f"mhtb{run_id}"]
    namespaces, bridges = netns.leftovers()
    assert f"mht-{run_id}-n0" not in namespaces and f"mhtb{run_id}" not in bridges


@pytest.mark.slow
def test_a_three_host_job_over_shaped_links_trains_as_one_process(
    run_id: str, tmp_path: pathlib.Path
) -> None:
    """torchrun on each of 3 hosts (2 emu-fast, 1 emu-slow with 2 ranks; EMULATION of the kinds'
    compute, real TCP between the namespaces), a 3-stage pipeline with a TP change: the
    single-process losses."""
    assert run_tool("up", "--cluster", str(THREE_NODES), "--scale", "0.1",
                    "--run-id", run_id).returncode == 0  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    train = ["--model", "tiny", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "300", "--seq-length", "32", "--lr", "1e-3", "--log-interval", "1",
             "--eval-iters", "0", "--train-iters", "8", "--seed", "1234"]  # fmt: skip
    job = run_tool(
        "run", "--run-id", run_id, "--log-dir", str(tmp_path / "logs"), "--timeout-s", "240",
        "--", sys.executable, "-m", "torch.distributed.run", "--nnodes", "{nnodes}",
        "--node-rank", "{node}", "--nproc-per-node", "{nproc}", "--master-addr",
        "{master_addr}", "--master-port", "29500", "pretrain_llama.py",
        "--cluster", str(THREE_NODES), "--plan", str(REPO / "scripts/plans/testnet_3nodes_pp3.json"),
        *train, "--metrics-file", str(metrics),
    )  # fmt: skip
    logs = "".join(p.read_text()[-2000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert job.returncode == 0, logs
    assert [f"node {n}: exit status 0" in job.stdout for n in range(3)] == [True] * 3
    reference = tmp_path / "reference.jsonl"
    alone = subprocess.run(
        [sys.executable, "pretrain_llama.py", *train, "--global-batch-size", "8",
         "--micro-batch-size", "2", "--metrics-file", str(reference)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-2000:]
    got = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    want = [json.loads(line)["loss"] for line in reference.read_text().splitlines()]
    assert len(got) == len(want) == 8
    for a, b in zip(got, want):
        assert abs(a - b) <= 2e-4 * abs(b), (got, want)


def _reaches(run_id: str, src: int, dst: int, port: int) -> bool:
    """Whether node ``src`` opens a TCP connection to node ``dst`` within 2 s."""
    address = f"10.213.0.{dst + 1}"
    server = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            f"mht-{run_id}-n{dst}",
            sys.executable,
            "-c",
            f"import socket; s = socket.create_server(('{address}', {port})); s.settimeout(8); "
            "c, _ = s.accept(); c.sendall(b'ok')",
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = in_namespace(
            f"mht-{run_id}-n{src}",
            "import socket, time\n"
            "for _ in range(40):\n"
            "    try:\n"
            f"        c = socket.create_connection(('{address}', {port}), timeout=2); break\n"
            "    except ConnectionRefusedError:\n"
            "        time.sleep(0.05)\n"
            "    except OSError:\n"
            "        raise SystemExit(3)\n"
            "print(c.recv(2).decode())",
        )
        return client.stdout.strip() == "ok"
    finally:
        server.kill()
        server.wait(10)


def test_faults_pull_a_cable_replug_it_and_cut_a_rate(run_id: str) -> None:
    assert run_tool("up", "--cluster", str(THREE_NODES), "--scale", "0.1",
                    "--run-id", run_id).returncode == 0  # fmt: skip
    assert _reaches(run_id, 0, 2, 5997)
    down = run_tool("fault", "--run-id", run_id, "--node", "2", "--link", "down")
    assert down.returncode == 0 and "node 2: link down" in down.stdout, down.stderr
    assert not _reaches(run_id, 0, 2, 5996)
    assert run_tool("fault", "--run-id", run_id, "--node", "2", "--link", "up").returncode == 0
    assert _reaches(run_id, 0, 2, 5995)
    cut = run_tool("fault", "--run-id", run_id, "--node", "0", "--rate-fraction", "0.1")
    assert cut.returncode == 0 and "node 0: rates x 0.1" in cut.stdout, cut.stderr
    classes = htb_classes(run_id, 0)
    assert re.search(r"class htb 1:10 parent 1:1 .*rate 100Mbit", classes), classes
    assert re.search(r"class htb 1:100 parent 1:1 .*rate 40Mbit", classes), classes
    bad = run_tool("fault", "--run-id", run_id, "--node", "7", "--link", "down")
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"error: --node 7 is not a node of testnet {run_id} (0-2)"
