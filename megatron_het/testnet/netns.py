"""Build, list and remove test networks (:mod:`megatron_het.testnet.topology`) with iproute2.

Everything goes through ``ip`` and ``tc`` (``-n NAMESPACE`` inside a node), each call bounded
by a timeout. A run's plan is recorded in ``STATE_DIR/<run>.json`` (a tmpfs: it goes with the
namespaces at reboot) once the network is up. :func:`down` removes a run by its names, so it
also cleans a run whose ``up`` died half-way; :func:`leftovers` finds namespaces and bridges of
ours that no record names (a crashed run's), and ``down(None)`` removes every one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_het.errors import UserError
from megatron_het.fileio import write_text_atomically
from megatron_het.testnet.topology import (
    PREFIX,
    PREFIX_LEN,
    PeerShape,
    Shape,
    TestnetNode,
    TestnetPlan,
    bridge_name,
    namespace_name,
)

STATE_DIR = Path(os.environ.get("MEGATRON_HET_TESTNET_DIR", "/run/megatron_het_testnet"))
COMMAND_TIMEOUT_S = 20.0
# netem's queue, in packets: enough for a scaled link's bandwidth-delay product
NETEM_LIMIT = 100000
HTB_QUANTUM = 60000  # bytes a class sends per round; HTB's default from rate/10 is too big


def check_host(euid: int | None = None) -> None:
    """One clear line unless this process can build namespaces: root, ``ip`` and ``tc``."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise UserError(
            "testnet needs root (it creates network namespaces, veth pairs, a bridge and tc "
            "qdiscs); run it with sudo or as root"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise UserError(f"testnet needs iproute2's {tool!r}, which is not on PATH")


