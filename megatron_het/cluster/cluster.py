"""A heterogeneous cluster: node groups of one accelerator kind each, the links between groups, and
the map from global rank to (node, local rank, accelerator).

Bandwidths are GB/s (gigabytes per second) unless a key says ``gbit``; see
:mod:`megatron_het.cluster.accelerators` for the units. The YAML schema::

    name: my_cluster                 # optional
    accelerators_file: kinds.yaml    # optional, relative to this file; merged onto the built-ins
    accelerators:                    # optional; new kinds or overrides of built-in ones
      H100: {memory_gib: 94}
    node_groups:
      - name: h100                   # unique
        accelerator: H100            # a known kind, any case
        nodes: 2
        devices_per_node: 8
        nic_bandwidth_gbit_per_s: 3200   # per node, all NICs together (or nic_bandwidth_gbps)
        nic_latency_us: 5            # optional (default 5)
        intra_node_bandwidth_gbps: 900   # optional override of the kind's NVLink/IF/HCCS figure
        colocate_with: other_group   # optional: share that group's nodes (CPU emulation)
    links:                           # between node groups
      - groups: [h100, mi300x]
        bandwidth_gbit_per_s: 400    # or bandwidth_gbps
        latency_us: 10               # optional (default 5)
        emulated: false              # optional; true delays bridge traffic on CPU emulation
    rank_order: [h100, mi300x]       # optional; default: file order

A link's bandwidth is what one node of each group gets between them (a pair of ranks alone sees
all of it). A pair of groups with no link gets a default one: the slower of the two NICs and the
larger of their latencies, since traffic between the groups crosses both NICs. ``describe()``
marks it "(default)".

Rank order is node-major: the nodes of the first group in ``rank_order`` come first, then the next
group's; on each node, local ranks count that node's devices (a colocated group's devices follow
its host's). Global rank = (devices on all earlier nodes) + local rank. With the same devices on
every node that is torchrun's ``node_rank * nproc_per_node + local_rank``; with different counts
it is what torchrun's agent assigns when each node is launched with its own ``--nproc_per_node``
and ``--node_rank`` (ranks are the cumulative sum of the nodes' local world sizes).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from megatron_het.cluster.accelerators import (GBIT_PER_GBYTE, AcceleratorRegistry,
                                               AcceleratorSpec, read_yaml_mapping)
from megatron_het.emulation import EmulatedLink
from megatron_het.errors import UserError

DEFAULT_NIC_LATENCY_US = 5.0
INTRA_NODE_LATENCY_US = 1.0
LINK_KINDS = ("intra_node", "inter_node", "bridge")

_CLUSTER_KEYS = ("name", "accelerators_file", "accelerators", "node_groups", "links", "rank_order")
_GROUP_KEYS = ("name", "accelerator", "nodes", "devices_per_node", "nic_bandwidth_gbps",
               "nic_bandwidth_gbit_per_s", "nic_latency_us", "intra_node_bandwidth_gbps",
               "colocate_with")
_LINK_KEYS = ("groups", "bandwidth_gbps", "bandwidth_gbit_per_s", "latency_us", "emulated")


@dataclass(frozen=True)
class NodeGroup:
    """``nodes`` nodes with ``devices_per_node`` devices of one accelerator kind each."""

    name: str
    accelerator: AcceleratorSpec
    nodes: int
    devices_per_node: int
    nic_bandwidth_gbps: float  # per node, GB/s
    nic_latency_us: float = DEFAULT_NIC_LATENCY_US
    intra_node_bandwidth_gbps: Optional[float] = None  # None: the accelerator's figure
    colocate_with: Optional[str] = None

    def __post_init__(self) -> None:
        for key in ("nodes", "devices_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"node group {self.name!r}: {key} must be a positive integer, "
                                f"got {value!r}")

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
    transfers over the same NIC or bridge share it."""

    bandwidth_gbps: float
    latency_s: float
    kind: str  # "intra_node" | "inter_node" | "bridge"
    emulated: bool = False

    def transfer_time_s(self, nbytes: int) -> float:
        """Latency plus ``nbytes`` at full bandwidth."""
        return self.latency_s + nbytes / (self.bandwidth_gbps * 1e9)

    def emulated_link(self) -> EmulatedLink:
        """An :class:`EmulatedLink` with this link's figures (for an emulated bridge)."""
        return EmulatedLink(self.bandwidth_gbps, self.latency_s)


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


