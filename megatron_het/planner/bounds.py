"""Cheap lower bounds on a layout's time and memory, to skip layouts before probing them.

Per (kind, tp, micro-batch size, recompute, sequence parallelism), one stage of ``tp`` devices
of that kind is predicted alone with 1 and 2 layers (:class:`KindCosts`): the differences are
the per-layer compute + TP communication time and the per-layer memory terms. Since the
embedding, the head, p2p, DP sync and the optimizer only add time, and the transient and
end-stage memory only add bytes, a layout's closed-form iteration time is at least
:func:`time_lower_bound` and its split needs at least :func:`memory_feasible`'s per-layer bytes
on every stage. The search probes layouts in order of the time bound and stops where the bound
passes the best times found.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.perf import Profile, SimulationCache, predict
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.perf.cost.memory import (
    RESERVED_FRACTION,
    device_capacity_bytes,
    in_flight_micro_batches,
    layer_parameters,
)
from megatron_het.perf.cost.roofline import DTYPE_BYTES, FP32_BYTES
from megatron_het.pipeline.schedules import interleaved_warmup
from megatron_het.planner.space import KindBlock, Layout, Placement


@dataclass(frozen=True)
class LayerCost:
    """Per decoder layer on one device of a stage: compute + TP communication seconds per
    micro-batch (forward + backward), and bytes: ``static`` (weights and gradients),
    ``optimizer`` (unsharded Adam state) and ``activation`` (per micro-batch in flight)."""

    seconds: float
    static_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    usable_bytes: float

    def bytes_per_layer(self, zero1_dp: int, in_flight: float) -> float:
        return (
            self.static_bytes + self.optimizer_bytes / zero1_dp + self.activation_bytes * in_flight
        )


class KindCosts:
    """:class:`LayerCost` per (kind, tp, micro-batch size, recompute), predicted on demand
    (``fused_elementwise``: as :func:`~megatron_het.perf.predict` prices the layers)."""

    def __init__(
        self,
        model: ModelConfig,
        cluster: ClusterSpec,
        placement: Placement,
        seq_length: int,
        profiles: Mapping[str, Profile] | None,
        dtype: str,
        cache: SimulationCache,
        fused_elementwise: bool = True,
    ) -> None:
        self.model, self.cluster, self.placement = model, cluster, placement
        self.seq, self.profiles, self.dtype, self.cache = seq_length, profiles, dtype, cache
        self.fused_elementwise = fused_elementwise
        self._costs: dict[tuple[str, int, int, bool, bool], LayerCost] = {}
        self._syncs: dict[tuple[str, int, int, bool], float] = {}

    def sync_per_layer(self, block: KindBlock, dp: int, zero1: bool, comm: CommCost) -> float:
        """The least DP sync seconds one more decoder layer adds to a stage of ``block`` with
        ``dp`` replicas (its gradients' ring all-reduce, or under ZeRO-1 reduce-scatter and
        parameter all-gather, as :class:`~megatron_het.perf.cost.dp_sync.DPSync` prices them):
        over a few rank offsets within the kind's pipeline share, the cheapest ring's."""
        key = (block.kind, block.tp, dp, zero1)
        if key not in self._syncs:
            self._syncs[key] = self._sync_slope(block, dp, zero1, comm) if dp > 1 else 0.0
        return self._syncs[key]

    def _sync_slope(self, block: KindBlock, dp: int, zero1: bool, comm: CommCost) -> float:
        ranks = self.placement.ranks_of[block.kind]
        share = len(ranks) // dp
        params = layer_parameters(self.model, block.tp)
        element = DTYPE_BYTES[self.dtype]
        slopes = []
        for offset in sorted({0, block.tp * ((share // block.tp) // 2), share - block.tp}):
            group = [ranks[d * share + offset] for d in range(dp)]
            one, two = (
                comm.dp_sync(
                    group, n * params * FP32_BYTES, n * params * element if zero1 else None
                ).time_s
                for n in (1, 2)
            )
            slopes.append(two - one)
        return max(0.0, min(slopes))

    def get(
        self, block: KindBlock, micro_batch_size: int, sequence_parallel: bool = False
    ) -> LayerCost:
        sp = sequence_parallel and block.tp > 1
        key = (block.kind, block.tp, micro_batch_size, block.recompute, sp)
        if key not in self._costs:
            self._costs[key] = self._probe(block, micro_batch_size, sp)
        return self._costs[key]

    def _probe(self, block: KindBlock, micro_batch_size: int, sequence_parallel: bool) -> LayerCost:
        ranks = tuple(self.placement.ranks_of[block.kind][: block.tp])
        rows = []
        for layers in (1, 2):
            stage = StagePlan(block.kind, block.tp, (0, layers), ranks, recompute=block.recompute)
            plan = ParallelPlan(
                micro_batch_size,
                (PipelinePlan(1, (stage,)),),
                self.dtype,
                use_distributed_optimizer=False,
                sequence_parallel=sequence_parallel or None,
                tp_comm_overlap=sequence_parallel or None,
            )
            rows.append(
                predict(
                    self.model,
                    plan,
                    self.cluster,
                    self.seq,
                    self.profiles,
                    options=RunOptions.from_plan(
                        plan, dtype=self.dtype, fused_elementwise=self.fused_elementwise
                    ),
                    pipeline_model="closed_form",
                    cache=self.cache,
                    validate=False,
                ).stages[0]
            )
        one, two = rows
        spec = self.cluster.accelerator_of(ranks[0])
        return LayerCost(
            seconds=(two.forward_s + two.backward_s) - (one.forward_s + one.backward_s),
            static_bytes=(
                two.memory.weights_bytes
                + two.memory.grads_bytes
                - one.memory.weights_bytes
                - one.memory.grads_bytes
            ),
            optimizer_bytes=two.memory.optimizer_bytes - one.memory.optimizer_bytes,
            activation_bytes=two.memory.activation_bytes - one.memory.activation_bytes,
            usable_bytes=device_capacity_bytes(spec) * (1.0 - RESERVED_FRACTION),
        )


def sync_lower_bound(layout: Layout, costs: KindCosts, num_layers: int, comm: CommCost) -> float:
    """No split of ``layout`` syncs its gradients faster than this: with ``c_s`` the sync
    seconds per layer of stage s, ``max_s c_s l_s >= L / sum_s (1 / c_s)`` (the intercepts, the
    embedding's and head's parameters only add)."""
    slopes = [costs.sync_per_layer(b, layout.dp, layout.zero1, comm) for b in layout.stage_kinds()]
    if min(slopes) <= 0:
        return 0.0
    return num_layers / sum(1.0 / c for c in slopes)


def time_lower_bound(
    layout: Layout, costs: KindCosts, num_layers: int, tight: bool = True
) -> float:
    """No split of ``layout`` has a closed-form iteration time below this.

    With per-layer stage work ``w_s`` and no fixed costs, the 1F1B time of a split ``l`` is
    at least ``sum_s w_s l_s + (m - 1) max_s w_s l_s`` (the fill and drain, then the
    bottleneck's cycles): ``tight`` gives that least over every real split with ``l_s >= 1``
    (:func:`fill_and_cycles_bound`), else the looser ``L min_s w_s + (m - 1) L / sum_s
    (1 / w_s)``, which is affine in ``m`` (a line through two micro-batch counts bounds every
    other). Interleaved, the busiest device group computes ``m max_g w_g l_g`` and the others
    fill and drain at the pace of one of their chunks, ``(sum_g w_g l_g - max_g w_g l_g) /
    v``; ``tight``, the busiest group's work is also at least what the groups' memory allows
    (:func:`capped_bottleneck`: interleaving's warm-up holds many chunks, so memory often
    decides the split there).
    """
    work = [
        costs.get(b, layout.micro_batch_size, layout.sequence_parallel).seconds
        for b in layout.stage_kinds()
    ]
    if min(work) <= 0:
        return 0.0
    bottleneck = num_layers / sum(1.0 / w for w in work)
    if layout.num_chunks > 1:  # plus the fill: the other groups' work at a chunk's pace
        if tight:
            bottleneck = max(
                bottleneck, capped_bottleneck(work, layer_room(layout, costs), num_layers)
            )
        return (
            layout.micro_batches * bottleneck
            + max(0.0, num_layers * min(work) - bottleneck) / layout.num_chunks
        )
    if tight and num_layers >= len(work):
        return fill_and_cycles_bound(work, num_layers, layout.micro_batches)
    return num_layers * min(work) + (layout.micro_batches - 1) * bottleneck


def capped_bottleneck(work: Sequence[float], room: Sequence[float], num_layers: int) -> float:
    """The least ``B`` with ``sum_s min(room_s, B / w_s) >= L``: no split that keeps every stage
    within its layer room (by the per-layer bytes alone, :func:`layer_room`) has a busiest
    stage below it (inf when the rooms cannot hold the layers)."""
    if sum(room) < num_layers:
        return float("inf")
    lo, hi = 0.0, max(w * r for w, r in zip(work, room) if r > 0)
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(min(r, mid / w) for w, r in zip(work, room)) >= num_layers:
            hi = mid
        else:
            lo = mid
    return lo


def fill_and_cycles_bound(work: Sequence[float], num_layers: int, micro_batches: int) -> float:
    """``min over real l (l_s >= 1, sum l_s = L) of sum_s w_s l_s + (m - 1) max_s w_s l_s``.

    For a bottleneck ``B = max_s w_s l_s`` the least fill puts one layer on every stage and the
    other ``L - p`` on the stages cheapest per layer first, each up to ``B / w_s``; that fill
    is convex and falls with ``B`` while ``(m - 1) B`` rises, so the least sum over ``B`` is
    found by ternary search, from ``B`` where the layers just fit to where one stage could
    hold them all."""
    order = sorted(work)
    p, extra = len(order), num_layers - len(order)
    base = sum(order)

    def total(bottleneck: float) -> float:
        fill, left = base, float(extra)
        for w in order:
            if left <= 0:
                break
            take = min(left, bottleneck / w - 1.0)
            fill += w * take
            left -= take
        return fill + (micro_batches - 1) * bottleneck

    lo = max(order[-1], num_layers / sum(1.0 / w for w in order))
    hi = max(lo, order[0] * (num_layers - p + 1))
    for _ in range(60):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if total(a) <= total(b):
            hi = b
        else:
            lo = a
    loose = num_layers * order[0] + (micro_batches - 1) * num_layers / sum(1.0 / w for w in order)
    # under the search's residue (far under the model's error), never under the loose bound
    return max(loose, total(lo) * (1 - 1e-6))


def layer_room(layout: Layout, costs: KindCosts) -> list[float]:
    """Per stage: how many layers its usable memory holds by the per-layer bytes alone."""
    zero1_dp = layout.dp if layout.zero1 else 1
    p, m, v = layout.num_stages, layout.micro_batches, layout.num_chunks
    room: list[float] = []
    for block in layout.blocks:
        cost = costs.get(block, layout.micro_batch_size, layout.sequence_parallel)
        for _ in range(block.stages):
            per_layer = cost.bytes_per_layer(zero1_dp, _layers_in_flight(p, m, v, len(room)))
            room.append(cost.usable_bytes / per_layer if per_layer > 0 else float("inf"))
    return room


@functools.lru_cache(maxsize=65536)
def _layers_in_flight(p: int, m: int, v: int, stage: int) -> float:
    """How many copies of one layer's activations stage (device group) ``stage`` of ``p``
    holds at its peak: ``min(p - s, m)`` in 1F1B; interleaved over ``v`` chunks, ``min(w + 1,
    m v)`` chunks of ``1 / v`` of its layers each (``w``: its warm-up forwards; uniform
    chunks)."""
    if v == 1:
        return in_flight_micro_batches(p, stage, m)
    return min(interleaved_warmup(p, v, m, stage) + 1, m * v) / v


def memory_feasible(layout: Layout, costs: KindCosts, num_layers: int) -> bool:
    """False when even the per-layer bytes alone cannot hold the layers on the stages."""
    caps = [int(r) for r in layer_room(layout, costs)]
    return min(caps) >= layout.num_chunks and sum(caps) >= num_layers


def memory_pressure(layout: Layout, costs: KindCosts, num_layers: int) -> float:
    """Layers to hold over the layers the stages' memory holds (above 1: cannot fit); orders
    layouts that do not fit by how far they are from fitting."""
    room = layer_room(layout, costs)
    return max(num_layers / sum(room), max(1.0 / r for r in room))


__all__ = [
    "KindCosts",
    "LayerCost",
    "fill_and_cycles_bound",
    "layer_room",
    "memory_feasible",
    "memory_pressure",
    "sync_lower_bound",
    "time_lower_bound",
    "capped_bottleneck",
]
