"""A test network for a cluster file: one network namespace per node on a private bridge, each
node's egress shaped to the cluster's figures (what :mod:`megatron_het.testnet.netns` builds).

Every node of the cluster becomes a namespace ``mht-<run>-n<node>`` with one interface, ``eth0``
(a veth pair whose other end joins the bridge ``mhtb<run>``), addressed ``10.213.x.y/16``. Only
those namespaces sit on the bridge and the bridge has no address, so traffic between them
never leaves the machine and the machine itself cannot reach them.

Shaping, on each node's ``eth0`` (its egress; the peer shapes the way back):

- the node's NIC: an HTB class at ``nic_bandwidth_gbit_per_s`` (the lowest of the node's
  groups where groups share a node) that every flow of the node shares, with the NIC's latency
  as a netem delay for traffic to nodes of its own group(s);
- each explicit ``links:`` entry between one of the node's groups and another node's group:
  a class per destination node at the link's bandwidth (at most the NIC's), filtered by the
  destination address, with the link's latency as its netem delay. Defaulted links (no
  entry) are the NIC.

``scale`` dilates the links' time so a small host can carry the cluster: bandwidths are
multiplied by it and latencies divided by it (``scale=0.01``: a 10 GB/s NIC carries 100 MB/s
and 5 us become 500 us), the way an emulated cluster's kinds are slowed. The figures are the
cluster file's; only the links are real here (kinds' compute stays emulated).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_het.cluster import ClusterSpec
from megatron_het.errors import UserError

PREFIX = "mht"  # every name this package gives starts with it (namespaces, links, bridges)
SUBNET = "10.213"  # /16, the same in every run: each run's namespaces see only their bridge
PREFIX_LEN = 16
_RUN_ID = re.compile(r"^[0-9a-z]{1,6}$")
MAX_NODES = 250 * 250


@dataclass(frozen=True)
class Shape:
    """One shaped path: ``rate_bit`` bits per second and ``delay_us`` one-way delay."""

    rate_bit: int
    delay_us: float


@dataclass(frozen=True)
class PeerShape:
    """Traffic from a node to the node at ``address`` (its node index ``node``) over a link of
    the cluster file (``why`` names it)."""

    node: int
    address: str
    shape: Shape
    why: str


@dataclass(frozen=True)
class TestnetNode:
    """One node of the cluster as a namespace."""

    node: int
    groups: tuple[str, ...]
    nproc: int
    namespace: str
    veth: str  # the host end, on the bridge; the namespace's end is eth0
    address: str
    nic: Shape
    peers: tuple[PeerShape, ...]


@dataclass(frozen=True)
class TestnetPlan:
    """Every name, address and shape of one test network (``run_id`` tells runs apart)."""

    run_id: str
    cluster: str
    scale: float
    bridge: str
    nodes: tuple[TestnetNode, ...]

    def node(self, index: int) -> TestnetNode:
        return self.nodes[index]


def check_run_id(run_id: str) -> str:
    """``run_id`` if it is 1-6 lowercase letters or digits (names must fit Linux's 15
    characters), else a UserError."""
    if not _RUN_ID.match(run_id):
        raise UserError(f"testnet run id {run_id!r} must be 1-6 lowercase letters or digits")
    return run_id


def namespace_name(run_id: str, node: int) -> str:
    return f"{PREFIX}-{run_id}-n{node}"


def bridge_name(run_id: str) -> str:
    return f"{PREFIX}b{run_id}"


def node_address(node: int) -> str:
    if not 0 <= node < MAX_NODES:
        raise UserError(f"a testnet holds at most {MAX_NODES} nodes, node {node} asked")
    return f"{SUBNET}.{node // 250}.{node % 250 + 1}"


def _shape(bandwidth_gbps: float, latency_us: float, scale: float) -> Shape:
    """GB/s and microseconds of the cluster file at ``scale`` (see the module docstring)."""
    return Shape(max(8, round(bandwidth_gbps * 8e9 * scale)), latency_us / scale)


def plan_testnet(cluster: ClusterSpec, run_id: str, scale: float = 1.0) -> TestnetPlan:
    """The test network of ``cluster`` (names, addresses, shapes); nothing is changed here."""
    check_run_id(run_id)
    if not scale > 0:
        raise UserError(f"--scale must be positive, got {scale}")
    infos = cluster.nodes()
    if len(infos) > MAX_NODES:
        raise UserError(
            f"a testnet holds at most {MAX_NODES} nodes; {cluster.name} has {len(infos)}"
        )
    nodes = []
    for info in infos:
        groups = [cluster.group(g) for g in info.groups]
        nic_group = min(groups, key=lambda g: g.nic_bandwidth_gbps)
        nic = _shape(nic_group.nic_bandwidth_gbps, nic_group.nic_latency_us, scale)
        peers = []
        for other in infos:
            if other.node == info.node:
                continue
            link = _explicit_link(cluster, info.groups, other.groups)
            if link is None:
                continue
            (a, b), bandwidth, latency = link
            shape = _shape(min(bandwidth, nic_group.nic_bandwidth_gbps), latency, scale)
            peers.append(
                PeerShape(other.node, node_address(other.node), shape, f"link {a} <-> {b}")
            )
        nodes.append(
            TestnetNode(
                node=info.node,
                groups=tuple(info.groups),
                nproc=info.nproc,
                namespace=namespace_name(run_id, info.node),
                veth=f"{PREFIX}{run_id}n{info.node}",
                address=node_address(info.node),
                nic=nic,
                peers=tuple(peers),
            )
        )
    return TestnetPlan(run_id, cluster.name, scale, bridge_name(run_id), tuple(nodes))


def _explicit_link(
    cluster: ClusterSpec, mine: tuple[str, ...], theirs: tuple[str, ...]
) -> tuple[tuple[str, str], float, float] | None:
    """The slowest explicit ``links:`` entry between a group of ``mine`` and a different group
    of ``theirs`` (None where the nodes share a group or no entry joins them: the NIC)."""
    if set(mine) & set(theirs):
        return None
    found = [
        cluster.group_link(a, b) for a in mine for b in theirs if cluster.group_link(a, b).explicit
    ]
    if not found:
        return None
    slowest = min(found, key=lambda link: link.bandwidth_gbps)
    return slowest.groups, slowest.bandwidth_gbps, slowest.latency_us


def describe(plan: TestnetPlan) -> str:
    """A few lines: every node's namespace, address and shapes."""
    lines = [
        f"testnet {plan.run_id}: {len(plan.nodes)} node(s) of {plan.cluster} on bridge "
        f"{plan.bridge}, links at scale {plan.scale:g}"
    ]
    for node in plan.nodes:
        lines.append(
            f"  node {node.node} ({', '.join(node.groups)}; {node.nproc} rank(s)): "
            f"{node.namespace} {node.address}, NIC {_rate(node.nic)}"
        )
        for peer in node.peers:
            lines.append(f"    to node {peer.node} ({peer.why}): {_rate(peer.shape)}")
    return "\n".join(lines)


def _rate(shape: Shape) -> str:
    return f"{shape.rate_bit / 8e6:g} MB/s, {shape.delay_us:g} us"


__all__ = [
    "PREFIX",
    "PeerShape",
    "Shape",
    "TestnetNode",
    "TestnetPlan",
    "bridge_name",
    "check_run_id",
    "describe",
    "namespace_name",
    "node_address",
    "plan_testnet",
]
