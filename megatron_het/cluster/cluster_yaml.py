"""The cluster YAML file and its plain-data form, parsed into node groups and links (validated
by :class:`~megatron_het.cluster.cluster.ClusterSpec`).

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
all of it). A pair of groups with no link gets a default one (see
:mod:`megatron_het.cluster.cluster`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_het.cluster.accelerators import GBIT_PER_GBYTE, AcceleratorRegistry
from megatron_het.cluster.nodes import DEFAULT_NIC_LATENCY_US, GroupLink, NodeGroup
from megatron_het.errors import UserError

_CLUSTER_KEYS = ("name", "accelerators_file", "accelerators", "node_groups", "links", "rank_order")
_GROUP_KEYS = (
    "name",
    "accelerator",
    "nodes",
    "devices_per_node",
    "nic_bandwidth_gbps",
    "nic_bandwidth_gbit_per_s",
    "nic_latency_us",
    "intra_node_bandwidth_gbps",
    "colocate_with",
)
_LINK_KEYS = ("groups", "bandwidth_gbps", "bandwidth_gbit_per_s", "latency_us", "emulated")


def parse_cluster(
    d: Mapping[str, Any], registry: AcceleratorRegistry, base_dir: str | Path | None = None
) -> tuple[list[NodeGroup], list[GroupLink], list | None, str]:
    """``(node groups, links, rank_order or None, name)`` of the plain-data form ``d`` of the
    schema above, the kinds looked up in ``registry`` (plus ``d``'s accelerators_file, relative
    to ``base_dir``, and its accelerators); any mistake is a one-line UserError."""
    if not isinstance(d, Mapping):
        raise UserError("cluster: expected a mapping with node_groups")
    _check_keys("cluster", d, _CLUSTER_KEYS)
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
        raise UserError("cluster: links must be a list of {groups: [a, b], bandwidth_gbps: ...}")
    links = [_parse_link(i, link) for i, link in enumerate(raw_links)]
    rank_order = d.get("rank_order")
    if rank_order is not None and not isinstance(rank_order, list):
        raise UserError("cluster: rank_order must be a list of node group names")
    return groups, links, rank_order, str(d.get("name") or "cluster")


def _check_keys(where: str, d: Mapping[str, Any], known: Sequence[str]) -> None:
    unknown = [str(k) for k in d if k not in known]
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(known)}")


def _number(where: str, d: Mapping[str, Any], key: str, positive: bool = True) -> float:
    value = d[key]
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value < 0
        or (positive and value == 0)
    ):
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
        name=d["name"],
        accelerator=accelerator,
        nodes=d["nodes"],
        devices_per_node=d["devices_per_node"],
        nic_bandwidth_gbps=_bandwidth(where, d, "nic_bandwidth"),
        nic_latency_us=(
            _number(where, d, "nic_latency_us", positive=False)
            if "nic_latency_us" in d
            else DEFAULT_NIC_LATENCY_US
        ),
        intra_node_bandwidth_gbps=(
            None if intra is None else _number(where, d, "intra_node_bandwidth_gbps")
        ),
        colocate_with=None if colocate is None else str(colocate),
    )


def _parse_link(index: int, d: Any) -> GroupLink:
    groups = d.get("groups") if isinstance(d, Mapping) else None
    if (
        not isinstance(groups, list)
        or len(groups) != 2
        or groups[0] == groups[1]
        or not all(isinstance(g, str) for g in groups)
    ):
        raise UserError(
            f"link #{index}: groups must name two different node groups, got {groups!r}"
        )
    where = f"link {groups[0]} <-> {groups[1]}"
    _check_keys(where, d, _LINK_KEYS)
    emulated = d.get("emulated", False)
    if not isinstance(emulated, bool):
        raise UserError(f"{where}: emulated must be true or false, got {emulated!r}")
    latency = (
        _number(where, d, "latency_us", positive=False)
        if "latency_us" in d
        else DEFAULT_NIC_LATENCY_US
    )
    return GroupLink((groups[0], groups[1]), _bandwidth(where, d, "bandwidth"), latency, emulated)


__all__ = ["parse_cluster"]
