"""A heterogeneous cluster: node groups of one accelerator kind each, the links between groups, and
the map from global rank to (node, local rank, accelerator).

The YAML schema and its units are described in :mod:`megatron_het.cluster.cluster_yaml`; the
parts (:class:`NodeGroup`, :class:`GroupLink`, :class:`Link`, :class:`RankInfo`,
:class:`NodeInfo`) live in :mod:`megatron_het.cluster.nodes`. A pair of groups with no link
gets a default one: the slower of the two NICs and the larger of their latencies, since traffic
between the groups crosses both NICs. ``describe()`` marks it "(default)".

Rank order is node-major: the nodes of the first group in ``rank_order`` come first, then the next
group's; on each node, local ranks count that node's devices (a colocated group's devices follow
its host's). Global rank = (devices on all earlier nodes) + local rank. With the same devices on
every node that is torchrun's ``node_rank * nproc_per_node + local_rank``; with different counts
it is what torchrun's agent assigns when each node is launched with its own ``--nproc_per_node``
and ``--node_rank`` (ranks are the cumulative sum of the nodes' local world sizes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron_het.cluster.accelerators import AcceleratorRegistry, AcceleratorSpec
from megatron_het.cluster.cluster_yaml import parse_cluster

# The parts are re-exported: callers import them from here or from megatron_het.cluster.
from megatron_het.cluster.nodes import (  # noqa: F401
    DEFAULT_NIC_LATENCY_US,
    INTRA_NODE_LATENCY_US,
    LINK_KINDS,
    GroupLink,
    Link,
    NodeGroup,
    NodeInfo,
    RankInfo,
)
from megatron_het.errors import UserError
from megatron_het.fileio import read_yaml_mapping


class ClusterSpec:
    """A validated cluster. Build it with :meth:`load` or :meth:`from_dict`; it is immutable."""

    def __init__(
        self,
        node_groups: Sequence[NodeGroup],
        links: Sequence[GroupLink] = (),
        rank_order: Sequence[str] | None = None,
        name: str = "cluster",
    ) -> None:
        self.name = name
        self.node_groups: tuple[NodeGroup, ...] = tuple(node_groups)
        if not self.node_groups:
            raise UserError("cluster: node_groups must list at least one node group")
        self._groups: dict[str, NodeGroup] = {}
        for group in self.node_groups:
            if group.name in self._groups:
                raise UserError(
                    f"node group name {group.name!r} is used twice; give each node "
                    f"group a unique name"
                )
            self._groups[group.name] = group
        self.rank_order: tuple[str, ...] = self._check_rank_order(rank_order)
        self._links = self._resolve_links(links)
        self._nodes, self._ranks = self._build_rank_map()

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | Path,
        accelerators_file: str | Path | None = None,
        registry: AcceleratorRegistry | None = None,
    ) -> ClusterSpec:
        """Read and validate a cluster YAML file; ``accelerators_file`` adds or overrides kinds."""
        path = Path(path)
        data = read_yaml_mapping(path, "cluster file")
        registry = registry or AcceleratorRegistry.builtin()
        if accelerators_file is not None:
            registry = registry.load_overrides(accelerators_file)
        data.setdefault("name", path.stem)
        return cls.from_dict(data, registry=registry, base_dir=path.parent)

    @classmethod
    def from_dict(
        cls,
        d: Mapping[str, Any],
        registry: AcceleratorRegistry | None = None,
        base_dir: str | Path | None = None,
    ) -> ClusterSpec:
        """Build from the plain-data form of the YAML schema
        (:mod:`megatron_het.cluster.cluster_yaml`); any mistake is a one-line UserError."""
        groups, links, rank_order, name = parse_cluster(
            d, registry or AcceleratorRegistry.builtin(), base_dir
        )
        return cls(groups, links, rank_order, name=name)

    def _check_rank_order(self, rank_order: Sequence[str] | None) -> tuple[str, ...]:
        names = [g.name for g in self.node_groups]
        if rank_order is None:
            return tuple(names)
        if sorted(map(str, rank_order)) != sorted(names):
            raise UserError(
                f"rank_order {list(rank_order)} must list every node group exactly "
                f"once: {', '.join(names)}"
            )
        return tuple(rank_order)

    def _resolve_links(self, links: Sequence[GroupLink]) -> dict[frozenset, GroupLink]:
        resolved: dict[frozenset, GroupLink] = {}
        names = ", ".join(self._groups)
        for link in links:
            a, b = link.groups
            for g in (a, b):
                if g not in self._groups:
                    raise UserError(
                        f"link {a} <-> {b}: unknown node group {g!r}; node groups: {names}"
                    )
            if frozenset((a, b)) in resolved:
                raise UserError(f"link {a} <-> {b} is given twice; keep one")
            emulated_kinds = (
                self._groups[a].accelerator.emulated and self._groups[b].accelerator.emulated
            )
            if link.emulated and not emulated_kinds:
                raise UserError(
                    f"link {a} <-> {b}: emulated: true needs both node groups to use "
                    f"emulated accelerators"
                )
            resolved[frozenset((a, b))] = link
        for i, left in enumerate(self.node_groups):
            for right in self.node_groups[i + 1 :]:
                resolved.setdefault(
                    frozenset((left.name, right.name)),
                    GroupLink(
                        (left.name, right.name),
                        min(left.nic_bandwidth_gbps, right.nic_bandwidth_gbps),
                        max(left.nic_latency_us, right.nic_latency_us),
                        explicit=False,
                    ),
                )
        return resolved

    def _build_rank_map(self) -> tuple[list[NodeInfo], list[RankInfo]]:
        guests: dict[str, list[NodeGroup]] = {}
        for name in self.rank_order:
            group = self._groups[name]
            if group.colocate_with is not None:
                guests.setdefault(self._check_host(group).name, []).append(group)
        nodes: list[NodeInfo] = []
        ranks: list[RankInfo] = []
        for name in self.rank_order:
            host = self._groups[name]
            if host.colocate_with is not None:
                continue
            members = [host] + guests.get(name, [])
            for _ in range(host.nodes):
                node = len(nodes)
                local = 0
                for group in members:
                    for _ in range(group.devices_per_node):
                        ranks.append(
                            RankInfo(len(ranks), group.name, node, local, group.accelerator)
                        )
                        local += 1
                nodes.append(
                    NodeInfo(node, tuple(g.name for g in members), local, len(ranks) - local)
                )
        return nodes, ranks

    def _check_host(self, group: NodeGroup) -> NodeGroup:
        where = f"node group {group.name!r}"
        host = self._groups.get(str(group.colocate_with))
        if host is None or host is group:
            others = ", ".join(n for n in self._groups if n != group.name)
            raise UserError(
                f"{where}: colocate_with names unknown node group "
                f"{group.colocate_with!r}; other node groups: {others}"
            )
        if host.colocate_with is not None:
            raise UserError(
                f"{where}: colocate_with {host.name!r}, which is itself colocated; "
                f"name the group that owns the nodes"
            )
        if host.nodes != group.nodes:
            raise UserError(
                f"{where}: colocate_with {host.name!r} needs nodes: {host.nodes} "
                f"(the same nodes), got {group.nodes}"
            )
        return host

    # ---- queries --------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def group(self, name: str) -> NodeGroup:
        try:
            return self._groups[name]
        except KeyError:
            raise UserError(
                f"unknown node group {name!r}; node groups: {', '.join(self._groups)}"
            ) from None

    def rank_map(self) -> list[RankInfo]:
        """One RankInfo per global rank, in rank order."""
        return list(self._ranks)

    def rank_info(self, rank: int) -> RankInfo:
        if not 0 <= rank < self.world_size:
            raise UserError(f"rank {rank} is outside the cluster's {self.world_size} ranks")
        return self._ranks[rank]

    def nodes(self) -> list[NodeInfo]:
        """The physical nodes in node_rank order."""
        return list(self._nodes)

    @property
    def uniform_nproc_per_node(self) -> int | None:
        """The devices per node if every node has the same count (torchrun's single
        ``--nproc_per_node``), else None: launch each node with its own count."""
        counts = {n.nproc for n in self._nodes}
        return counts.pop() if len(counts) == 1 else None

    def accelerator_of(self, rank: int) -> AcceleratorSpec:
        return self.rank_info(rank).accelerator

    def ranks_of_accelerator(self, name: str) -> list[int]:
        """Ranks whose kind is ``name`` (any case); empty if the cluster has none of it."""
        return [r.rank for r in self._ranks if r.accelerator.name.lower() == str(name).lower()]

    def accelerator_counts(self) -> dict[str, int]:
        """Devices per kind name, in order of first rank."""
        counts: dict[str, int] = {}
        for r in self._ranks:
            counts[r.accelerator.name] = counts.get(r.accelerator.name, 0) + 1
        return counts

    def group_link(self, group_a: str, group_b: str) -> GroupLink:
        """The (explicit or default) link between two different node groups."""
        self.group(group_a), self.group(group_b)
        if group_a == group_b:
            raise ValueError(f"group_link needs two different node groups, got {group_a!r} twice")
        return self._links[frozenset((group_a, group_b))]

    def link_between(self, rank_a: int, rank_b: int) -> Link:
        """The path between two ranks: NVLink-class inside a node of one group ("intra_node"),
        the group's NIC between its nodes ("inter_node"), or the group link ("bridge")."""
        a, b = self.rank_info(rank_a), self.rank_info(rank_b)
        if rank_a == rank_b:
            raise ValueError(f"link_between needs two different ranks, got {rank_a} twice")
        if a.group != b.group:
            link = self._links[frozenset((a.group, b.group))]
            return Link(link.bandwidth_gbps, link.latency_us / 1e6, "bridge", link.emulated)
        group = self._groups[a.group]
        if a.node == b.node:
            return Link(group.intra_bandwidth_gbps, INTRA_NODE_LATENCY_US / 1e6, "intra_node")
        return Link(group.nic_bandwidth_gbps, group.nic_latency_us / 1e6, "inter_node")

    # ---- output ---------------------------------------------------------------------------
    def describe(self) -> str:
        """A table of node groups and links; emulated kinds are marked "(emulated)"."""
        header = (
            "group",
            "accelerator",
            "nodes",
            "dev/node",
            "ranks",
            "NIC GB/s",
            "intra GB/s",
            "bf16 TFLOP/s",
            "mem GiB",
        )
        rows = [header]
        for g in self.node_groups:
            ranks = [r.rank for r in self._ranks if r.group == g.name]
            rows.append(
                (
                    g.name,
                    g.accelerator.label,
                    str(g.nodes),
                    str(g.devices_per_node),
                    format_ranks(ranks),
                    f"{g.nic_bandwidth_gbps:g}",
                    f"{g.intra_bandwidth_gbps:g}",
                    f"{g.accelerator.peak_tflops_bf16:g}",
                    f"{g.accelerator.memory_gib:g}",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        emulation = any(g.accelerator.emulated for g in self.node_groups)
        lines = [
            f"cluster {self.name}{' (emulation)' if emulation else ''}: "
            f"{_count(self.world_size, 'rank')} on {_count(self.num_nodes, 'node')}, "
            f"{_count(len(self.node_groups), 'node group')}"
        ]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        for link in self._links.values():
            tags = [
                t for t, on in (("emulated", link.emulated), ("default", not link.explicit)) if on
            ]
            tag = f" ({', '.join(tags)})" if tags else ""
            lines.append(
                f"link {link.groups[0]} <-> {link.groups[1]}: {link.bandwidth_gbps:g} "
                f"GB/s, {link.latency_us:g} us{tag}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The YAML schema as a plain dict; ``from_dict(to_dict())`` rebuilds an equal cluster.

        Kinds that differ from the built-ins are written out in full under ``accelerators``.
        """
        builtin = AcceleratorRegistry.builtin()
        kinds: dict[str, Any] = {}
        for g in self.node_groups:
            spec = g.accelerator
            if spec.name not in builtin or builtin.get(spec.name) != spec:
                kinds[spec.name] = {k: v for k, v in spec.to_dict().items() if k != "name"}
        groups = []
        for g in self.node_groups:
            entry: dict[str, Any] = {
                "name": g.name,
                "accelerator": g.accelerator.name,
                "nodes": g.nodes,
                "devices_per_node": g.devices_per_node,
                "nic_bandwidth_gbps": g.nic_bandwidth_gbps,
                "nic_latency_us": g.nic_latency_us,
            }
            if g.intra_node_bandwidth_gbps is not None:
                entry["intra_node_bandwidth_gbps"] = g.intra_node_bandwidth_gbps
            if g.colocate_with is not None:
                entry["colocate_with"] = g.colocate_with
            groups.append(entry)
        links = [
            {
                "groups": list(link.groups),
                "bandwidth_gbps": link.bandwidth_gbps,
                "latency_us": link.latency_us,
                "emulated": link.emulated,
            }
            for link in self._links.values()
            if link.explicit
        ]
        out: dict[str, Any] = {"name": self.name}
        if kinds:
            out["accelerators"] = kinds
        out.update(node_groups=groups, links=links, rank_order=list(self.rank_order))
        return out

    def __repr__(self) -> str:
        return (
            f"ClusterSpec({self.name!r}, world_size={self.world_size}, "
            f"groups={[g.name for g in self.node_groups]})"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_ranks(values: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive values
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


def kind_subcluster(cluster: ClusterSpec, kind: str) -> ClusterSpec:
    """The node groups of ``cluster`` whose accelerator is ``kind``, with the links among them.

    A group colocated with a host of another kind gets its own nodes of the same count.
    """
    groups = [g for g in cluster.node_groups if g.accelerator.name == kind]
    names = {g.name for g in groups}
    if not groups:
        raise UserError(f"cluster {cluster.name} has no {kind} devices")
    groups = [
        g if g.colocate_with is None or g.colocate_with in names else replace(g, colocate_with=None)
        for g in groups
    ]
    links = [
        cluster.group_link(a.name, b.name) for i, a in enumerate(groups) for b in groups[i + 1 :]
    ]
    order = [name for name in cluster.rank_order if name in names]
    return ClusterSpec(groups, links, order, name=f"{cluster.name}[{kind}]")
