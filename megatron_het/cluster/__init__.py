"""The heterogeneous cluster model: accelerator kinds and the node groups that hold them."""

from __future__ import annotations

from megatron_het.cluster.accelerators import (
    BUILTIN_ACCELERATORS,
    AcceleratorRegistry,
    AcceleratorSpec,
    get_accelerator,
)
from megatron_het.cluster.cluster import (
    ClusterSpec,
    GroupLink,
    Link,
    NodeGroup,
    NodeInfo,
    RankInfo,
    kind_subcluster,
)

__all__ = [
    "BUILTIN_ACCELERATORS",
    "AcceleratorRegistry",
    "AcceleratorSpec",
    "ClusterSpec",
    "GroupLink",
    "Link",
    "NodeGroup",
    "NodeInfo",
    "RankInfo",
    "get_accelerator",
    "kind_subcluster",
]
