"""The parts of a cluster: node groups, the links between them, and where each rank runs.

Bandwidths are GB/s (gigabytes per second); see :mod:`megatron_het.cluster.accelerators` for the
units. :class:`~megatron_het.cluster.cluster.ClusterSpec` puts the parts together.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_het.cluster.accelerators import AcceleratorSpec
from megatron_het.errors import UserError

DEFAULT_NIC_LATENCY_US = 5.0
INTRA_NODE_LATENCY_US = 1.0
LINK_KINDS = ("intra_node", "inter_node", "bridge")


@dataclass(frozen=True)
class NodeGroup:
    """``nodes`` nodes with ``devices_per_node`` devices of one accelerator kind each."""

    name: str
    accelerator: AcceleratorSpec
    nodes: int
    devices_per_node: int
    nic_bandwidth_gbps: float  # per node, GB/s
    nic_latency_us: float = DEFAULT_NIC_LATENCY_US
    intra_node_bandwidth_gbps: float | None = None  # None: the accelerator's figure
    colocate_with: str | None = None

    def __post_init__(self) -> None:
        for key in ("nodes", "devices_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(
                    f"node group {self.name!r}: {key} must be a positive integer, got {value!r}"
                )

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def intra_bandwidth_gbps(self) -> float:
        """Device-to-device bandwidth inside one node of this group (GB/s)."""
        if self.intra_node_bandwidth_gbps is not None:
            return self.intra_node_bandwidth_gbps
        return self.accelerator.intra_node_bandwidth_gbps


@dataclass(frozen=True)
class GroupLink:
    """The network path between two node groups; ``explicit`` is False for a defaulted link."""

    groups: tuple[str, str]
    bandwidth_gbps: float
    latency_us: float = DEFAULT_NIC_LATENCY_US
    emulated: bool = False
    explicit: bool = True


@dataclass(frozen=True)
class Link:
    """The path between two ranks. ``bandwidth_gbps`` is GB/s for that pair alone; concurrent
    transfers over the same NIC or bridge share it. ``emulated`` only marks the link: CPU
    emulation (:mod:`megatron_het.emulation.emulated_links`) paces its traffic to these figures."""

    bandwidth_gbps: float
    latency_s: float
    kind: str  # "intra_node" | "inter_node" | "bridge"
    emulated: bool = False

    def transfer_time_s(self, nbytes: int) -> float:
        """Latency plus ``nbytes`` at full bandwidth."""
        return self.latency_s + nbytes / (self.bandwidth_gbps * 1e9)


@dataclass(frozen=True)
class RankInfo:
    """Where one global rank runs. ``node`` is the global node index (torchrun's node_rank)."""

    rank: int
    group: str
    node: int
    local_rank: int
    accelerator: AcceleratorSpec


@dataclass(frozen=True)
class NodeInfo:
    """One physical node: its index, the groups it holds, its device count and first rank."""

    node: int
    groups: tuple[str, ...]
    nproc: int
    first_rank: int


__all__ = [
    "DEFAULT_NIC_LATENCY_US",
    "INTRA_NODE_LATENCY_US",
    "LINK_KINDS",
    "GroupLink",
    "Link",
    "NodeGroup",
    "NodeInfo",
    "RankInfo",
]
