"""Network faults on a test network (``testnet.py fault``), each as iproute2/nftables commands.

- ``down`` / ``up``: the node's cable. The bridge end of its veth pair goes down (the node's
  ``eth0`` keeps its address and sees no carrier) or back up.
- ``rate``: the node's shaped rates times a fraction (its NIC and every link from it, or only
  the link to ``to_node``); ``--rate-fraction 1`` restores the cluster file's.
- ``loss``: drop that percentage of the packets the node sends (to ``to_node`` or to all),
  with nftables' random number match (netem is not in every kernel); ``--loss 0`` removes it.

:func:`wait_for_iteration` holds a fault back until a run's metrics file has logged an
iteration (bounded by a deadline).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from megatron_het.errors import UserError
from megatron_het.testnet.netns import htb_args
from megatron_het.testnet.topology import TestnetNode, TestnetPlan

NFT_TABLE = "megatron_het_testnet"


def link_state_commands(node: TestnetNode, up: bool) -> list[list[str]]:
    return [["ip", "link", "set", node.veth, "up" if up else "down"]]


def rate_commands(
    node: TestnetNode, fraction: float, to_node: int | None = None
) -> list[list[str]]:
    """``tc class change`` of the node's classes at ``fraction`` of the planned rates."""
    if not fraction > 0:
        raise UserError(f"--rate-fraction must be positive, got {fraction}")
    tc = ["tc", "-n", node.namespace, "class", "change", "dev", "eth0"]

    def change(minor: int, parent: str, rate_bit: int) -> list[str]:
        classid = f"1:{minor}"
        return [*tc, "parent", parent, "classid", classid, "htb", *htb_args(rate_bit * fraction)]

    peers = [(100 + i, p) for i, p in enumerate(node.peers)]
    if to_node is not None:
        chosen = [(minor, p) for minor, p in peers if p.node == to_node]
        if not chosen:
            raise UserError(
                f"node {node.node} has no shaped link to node {to_node} (only its NIC: leave "
                "out --to-node)"
            )
        return [change(m, "1:1", p.shape.rate_bit) for m, p in chosen]
    out = [change(1, "1:", node.nic.rate_bit), change(10, "1:1", node.nic.rate_bit)]
    return out + [change(m, "1:1", p.shape.rate_bit) for m, p in peers]


def loss_commands(
    plan: TestnetPlan, node: TestnetNode, percent: float, to_node: int | None = None
) -> list[list[str]]:
    """nftables rules in the node's namespace dropping ``percent`` % of its sent packets (0:
    the table is removed)."""
    if not 0 <= percent <= 100:
        raise UserError(f"--loss must be a percentage from 0 to 100, got {percent}")
    nft = ["ip", "netns", "exec", node.namespace, "nft"]
    out = [[*nft, "delete", "table", "inet", NFT_TABLE]]  # (a missing table: ignored)
    if percent == 0:
        return out
    match = []
    if to_node is not None:
        match = ["ip", "daddr", plan.node(to_node).address]
    # numgen random mod 10000 < percent * 100: a packet is dropped with that probability
    rule = [*match, "numgen", "random", "mod", "10000", "<", str(round(percent * 100)), "drop"]
    return out + [
        [*nft, "add", "table", "inet", NFT_TABLE],
        [
            *nft,
            "add",
            "chain",
            "inet",
            NFT_TABLE,
            "out",
            "{ type filter hook output priority 0 ; }",
        ],  # fmt: skip
        [*nft, "add", "rule", "inet", NFT_TABLE, "out", *rule],
    ]


def check_nft() -> None:
    if shutil.which("nft") is None:
        raise UserError(
            "--loss needs nftables' nft (the kernel's netem is not used: not every kernel has "
            "it); install it with 'apt-get install nftables'"
        )


def wait_for_iteration(metrics: Path, iteration: int, timeout_s: float) -> None:
    """Return once ``metrics`` (a run's --metrics-file) has logged ``iteration``; a UserError
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _logged(metrics) >= iteration:
            return
        time.sleep(0.05)
    raise UserError(f"{metrics} did not log iteration {iteration} within {timeout_s:g} s")


def _logged(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    last = 0
    for line in lines:
        try:
            last = max(last, int(json.loads(line)["iteration"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line being written
    return last


__all__ = [
    "check_nft",
    "link_state_commands",
    "loss_commands",
    "rate_commands",
    "wait_for_iteration",
]
