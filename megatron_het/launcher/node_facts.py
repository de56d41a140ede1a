"""What the per-node launch needs to know about one node of a cluster file.

Node ranks follow the cluster file: the nodes of its first node group come first, and a node's
ranks are consecutive (torchrun's ``--node_rank`` and ``--nproc_per_node``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_het.cluster import ClusterSpec, RankInfo
from megatron_het.errors import UserError


@dataclass(frozen=True)
class NodeFacts:
    """One node of a cluster.

    ``nnodes`` and ``world_size`` are the cluster's (torchrun ``--nnodes``); ``nproc`` the
    node's ranks (``--nproc_per_node``), the first of them global rank ``first_rank``.
    ``vendors`` and ``accelerators`` list the node's ranks' vendors (nvidia, amd, huawei, cpu,
    other) and kinds without repeats, in rank order. ``gpus`` counts the ranks that drive a
    CUDA/ROCm GPU (what Slurm must give the node), ``npus`` those that drive an Ascend NPU;
    emulated kinds run on the CPU and count in neither.
    """

    nnodes: int
    world_size: int
    nproc: int
    first_rank: int
    groups: tuple[str, ...]
    vendors: tuple[str, ...]
    accelerators: tuple[str, ...]
    gpus: int
    npus: int

    @property
    def last_rank(self) -> int:
        return self.first_rank + self.nproc - 1


def node_facts(cluster: ClusterSpec, node_rank: int) -> NodeFacts:
    """:class:`NodeFacts` of node ``node_rank`` of ``cluster``; UserError outside it."""
    nodes = cluster.nodes()
    if not 0 <= node_rank < len(nodes):
        raise UserError(
            f"NODE_RANK {node_rank} is outside cluster {cluster.name}'s "
            f"{len(nodes)} nodes; use 0..{len(nodes) - 1}"
        )
    node = nodes[node_rank]
    infos = [cluster.rank_info(r) for r in range(node.first_rank, node.first_rank + node.nproc)]
    return NodeFacts(
        nnodes=len(nodes),
        world_size=cluster.world_size,
        nproc=node.nproc,
        first_rank=node.first_rank,
        groups=tuple(node.groups),
        vendors=tuple(dict.fromkeys(info.accelerator.vendor for info in infos)),
        accelerators=tuple(dict.fromkeys(info.accelerator.name for info in infos)),
        gpus=_driving(infos, "cuda"),
        npus=_driving(infos, "npu"),
    )


def kind_runs(cluster: ClusterSpec) -> tuple[int, ...]:
    """How many consecutive nodes share each run of accelerator kinds, in node order ((4, 8):
    4 nodes of one kind, then 8 of another). A Slurm heterogeneous job's components must not
    split a run."""
    runs: list[int] = []
    last = None
    for node in cluster.nodes():
        ranks = range(node.first_rank, node.first_rank + node.nproc)
        kinds = tuple(sorted({cluster.rank_info(r).accelerator.name for r in ranks}))
        if kinds == last:
            runs[-1] += 1
        else:
            runs.append(1)
            last = kinds
    return tuple(runs)


def _driving(infos: Sequence[RankInfo], device_type: str) -> int:
    """How many of ``infos``' ranks drive a device of ``device_type`` (emulated kinds run on
    the CPU)."""
    return sum(
        1
        for info in infos
        if info.accelerator.device_type == device_type and not info.accelerator.emulated
    )