def run_command(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise UserError(
            f"testnet: {' '.join(argv)} did not finish in {COMMAND_TIMEOUT_S:g} s"
        ) from None
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise UserError(
            f"testnet: {' '.join(argv)} failed: {detail[0] if detail else done.returncode}"
        )
    return done


# ---- the commands of one plan --------------------------------------------------------------
def link_commands(plan: TestnetPlan) -> list[list[str]]:
    """The bridge, then every node's namespace, veth pair and address (no shaping)."""
    out = [
        ["ip", "link", "add", plan.bridge, "type", "bridge"],
        ["ip", "link", "set", plan.bridge, "up"],
    ]
    for node in plan.nodes:
        ns = node.namespace
        out += [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", ns],
            ["ip", "link", "set", node.veth, "master", plan.bridge, "up"],
            ["ip", "-n", ns, "addr", "add", f"{node.address}/{PREFIX_LEN}", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
    return out


def shaping_commands(
    node: TestnetNode, netem: bool = True, device: str = "eth0"
) -> list[list[str]]:
    """HTB + netem on ``node``'s egress (see :mod:`megatron_het.testnet.topology`): class 1:1
    the NIC, 1:10 its default traffic, 1:(100 + i) the path to its i-th shaped peer.
    ``netem=False`` (a kernel without it): the classes' rates only, no delay."""
    tc = ["tc", "-n", node.namespace]
    out = [
        [*tc, "qdisc", "replace", "dev", device, "root", "handle", "1:", "htb", "default", "10"],
        [*tc, "class", "add", "dev", device, "parent", "1:", "classid", "1:1", "htb"]
        + htb_args(node.nic.rate_bit),
    ]
    classes = [(10, node.nic, None)] + [
        (100 + i, peer.shape, peer.address) for i, peer in enumerate(node.peers)
    ]
    for minor, shape, address in classes:
        out.append(
            [*tc, "class", "add", "dev", device, "parent", "1:1", "classid", f"1:{minor}", "htb"]
            + htb_args(shape.rate_bit)  # (a peer's rate is at most the NIC's: topology)
        )
        if netem:
            out.append(
                [*tc, "qdisc", "add", "dev", device, "parent", f"1:{minor}", "handle", f"{minor}:"]
                + _netem(shape)
            )
        if address is not None:
            out.append(
                [*tc, "filter", "add", "dev", device, "parent", "1:", "protocol", "ip"]
                + ["prio", "1", "u32", "match", "ip", "dst", f"{address}/32"]
                + ["flowid", f"1:{minor}"]
            )
    return out


def htb_args(rate_bit: float) -> list[str]:
    """An HTB class's rate, ceiling and quantum at ``rate_bit`` bits per second."""
    rate = f"{max(8, round(rate_bit))}bit"
    return ["rate", rate, "ceil", rate, "quantum", str(HTB_QUANTUM)]


def _netem(shape: Shape) -> list[str]:
    return ["netem", "delay", f"{shape.delay_us:.0f}us", "limit", str(NETEM_LIMIT)]


# ---- up, down, status ------------------------------------------------------------------------
def state_path(run_id: str) -> Path:
    return STATE_DIR / f"{run_id}.json"


def up(plan: TestnetPlan) -> Path:
    """Build ``plan``'s network and record it; on any failure remove what was built and raise.
    A run id already recorded or whose names exist is refused (``down`` it first)."""
    check_host()
    if state_path(plan.run_id).exists() or _exists_namespace(plan.nodes[0].namespace):
        raise UserError(
            f"testnet {plan.run_id} is already up; run 'tools/testnet.py down --run-id "
            f"{plan.run_id}' first"
        )
    try:
        for argv in link_commands(plan):
            run_command(argv)
        netem = has_netem(plan.nodes[0].namespace)
        for node in plan.nodes:
            for argv in shaping_commands(node, netem):
                run_command(argv)
    except BaseException:
        _remove(plan.run_id, len(plan.nodes))
        raise
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    record = {**plan_to_dict(plan), "netem": netem}
    write_text_atomically(state_path(plan.run_id), json.dumps(record, indent=1))
    return state_path(plan.run_id)


def has_netem(namespace: str) -> bool:
    """Whether this kernel has the netem qdisc (tried on ``namespace``'s loopback); without
    it the links keep their rates but get no delay from tc."""
    added = run_command(
        ["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us"],
        check=False,
    )
    if added.returncode != 0:
        return False
    run_command(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"], check=False)
    return True


def netem_of(run_id: str) -> bool | None:
    """Whether run ``run_id`` was shaped with netem (None: no record)."""
    try:
        return bool(json.loads(state_path(run_id).read_text())["netem"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def down(run_id: str | None) -> list[str]:
    """Remove run ``run_id`` (None: every run recorded and every leftover of ours); returns
    what was removed. Removing what is not there is not an error."""
    check_host()
    removed: list[str] = []
    runs = [run_id] if run_id is not None else [p.stem for p in _records()]
    for run in runs:
        record = load_plan(run)
        count = len(record.nodes) if record is not None else _count_namespaces(run)
        removed += _remove(run, count)
    if run_id is None:
        namespaces, bridges = leftovers()
        for ns in namespaces:
            run_command(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
        for bridge in bridges:
            run_command(["ip", "link", "del", bridge], check=False)
            removed.append(bridge)
    return removed


def _remove(run_id: str, count: int) -> list[str]:
    """Delete run ``run_id``'s namespaces (their veth pairs go with them), bridge and record."""
    removed = []
    for node in range(count):
        ns = namespace_name(run_id, node)
        if run_command(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    bridge = bridge_name(run_id)
    if run_command(["ip", "link", "del", bridge], check=False).returncode == 0:
        removed.append(bridge)
    state_path(run_id).unlink(missing_ok=True)
    return removed


def _records() -> list[Path]:
    return sorted(STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []


def _namespaces() -> list[str]:
    done = run_command(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _exists_namespace(name: str) -> bool:
    return name in _namespaces()


def _count_namespaces(run_id: str) -> int:
    """How many node namespaces to try for a run without a record (up to the highest found)."""
    prefix = f"{PREFIX}-{run_id}-n"
    found = [int(ns[len(prefix) :]) for ns in _namespaces() if ns.startswith(prefix)]
    return max(found) + 1 if found else 0


def leftovers() -> tuple[list[str], list[str]]:
    """Namespaces and bridges with our names that no record accounts for."""
    recorded = {p.stem for p in _records()}

    def ours(name: str, prefix: str) -> bool:
        run = name[len(prefix) :].split("-")[0]
        return name.startswith(prefix) and run not in recorded

    namespaces = [ns for ns in _namespaces() if ours(ns, f"{PREFIX}-")]
    done = run_command(["ip", "-o", "link", "show", "type", "bridge"], check=False)
    bridges = [
        line.split(":")[1].strip()
        for line in done.stdout.splitlines()
        if line.count(":") >= 2 and ours(line.split(":")[1].strip(), f"{PREFIX}b")
    ]
    return namespaces, bridges


def status() -> list[str]:
    """One line per recorded run (with its namespaces present / expected) and per leftover."""
    check_host()
    present = set(_namespaces())
    lines = []
    for path in _records():
        plan = load_plan(path.stem)
        if plan is None:
            continue
        up_now = sum(node.namespace in present for node in plan.nodes)
        delay = "latencies by netem" if netem_of(plan.run_id) else "no latencies (no netem)"
        lines.append(
            f"{plan.run_id}: {plan.cluster}, {len(plan.nodes)} node(s), {up_now} namespace(s) "
            f"present, bridge {plan.bridge}, scale {plan.scale:g}, {delay}"
        )
    namespaces, bridges = leftovers()
    for name in namespaces + bridges:
        lines.append(f"leftover {name} (no record; 'tools/testnet.py down' removes it)")
    return lines


# ---- records -------------------------------------------------------------------------------
def plan_to_dict(plan: TestnetPlan) -> dict[str, Any]:
    return {"format": "megatron_het.testnet/1", **dataclasses.asdict(plan)}


def plan_from_dict(data: dict[str, Any]) -> TestnetPlan:
    nodes = tuple(
        TestnetNode(
            **{
                **n,
                "groups": tuple(n["groups"]),
                "nic": Shape(**n["nic"]),
                "peers": tuple(
                    PeerShape(**{**p, "shape": Shape(**p["shape"])}) for p in n["peers"]
                ),
            }
        )
        for n in data["nodes"]
    )
    return TestnetPlan(data["run_id"], data["cluster"], data["scale"], data["bridge"], nodes)


def load_plan(run_id: str) -> TestnetPlan | None:
    """The recorded plan of ``run_id``; None if there is none (or it cannot be read)."""
    try:
        data = json.loads(state_path(run_id).read_text())
        data.pop("format", None)
        data.pop("netem", None)
        return plan_from_dict(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


__all__ = [
    "STATE_DIR",
    "check_host",
    "down",
    "htb_args",
    "leftovers",
    "link_commands",
    "load_plan",
    "run_command",
    "plan_from_dict",
    "plan_to_dict",
    "shaping_commands",
    "status",
    "up",
]