class ClusterSpec:
    """A validated cluster. Build it with :meth:`load` or :meth:`from_dict`; it is immutable."""

    def __init__(self, node_groups: Sequence[NodeGroup], links: Sequence[GroupLink] = (),
                 rank_order: Optional[Sequence[str]] = None, name: str = "cluster") -> None:
        self.name = name
        self.node_groups: tuple[NodeGroup, ...] = tuple(node_groups)
        if not self.node_groups:
            raise UserError("cluster: node_groups must list at least one node group")
        self._groups: dict[str, NodeGroup] = {}
        for group in self.node_groups:
            if group.name in self._groups:
                raise UserError(f"node group name {group.name!r} is used twice; give each node "
                                f"group a unique name")
            self._groups[group.name] = group
        self.rank_order: tuple[str, ...] = self._check_rank_order(rank_order)
        self._links = self._resolve_links(links)
        self._nodes, self._ranks = self._build_rank_map()

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, accelerators_file: Optional[str | Path] = None,
             registry: Optional[AcceleratorRegistry] = None) -> "ClusterSpec":
        """Read and validate a cluster YAML file; ``accelerators_file`` adds or overrides kinds."""
        path = Path(path)
        data = read_yaml_mapping(path, "cluster file")
        registry = registry or AcceleratorRegistry.builtin()
        if accelerators_file is not None:
            registry = registry.load_overrides(accelerators_file)
        data.setdefault("name", path.stem)
        return cls.from_dict(data, registry=registry, base_dir=path.parent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], registry: Optional[AcceleratorRegistry] = None,
                  base_dir: Optional[str | Path] = None) -> "ClusterSpec":
        """Build from the YAML schema above (plain data); any mistake is a one-line UserError."""
        if not isinstance(d, Mapping):
            raise UserError("cluster: expected a mapping with node_groups")
        _check_keys("cluster", d, _CLUSTER_KEYS)
        registry = registry or AcceleratorRegistry.builtin()
        if d.get("accelerators_file") is not None:
            registry = registry.load_overrides(Path(base_dir or ".") / str(d["accelerators_file"]))
        if d.get("accelerators") is not None:
            registry = registry.with_overrides(d["accelerators"])
        raw_groups = d.get("node_groups")
        if not isinstance(raw_groups, list) or not raw_groups:
            raise UserError("cluster: node_groups must list at least one node group")
        groups = [_parse_group(i, g, registry) for i, g in enumerate(raw_groups)]
        raw_links = d.get("links") or []
        if not isinstance(raw_links, list):
            raise UserError("cluster: links must be a list of "
                            "{groups: [a, b], bandwidth_gbps: ...}")
        links = [_parse_link(i, link) for i, link in enumerate(raw_links)]
        rank_order = d.get("rank_order")
        if rank_order is not None and not isinstance(rank_order, list):
            raise UserError("cluster: rank_order must be a list of node group names")
        return cls(groups, links, rank_order, name=str(d.get("name") or "cluster"))

    def _check_rank_order(self, rank_order: Optional[Sequence[str]]) -> tuple[str, ...]:
        names = [g.name for g in self.node_groups]
        if rank_order is None:
            return tuple(names)
        if sorted(map(str, rank_order)) != sorted(names):
            raise UserError(f"rank_order {list(rank_order)} must list every node group exactly "
                            f"once: {', '.join(names)}")
        return tuple(rank_order)

    def _resolve_links(self, links: Sequence[GroupLink]) -> dict[frozenset, GroupLink]:
        resolved: dict[frozenset, GroupLink] = {}
        names = ", ".join(self._groups)
        for link in links:
            a, b = link.groups
            for g in (a, b):
                if g not in self._groups:
                    raise UserError(f"link {a} <-> {b}: unknown node group {g!r}; node groups: "
                                    f"{names}")
            if frozenset((a, b)) in resolved:
                raise UserError(f"link {a} <-> {b} is given twice; keep one")
            emulated_kinds = (self._groups[a].accelerator.emulated
                              and self._groups[b].accelerator.emulated)
            if link.emulated and not emulated_kinds:
                raise UserError(f"link {a} <-> {b}: emulated: true needs both node groups to use "
                                f"emulated accelerators")
            resolved[frozenset((a, b))] = link
        for i, a in enumerate(self.node_groups):
            for b in self.node_groups[i + 1:]:
                resolved.setdefault(frozenset((a.name, b.name)), GroupLink(
                    (a.name, b.name), min(a.nic_bandwidth_gbps, b.nic_bandwidth_gbps),
                    max(a.nic_latency_us, b.nic_latency_us), explicit=False))
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
                        ranks.append(RankInfo(len(ranks), group.name, node, local,
                                              group.accelerator))
                        local += 1
                nodes.append(NodeInfo(node, tuple(g.name for g in members), local,
                                      len(ranks) - local))
        return nodes, ranks

    def _check_host(self, group: NodeGroup) -> NodeGroup:
        where = f"node group {group.name!r}"
        host = self._groups.get(str(group.colocate_with))
        if host is None or host is group:
            others = ", ".join(n for n in self._groups if n != group.name)
            raise UserError(f"{where}: colocate_with names unknown node group "
                            f"{group.colocate_with!r}; other node groups: {others}")
        if host.colocate_with is not None:
            raise UserError(f"{where}: colocate_with {host.name!r}, which is itself colocated; "
                            f"name the group that owns the nodes")
        if host.nodes != group.nodes:
            raise UserError(f"{where}: colocate_with {host.name!r} needs nodes: {host.nodes} "
                            f"(the same nodes), got {group.nodes}")
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
            raise UserError(f"unknown node group {name!r}; node groups: "
                            f"{', '.join(self._groups)}") from None

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
    def uniform_nproc_per_node(self) -> Optional[int]:
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
        header = ("group", "accelerator", "nodes", "dev/node", "ranks", "NIC GB/s",
                  "intra GB/s", "bf16 TFLOP/s", "mem GiB")
        rows = [header]
        for g in self.node_groups:
            ranks = [r.rank for r in self._ranks if r.group == g.name]
            rows.append((g.name, g.accelerator.label, str(g.nodes), str(g.devices_per_node),
                         _ranges(ranks), f"{g.nic_bandwidth_gbps:g}",
                         f"{g.intra_bandwidth_gbps:g}", f"{g.accelerator.peak_tflops_bf16:g}",
                         f"{g.accelerator.memory_gib:g}"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        emulation = any(g.accelerator.emulated for g in self.node_groups)
        lines = [f"cluster {self.name}{' (emulation)' if emulation else ''}: "
                 f"{_count(self.world_size, 'rank')} on {_count(self.num_nodes, 'node')}, "
                 f"{_count(len(self.node_groups), 'node group')}"]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                  for row in rows]
        for link in self._links.values():
            tags = [t for t, on in (("emulated", link.emulated), ("default", not link.explicit))
                    if on]
            tag = f" ({', '.join(tags)})" if tags else ""
            lines.append(f"link {link.groups[0]} <-> {link.groups[1]}: {link.bandwidth_gbps:g} "
                         f"GB/s, {link.latency_us:g} us{tag}")
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
            entry: dict[str, Any] = {"name": g.name, "accelerator": g.accelerator.name,
                                     "nodes": g.nodes, "devices_per_node": g.devices_per_node,
                                     "nic_bandwidth_gbps": g.nic_bandwidth_gbps,
                                     "nic_latency_us": g.nic_latency_us}
            if g.intra_node_bandwidth_gbps is not None:
                entry["intra_node_bandwidth_gbps"] = g.intra_node_bandwidth_gbps
            if g.colocate_with is not None:
                entry["colocate_with"] = g.colocate_with
            groups.append(entry)
        links = [{"groups": list(link.groups), "bandwidth_gbps": link.bandwidth_gbps,
                  "latency_us": link.latency_us, "emulated": link.emulated}
                 for link in self._links.values() if link.explicit]
        out: dict[str, Any] = {"name": self.name}
        if kinds:
            out["accelerators"] = kinds
        out.update(node_groups=groups, links=links, rank_order=list(self.rank_order))
        return out

    def __repr__(self) -> str:
        return (f"ClusterSpec({self.name!r}, world_size={self.world_size}, "
                f"groups={[g.name for g in self.node_groups]})")


def _check_keys(where: str, d: Mapping[str, Any], known: Sequence[str]) -> None:
    unknown = [str(k) for k in d if k not in known]
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(known)}")


