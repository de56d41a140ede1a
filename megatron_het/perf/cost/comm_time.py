"""Communication time over the cluster's real links: p2p, TP collectives and DP gradient sync.

Alpha-beta model: a transfer of ``n`` bytes over a path costs ``latency + n / bandwidth``. A ring
collective over ``k`` ranks runs at the pace of its slowest neighbour path: all-reduce costs
``2 (k-1)/k n / bw + 2 (k-1) latency``, reduce-scatter and all-gather half of that.

Link figures come from :meth:`ClusterSpec.link_between` times :data:`LINK_EFFICIENCY`, or from a
profile's measured communicator figures for that op and link kind (the slower of the two kinds'
measurements when both sides have one). A CPU-emulated kind without a profile of its own talks
through the host's gloo, so the host profile (``cpu``) gives its figures; an emulated link
(:class:`~megatron_het.emulation.EmulatedLink`) takes the longer of the host's transfer and the
link's own figures. NIC sharing: an inter-node or bridge link's bandwidth is
per node, and the gradient sync of every stage and TP rank runs at the same time after the last
backward (no overlap with compute is modelled), so a ring that crosses a node shares its NIC with
the other groups crossing it (``nproc / members of this group on the node``), and a step where
every member crosses (the hierarchical exchange between kinds) shares it ``nproc`` ways.

Mixed-kind DP groups follow :mod:`megatron_het.comm.hierarchical`: reduce-scatter inside each
kind, all-reduce of each shard across kinds on parallel channels over the bridge, all-gather
inside each kind. Its reduce-scatter (ZeRO-1 gradients) is that whole all-reduce; its all-gather
is a gather across kinds then a native gather with equal kind sizes, else one flat ring.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_het.cluster import AcceleratorSpec, ClusterSpec
from megatron_het.perf.cost.compute_time import choose_profile
from megatron_het.perf.measure.profile_format import Profile

# NCCL/RCCL bus bandwidth for large messages is about 80% of the nominal link figure.
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class PathFigures:
    """Effective bandwidth (bytes/s, per stream after sharing) and latency (s) of a path."""

    bandwidth: float
    latency_s: float
    kind: str


@dataclass(frozen=True)
class SyncCost:
    """Time of one DP gradient (and ZeRO-1 parameter) sync; ``algorithm`` names the path."""

    time_s: float
    algorithm: str


def p2p_time(nbytes: float, path: PathFigures) -> float:
    return path.latency_s + nbytes / path.bandwidth


def all_reduce_time(nbytes: float, k: int, path: PathFigures) -> float:
    if k <= 1:
        return 0.0
    return 2.0 * (k - 1) / k * nbytes / path.bandwidth + 2 * (k - 1) * path.latency_s


def gather_time(nbytes: float, k: int, path: PathFigures) -> float:
    """Ring reduce-scatter or all-gather of a ``nbytes`` buffer over ``k`` ranks."""
    if k <= 1:
        return 0.0
    return (k - 1) / k * nbytes / path.bandwidth + (k - 1) * path.latency_s


def broadcast_time(nbytes: float, k: int, path: PathFigures) -> float:
    """Pipelined ring broadcast: the data once over the slowest hop plus a latency per hop."""
    return 0.0 if k <= 1 else nbytes / path.bandwidth + (k - 1) * path.latency_s


class CommCost:
    """Path figures between ranks of one cluster; one object per prediction (it caches links)."""

    def __init__(
        self,
        cluster: ClusterSpec,
        profiles: Mapping[str, Profile] | None = None,
        link_efficiency: float = LINK_EFFICIENCY,
        paced_links: bool = True,
    ) -> None:
        """``paced_links=False`` costs a link the cluster marks emulated at what the host's own
        transfer takes (its measured figures), without the link's pace: the CPU work of a
        transfer whose rest is a wait."""
        self.cluster = cluster
        self.profiles = dict(profiles or {})
        self.link_efficiency = link_efficiency
        self.paced_links = paced_links
        ranks = cluster.rank_map()
        self._node_of = [r.node for r in ranks]
        self._spec_of = [r.accelerator for r in ranks]
        self._kind_of = [r.accelerator.name for r in ranks]
        self._group_of = [r.group for r in ranks]
        self._nproc = [n.nproc for n in cluster.nodes()]
        self._links: dict[tuple[str, str, bool, str], tuple[float, float, str]] = {}
        self._rings: dict[tuple[tuple[int, ...], str, bool], PathFigures] = {}
        # the NIC-sharing counts of plans' stage boundaries, by their placement
        # (:class:`~megatron_het.perf.cost.boundary_time.BoundaryCost`; a planner prices many
        # plans of one placement)
        self.boundary_shares: dict[tuple, list[dict[int, int]]] = {}
        self._syncs: dict[tuple, SyncCost] = {}

    def kind_of(self, rank: int) -> str:
        return self._kind_of[rank]

    def node_of(self, rank: int) -> int:
        return self._node_of[rank]

    def spec_of(self, rank: int) -> AcceleratorSpec:
        return self._spec_of[rank]

    def group_of(self, rank: int) -> str:
        """The name of ``rank``'s node group."""
        return self._group_of[rank]

    def _profile_of(self, rank: int) -> Profile | None:
        """The profile describing ``rank``'s communicator: its kind's own, or for an emulated
        kind without one the host CPU's (an emulated rank is a host process talking gloo)."""
        return choose_profile(self._spec_of[rank], self.profiles).profile

    def _link(self, a: int, b: int, op: str) -> tuple[float, float, str]:
        # A path's figures depend on the two ranks' node groups and whether they share a node
        # (:meth:`ClusterSpec.link_between`), and so do the profiles that measure it.
        ga, gb = self._group_of[a], self._group_of[b]
        key = (min(ga, gb), max(ga, gb), self._node_of[a] == self._node_of[b], op)
        found = self._links.get(key)
        if found is None:
            link = self.cluster.link_between(a, b)
            found = self._measured(a, b, op, link.kind)
            if link.emulated:
                found = self._emulated(a, b, op, link)
            elif found is None:
                found = (
                    link.bandwidth_gbps * 1e9 * self.link_efficiency,
                    link.latency_s,
                    link.kind,
                )
            self._links[key] = found
        return found

    def _measured(self, a: int, b: int, op: str, link_kind: str) -> tuple[float, float, str] | None:
        """The profiles' figures of ``op`` over ``link_kind`` (the slower side's), if any."""
        figures = [
            p.comm_figures(op, link_kind)
            for p in (self._profile_of(a), self._profile_of(b))
            if p is not None
        ]
        measured = [m for m in figures if m is not None]
        if not measured:
            return None
        return (
            min(m.bandwidth_gbps for m in measured) * 1e9,
            max(m.latency_s for m in measured),
            link_kind,
        )

    def _emulated(self, a: int, b: int, op: str, link: Any) -> tuple[float, float, str]:
        """An emulated link: the relay moves the bytes over the host's gloo (the measured
        intra-node figures) and then waits out the rest of the link's own figures, so the
        transfer takes the longer of the two: the lower bandwidth and the higher latency. The
        wait is exact, so the link's figures take no efficiency factor."""
        host = self._measured(a, b, op, link.kind) or self._measured(a, b, op, "intra_node")
        bandwidth, latency = link.bandwidth_gbps * 1e9, link.latency_s
        if host is not None and not self.paced_links:
            return host[0], host[1], link.kind
        if host is not None:
            bandwidth, latency = min(bandwidth, host[0]), max(latency, host[1])
        return bandwidth, latency, link.kind

    def path(self, a: int, b: int, op: str = "collective", share: float = 1.0) -> PathFigures:
        """Figures of a -> b; a NIC or bridge link is divided by ``share`` concurrent streams."""
        bandwidth, latency, kind = self._link(a, b, op)
        if kind != "intra_node":
            bandwidth /= max(1.0, share)
        return PathFigures(bandwidth, latency, kind)

    def ring_path(
        self, ranks: Sequence[int], op: str = "collective", all_cross: bool = False
    ) -> PathFigures:
        """The slowest neighbour path of a ring over ``ranks`` (in order, at least 2), with
        NIC sharing; ``all_cross``: every member crosses its NIC at once. Memoized per ring
        (a planner prices the same DP rings for many layer splits)."""
        key = (tuple(ranks), op, all_cross)
        found = self._rings.get(key)
        if found is None:
            found = self._rings[key] = self._ring_path(ranks, op, all_cross)
        return found

    def _ring_path(self, ranks: Sequence[int], op: str, all_cross: bool) -> PathFigures:
        if len(ranks) < 2:
            raise ValueError(f"a ring needs at least 2 ranks, got {list(ranks)}")
        first = ranks[0]
        if all(
            self._node_of[r] == self._node_of[first] and self._group_of[r] == self._group_of[first]
            for r in ranks[1:]
        ):
            # One node of one group: every pair has the same intra-node link, nothing shared.
            return self.path(first, ranks[1], op)
        members: dict[int, int] = {}
        for r in ranks:
            node = self._node_of[r]
            members[node] = members.get(node, 0) + 1
        k = len(ranks)
        paths = []
        for i in range(k if k > 2 else 1):
            a, b = ranks[i], ranks[(i + 1) % k]
            share = max(
                self._share(self._node_of[a], members, all_cross),
                self._share(self._node_of[b], members, all_cross),
            )
            paths.append(self.path(a, b, op, share))
        slowest = min(paths, key=lambda p: p.bandwidth)
        return PathFigures(slowest.bandwidth, max(p.latency_s for p in paths), slowest.kind)

    def _share(self, node: int, members: Mapping[int, int], all_cross: bool) -> float:
        return float(self._nproc[node]) if all_cross else self._nproc[node] / members[node]

    # ---- collectives ------------------------------------------------------------------------
    def tp_all_reduce(self, ranks: Sequence[int], nbytes: float) -> float:
        """One all-reduce of ``nbytes`` over a stage's TP group (ring over its links)."""
        if len(ranks) <= 1:
            return 0.0
        return all_reduce_time(nbytes, len(ranks), self.ring_path(ranks))

    def tp_gather(self, ranks: Sequence[int], nbytes: float) -> float:
        """One all-gather or reduce-scatter of a ``nbytes`` buffer over a stage's TP group
        (sequence parallelism): half the ring all-reduce's time."""
        if len(ranks) <= 1:
            return 0.0
        return gather_time(nbytes, len(ranks), self.ring_path(ranks))

    def dp_sync(
        self, ranks: Sequence[int], grad_bytes: float, param_bytes: float | None = None
    ) -> SyncCost:
        """Gradient sync of one DP group (``ranks`` in pipeline order).

        ``grad_bytes``: this rank's gradient buffer. ``param_bytes`` given (ZeRO-1): gradients
        are reduce-scattered and the updated parameters (that many bytes) all-gathered.
        """
        key = (tuple(ranks), grad_bytes, param_bytes)
        if key not in self._syncs:
            self._syncs[key] = self._dp_sync(ranks, grad_bytes, param_bytes)
        return self._syncs[key]

    def _dp_sync(
        self, ranks: Sequence[int], grad_bytes: float, param_bytes: float | None
    ) -> SyncCost:
        n = len(ranks)
        if n <= 1:
            return SyncCost(0.0, "none (dp=1)")
        by_kind: dict[str, list[int]] = {}
        for r in ranks:
            by_kind.setdefault(self._kind_of[r], []).append(r)
        if len(by_kind) == 1:
            path = self.ring_path(ranks)
            if param_bytes is None:
                return SyncCost(all_reduce_time(grad_bytes, n, path), "ring all-reduce")
            time = gather_time(grad_bytes, n, path) + gather_time(param_bytes, n, path)
            return SyncCost(time, "ring reduce-scatter + all-gather")
        kinds = list(by_kind.values())
        reduce = self._hierarchical_all_reduce(kinds, grad_bytes)
        if param_bytes is None:
            return SyncCost(reduce, f"hierarchical all-reduce over {len(kinds)} kinds")
        return SyncCost(
            reduce + self._mixed_all_gather(ranks, kinds, param_bytes),
            f"hierarchical reduce-scatter + all-gather over {len(kinds)} kinds",
        )

    def _hierarchical_all_reduce(self, kinds: list[list[int]], nbytes: float) -> float:
        native = max(
            gather_time(nbytes, len(k), self.ring_path(k)) if len(k) > 1 else 0.0 for k in kinds
        )
        cross = 0.0
        for k in kinds:  # each rank all-reduces its shard with one rank of every other kind
            channel = [k[0]] + [other[0] for other in kinds if other is not k]
            path = self.ring_path(channel, all_cross=True)
            cross = max(cross, all_reduce_time(nbytes / len(k), len(kinds), path))
        return 2 * native + cross  # reduce-scatter, exchange, all-gather

    def _mixed_all_gather(
        self, ranks: Sequence[int], kinds: list[list[int]], nbytes: float
    ) -> float:
        sizes = {len(k) for k in kinds}
        if len(sizes) > 1:
            return gather_time(nbytes, len(ranks), self.ring_path(ranks))
        per_rank = nbytes / len(ranks)
        channel = [k[0] for k in kinds]
        cross = (len(kinds) - 1) * p2p_time(per_rank, self.ring_path(channel, all_cross=True))
        native = max(
            gather_time(nbytes, len(k), self.ring_path(k)) if len(k) > 1 else 0.0 for k in kinds
        )
        return cross + native
