"""Stage-boundary transfer time per micro-batch: which ranks send what over which path.

``act`` is one micro-batch's ``[micro_batch, seq, hidden]`` activations in the compute dtype.
Boundary ``b`` of a pipeline is stage b to stage b + 1 (chunks of an interleaved pipeline count
as stages); every figure is the same forward (activations) and backward (their gradients)
except where said.

Without sequence parallelism every TP rank holds the whole activation. With equal TP degrees
each rank sends it to its peer, ``latency + act / bandwidth`` (tp concurrent streams); with
different degrees one rank sends it and the receiving stage broadcasts it within its TP group
(forward: the next stage; backward: this one).

With sequence parallelism (``plan.sequence_parallel``) a rank of a stage with tp > 1 holds
positions ``[t S/tp, (t+1) S/tp)`` (a tp = 1 stage all of them), and a boundary reshards by
positions (:func:`~megatron_het.pipeline.stage_boundary.boundary_peers`): every pair of ranks whose
blocks overlap exchanges the overlap, one message each way, no broadcast. The messages run at
once; a rank's own messages go one after another over its links, so the boundary takes
``max_r (latency + sum_{m of r} bytes_m / bandwidth_m)`` over the ranks of both stages. Equal
degrees: tp messages of ``act / tp``, ``latency + act / (tp bandwidth)``.

NIC sharing: an inter-node path's bandwidth is divided among the transfers that leave a node
at once, counted over boundary b of every pipeline that has one (replicas run the same
boundary at about the same moments; with different layouts a rough guess). Without sequence
parallelism these are streams (tp per pipeline with equal degrees, else 1, counted on the
sending stage's node); with it, the ranks of the node that have a cross-node message over that
boundary, and a message takes the larger share of its two ends.
"""

from __future__ import annotations

from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.sequence import position_overlaps, sequence_sharded
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.perf.cost.comm_time import CommCost, broadcast_time, p2p_time


def rank_activation_bytes(plan: ParallelPlan, stage: StagePlan, act_bytes: float) -> float:
    """What one rank of ``stage`` holds of a micro-batch's activations between TP blocks (and
    sends or receives over a boundary): all of ``act_bytes``, or ``1/tp`` when sharded."""
    return act_bytes / stage.tp if sequence_sharded(plan, stage) else act_bytes


def position_messages(
    plan: ParallelPlan, src: StagePlan, dst: StagePlan, seq: int
) -> list[tuple[int, int, float]]:
    """The messages of a sequence-parallel boundary from ``src`` to ``dst`` (the backward's
    are the same pairs the other way): ``(src rank, dst rank, share of the activation)``."""
    return [
        (src.ranks[i], dst.ranks[j], (hi - lo) / seq)
        for i, j, lo, hi in position_overlaps(plan, src, dst, seq)
    ]


class BoundaryCost:
    """The transfer times of every boundary of a plan, for one prediction (see the module
    docstring); ``act_bytes`` as there, ``seq`` the sequence length."""

    def __init__(self, plan: ParallelPlan, comm: CommCost, act_bytes: float, seq: int) -> None:
        self.plan, self.comm, self.act_bytes, self.seq = plan, comm, act_bytes, seq
        self._overlaps: dict[tuple[int, int, bool, bool], list] = {}
        # the counts depend on the stages' ranks and sharding only, not on their layers
        key = (
            bool(plan.sequence_parallel),
            seq,
            tuple(tuple(st.ranks for st in p.stages) for p in plan.pipelines),
        )
        if key not in comm.boundary_shares:
            comm.boundary_shares[key] = self._node_shares()
        self._shares = comm.boundary_shares[key]

    def _messages(self, src: StagePlan, dst: StagePlan) -> list[tuple[int, int, float]]:
        """:func:`position_messages`, its overlaps memoized by the two sides' TP and sharding
        (all a boundary's positions depend on)."""
        key = (src.tp, dst.tp, sequence_sharded(self.plan, src), sequence_sharded(self.plan, dst))
        if key not in self._overlaps:
            self._overlaps[key] = [
                (i, j, (hi - lo) / self.seq)
                for i, j, lo, hi in position_overlaps(self.plan, src, dst, self.seq)
            ]
        return [(src.ranks[i], dst.ranks[j], share) for i, j, share in self._overlaps[key]]

    def _by_position(self, src: StagePlan, dst: StagePlan) -> bool:
        return sequence_sharded(self.plan, src) or sequence_sharded(self.plan, dst)

    def _node_shares(self) -> list[dict[int, int]]:
        """Per boundary index: per node, the transfers leaving it at once (all pipelines)."""
        longest = max(p.num_stages for p in self.plan.pipelines)
        node = self.comm.node_of
        sharded = bool(self.plan.sequence_parallel)  # else no boundary goes by positions
        counts: list[dict[int, int]] = [{} for _ in range(longest - 1)]
        crossing: list[dict[int, set[int]]] = [{} for _ in range(longest - 1)]
        for pipeline in self.plan.pipelines:
            stages = pipeline.stages
            for b, (src, dst) in enumerate(zip(stages, stages[1:])):
                if sharded and self._by_position(src, dst):
                    for a, c, _ in self._messages(src, dst):
                        if node(a) != node(c):
                            crossing[b].setdefault(node(a), set()).add(a)
                            crossing[b].setdefault(node(c), set()).add(c)
                    continue
                here = node(src.ranks[-1])
                if here != node(dst.ranks[0]):
                    counts[b][here] = counts[b].get(here, 0) + (src.tp if src.tp == dst.tp else 1)
        for b, nodes in enumerate(crossing):
            for n, ranks in nodes.items():
                counts[b][n] = counts[b].get(n, 0) + len(ranks)
        return counts

    def time(self, pipeline: PipelinePlan, b: int) -> tuple[float, float]:
        """(forward, backward) seconds over boundary ``b`` of ``pipeline`` per micro-batch."""
        src, dst = pipeline.stages[b], pipeline.stages[b + 1]
        if self._by_position(src, dst):
            one = self._position_time(b, src, dst)
            return one, one
        share = self._shares[b].get(self.comm.node_of(src.ranks[-1]), 1)
        path = self.comm.path(src.ranks[-1], dst.ranks[0], "p2p", share)
        one = p2p_time(self.act_bytes, path)
        if src.tp == dst.tp:
            return one, one
        return one + self._broadcast(dst.ranks), one + self._broadcast(src.ranks)

    def _position_time(self, b: int, src: StagePlan, dst: StagePlan) -> float:
        """The slowest rank's messages of a boundary resharded by positions."""
        shares, node = self._shares[b], self.comm.node_of
        load: dict[int, float] = {}
        latency: dict[int, float] = {}
        for a, c, fraction in self._messages(src, dst):
            share = 1
            if node(a) != node(c):
                share = max(shares.get(node(a), 1), shares.get(node(c), 1))
            path = self.comm.path(a, c, "p2p", share)
            seconds = fraction * self.act_bytes / path.bandwidth
            for r in (a, c):
                load[r] = load.get(r, 0.0) + seconds
                latency[r] = max(latency.get(r, 0.0), path.latency_s)
        return max(latency[r] + load[r] for r in load)

    def _broadcast(self, ranks: tuple[int, ...]) -> float:
        if len(ranks) <= 1:
            return 0.0
        return broadcast_time(self.act_bytes, len(ranks), self.comm.ring_path(ranks))


__all__ = ["BoundaryCost", "position_messages", "rank_activation_bytes"]