def _number(where: str, d: Mapping[str, Any], key: str, positive: bool = True) -> float:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
            positive and value == 0):
        rule = "positive" if positive else "zero or more"
        raise UserError(f"{where}: {key} must be {rule}, got {value!r}")
    return float(value)


def _bandwidth(where: str, d: Mapping[str, Any], prefix: str) -> float:
    """GB/s from ``<prefix>_gbps`` (GB/s) or ``<prefix>_gbit_per_s`` (Gb/s); exactly one given."""
    gbyte, gbit = f"{prefix}_gbps", f"{prefix}_gbit_per_s"
    if gbyte in d and gbit in d:
        raise UserError(f"{where}: give {gbyte} (GB/s) or {gbit} (Gb/s), not both")
    if gbit in d:
        return _number(where, d, gbit) / GBIT_PER_GBYTE
    if gbyte not in d:
        raise UserError(f"{where}: missing key {gbyte!r} (GB/s; or {gbit} in Gb/s)")
    return _number(where, d, gbyte)


def _parse_group(index: int, d: Any, registry: AcceleratorRegistry) -> NodeGroup:
    if not isinstance(d, Mapping) or not isinstance(d.get("name"), str) or not d["name"]:
        raise UserError(f"node group #{index}: needs a mapping with a non-empty name")
    where = f"node group {d['name']!r}"
    _check_keys(where, d, _GROUP_KEYS)
    for key in ("accelerator", "nodes", "devices_per_node"):
        if key not in d:
            raise UserError(f"{where}: missing key {key!r}")
    try:
        accelerator = registry.get(str(d["accelerator"]))
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    intra = d.get("intra_node_bandwidth_gbps")
    colocate = d.get("colocate_with")
    return NodeGroup(
        name=d["name"], accelerator=accelerator, nodes=d["nodes"],
        devices_per_node=d["devices_per_node"],
        nic_bandwidth_gbps=_bandwidth(where, d, "nic_bandwidth"),
        nic_latency_us=(_number(where, d, "nic_latency_us", positive=False)
                        if "nic_latency_us" in d else DEFAULT_NIC_LATENCY_US),
        intra_node_bandwidth_gbps=(None if intra is None
                                   else _number(where, d, "intra_node_bandwidth_gbps")),
        colocate_with=None if colocate is None else str(colocate))


def _parse_link(index: int, d: Any) -> GroupLink:
    groups = d.get("groups") if isinstance(d, Mapping) else None
    if (not isinstance(groups, list) or len(groups) != 2 or groups[0] == groups[1]
            or not all(isinstance(g, str) for g in groups)):
        raise UserError(f"link #{index}: groups must name two different node groups, "
                        f"got {groups!r}")
    where = f"link {groups[0]} <-> {groups[1]}"
    _check_keys(where, d, _LINK_KEYS)
    emulated = d.get("emulated", False)
    if not isinstance(emulated, bool):
        raise UserError(f"{where}: emulated must be true or false, got {emulated!r}")
    latency = (_number(where, d, "latency_us", positive=False) if "latency_us" in d
               else DEFAULT_NIC_LATENCY_US)
    return GroupLink((groups[0], groups[1]), _bandwidth(where, d, "bandwidth"), latency, emulated)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _ranges(values: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts: list[str] = []
    start = prev = None
    for v in list(values) + [None]:
        if start is not None and (v is None or v != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if v is not None and start is None:
            start = v
        prev = v
    return ",".join(parts)
