"""A cluster without some of its devices: what an elastic restart runs on after a loss.

:func:`without_ranks` removes devices (by rank) from a cluster and returns a valid cluster of
the rest. Node groups describe ``nodes`` alike nodes, so a group whose nodes lost different
numbers of devices is split into one group per kind of node that is left (the nodes that lost
nothing keep the group's name; the others get ``name-<devices>of<devices_per_node>``), with
the group's links, colocation and place in the rank order (a second group of whole nodes
of the same name gets ``-b``); a node that lost every device is gone. Ranks are renumbered
in the new cluster's order (a restart reshards its checkpoint to any plan, so the numbering
is free).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from megatron_het.cluster.cluster import ClusterSpec
from megatron_het.errors import UserError


def without_ranks(cluster: ClusterSpec, lost: Iterable[int]) -> ClusterSpec:
    """``cluster`` without the devices of ranks ``lost`` (see the module docstring); UserError
    when a rank is outside it or nothing would be left."""
    return shrink(cluster, lost)[0]


def shrink(cluster: ClusterSpec, lost: Iterable[int]) -> tuple[ClusterSpec, dict[int, int]]:
    """:func:`without_ranks` and where each node went: ``{node of cluster: node of the new
    cluster}`` for every node that keeps a device (a node that lost all of them is absent).
    Nodes keep their order within each new group, and the groups follow the old order, so
    every node's supervisor works out the same map and its own new node rank."""
    lost = set(lost)
    outside = sorted(r for r in lost if not 0 <= r < cluster.world_size)
    if outside:
        raise UserError(
            f"ranks {outside} are not in cluster {cluster.name} ({cluster.world_size} ranks)"
        )
    if len(lost) == cluster.world_size:
        raise UserError(f"no device of cluster {cluster.name} would be left")
    data = cluster.to_dict()
    groups = {g["name"]: g for g in data["node_groups"]}
    # per physical node: how many devices of each member group it keeps
    kept: dict[int, Counter[str]] = {}
    for info in cluster.rank_map():
        kept.setdefault(info.node, Counter())[info.group] += info.rank not in lost
    hosts = [name for name in data["rank_order"] if "colocate_with" not in groups[name]]
    renamed: dict[str, list[str]] = {name: [] for name in groups}
    new_groups: list[dict[str, Any]] = []
    order: list[str] = []
    nodes_of_host = _nodes_by_host(cluster)
    placed: dict[int, int] = {}
    for host in hosts:
        members = [host] + [n for n in data["rank_order"] if groups[n].get("colocate_with") == host]
        signature_of = {node: tuple(kept[node][m] for m in members) for node in nodes_of_host[host]}
        signatures = Counter(signature_of[node] for node in nodes_of_host[host])
        for signature, count in signatures.items():
            if not any(signature):
                continue
            for node in nodes_of_host[host]:
                if signature_of[node] == signature:
                    placed[node] = len(placed)
            made = _variant(groups, members, signature, count)
            for original, group in made:
                while group["name"] in order:  # two kinds of node with the same share
                    group["name"] += "-b"
                renamed[original].append(group["name"])
                new_groups.append(group)
                order.append(group["name"])
    links = []
    for link in data["links"]:
        a, b = link["groups"]
        links += [{**link, "groups": [x, y]} for x in renamed[a] for y in renamed[b]]
    out = {
        **data,
        "name": f"{cluster.name}-without-{len(lost)}",
        "node_groups": new_groups,
        "links": links,
        "rank_order": order,
    }
    return ClusterSpec.from_dict(out), placed


def _nodes_by_host(cluster: ClusterSpec) -> dict[str, list[int]]:
    """The physical nodes of each group that owns nodes (not colocated), in order."""
    out: dict[str, list[int]] = {}
    for node in cluster.nodes():
        out.setdefault(node.groups[0], []).append(node.node)
    return out


def _variant(
    groups: dict[str, dict[str, Any]], members: list[str], signature: tuple[int, ...], count: int
) -> list[tuple[str, dict[str, Any]]]:
    """The groups of ``count`` nodes that keep ``signature`` devices of each member (the host
    first): the members' entries with their node and device counts, renamed where they lost
    devices; the first member left with devices owns the nodes, the rest colocate with it."""
    made: list[tuple[str, dict[str, Any]]] = []
    owner = None
    for member, devices in zip(members, signature):
        if devices == 0:
            continue
        entry = dict(groups[member])
        per_node = entry["devices_per_node"]
        entry.pop("colocate_with", None)
        if devices != per_node:
            entry["name"] = f"{member}-{devices}of{per_node}"
        entry.update(nodes=count, devices_per_node=devices)
        if owner is None:
            owner = entry["name"]
        else:
            entry["colocate_with"] = owner
        made.append((member, entry))
    return made


__all__ = ["shrink", "without_ranks"]
