"""The planner's first phase: bound every layout, then probe them in bound order.

:class:`LayoutSearch` enumerates the layouts (:mod:`megatron_het.planner.space`) that may fit
the devices' memory, orders them by a lower bound on their time
(:mod:`megatron_het.planner.bounds`; a cheap one for all, tightened over the pipeline's fill
and drain when a layout comes up), and probes them in that order (branch and bound): two
closed-form predictions of a layout's distinct replicas give affine per-stage costs
(:func:`~megatron_het.planner.stage_model.probe_stage_model`) and its layer split is balanced
on them under every device's memory. A layout limited by memory brings in its recompute and
sequence-parallel variants. What comes after (finalists, heterogeneous DP, the simulated
ranking) is :mod:`megatron_het.planner.search`'s.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import Prediction, Profile, SimulationCache, fits, predict
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.planner.bounds import (
    KindCosts,
    memory_feasible,
    memory_pressure,
    sync_lower_bound,
    time_lower_bound,
)
from megatron_het.planner.space import (
    KindBlock,
    Layout,
    Placement,
    micro_batch_sizes,
    pipeline_shapes,
)
from megatron_het.planner.stage_model import StageModel, balance_layers, probe_stage_model

# When nothing fits, the layouts closest to fitting by the per-layer bound that are probed to
# report the smallest memory shortfall.
SHORTFALL_PROBES = 16

# Interleaved layouts probed at most (by increasing bound): their bound leaves out the
# exchanges and the uneven rounds of unequal chunks, so it lies further below their time than
# a plain layout's and would let hundreds through.
INTERLEAVED_PROBES = 32


@dataclass
class LayoutSearch:
    """The inputs and running state of one search: every layout with its bound
    (:meth:`layouts`), probed in bound order until the bound passes the ``top_k``-th best time
    (:meth:`run`); ``scored`` holds each fitting layout's closed-form time, stage model and
    split, ``shortfall`` the closest miss when nothing fits."""

    model: ModelConfig
    cluster: ClusterSpec
    global_batch_size: int
    seq_length: int
    profiles: Mapping[str, Profile] | None
    dtype: str
    check_memory: bool
    top_k: int
    max_chunks: int = 1
    fused_elementwise: bool = True
    placement: Placement = field(init=False)
    costs: KindCosts = field(init=False)
    comm: CommCost = field(init=False)
    cache: SimulationCache = field(default_factory=SimulationCache)
    scored: list[tuple[float, StageModel, list[int]]] = field(default_factory=list)
    shortfall: tuple[float, StageModel, int] | None = None
    unbound: set = field(default_factory=set)  # layouts whose split memory did not limit
    too_big: list[tuple[float, Layout]] = field(default_factory=list)  # pruned by memory
    evaluated: int = 0

    def __post_init__(self) -> None:
        self.placement = Placement(self.cluster)
        self.comm = CommCost(self.cluster, self.profiles)
        self.costs = KindCosts(
            self.model,
            self.cluster,
            self.placement,
            self.seq_length,
            self.profiles,
            self.dtype,
            self.cache,
            self.fused_elementwise,
        )

    def predict(self, plan: ParallelPlan) -> Prediction:
        """The simulated prediction of a finalist plan."""
        return predict(
            self.model,
            plan,
            self.cluster,
            self.seq_length,
            self.profiles,
            options=RunOptions.from_plan(
                plan, dtype=self.dtype, fused_elementwise=self.fused_elementwise
            ),
            cache=self.cache,
            comm=self.comm,
        )

    def fits(self, prediction: Prediction) -> bool:
        return not self.check_memory or fits(prediction, self.cluster).ok

    def stage_model(self, layout: Layout) -> StageModel:
        self.evaluated += 1
        return probe_stage_model(
            self.model,
            layout,
            self.placement,
            self.cluster,
            self.seq_length,
            self.profiles,
            self.dtype,
            self.cache,
            self.comm,
            self.fused_elementwise,
        )

    def score(self, layout: Layout) -> None:
        """Probe and balance one layout; remember its time, or its memory shortfall."""
        sm = self.stage_model(layout)
        layers = balance_layers(
            sm, self.model.num_layers, polish=False, check_memory=self.check_memory
        )
        if layers is None:
            short, stage = sm.memory_shortfall(self.model.num_layers)
            if self.shortfall is None or short < self.shortfall[0]:
                self.shortfall = (short, sm, stage)
            return
        t = sm.iteration_time(layers)
        self.scored.append((t, sm, layers))
        free = balance_layers(sm, self.model.num_layers, polish=False, check_memory=False)
        if free is not None and sm.iteration_time(free) >= t * (1 - 1e-9):
            self.unbound.add(base_of(layout))

    def layouts(self, max_micro_batch_size: int) -> list[tuple[float, Layout]]:
        """Every base layout (no recompute, no sequence parallelism) that may fit, with its time
        bound; where a base cannot fit, its memory-saving variants that may
        (:meth:`_variants`)."""
        out: list[tuple[float, Layout]] = []
        for dp, blocks in pipeline_shapes(self.model, self.placement):
            for mbs in micro_batch_sizes(self.global_batch_size, dp, max_micro_batch_size):
                self._add(out, self._base(dp, blocks, mbs, 1))
        if self.max_chunks > 1:
            self._interleaved(out, max_micro_batch_size)
        out.sort(key=lambda item: item[0])
        return out

    def _interleaved(self, out: list[tuple[float, Layout]], max_micro_batch_size: int) -> None:
        """The interleaved layouts: the plain layouts' shapes (per DP degree and micro-batch
        size) of any group count from 2 to the micro-batches (counts that do not divide them
        run in micro-batch groups), each with v = 2 .. max_chunks (a chunk per layer at
        least)."""
        num_layers = self.model.num_layers
        for dp, blocks in pipeline_shapes(self.model, self.placement):
            pp = sum(b.stages for b in blocks)
            for mbs in micro_batch_sizes(self.global_batch_size, dp, max_micro_batch_size):
                if not 2 <= pp <= self.global_batch_size // (dp * mbs):
                    continue
                for v in range(2, min(self.max_chunks, num_layers // pp) + 1):
                    self._add(out, self._base(dp, blocks, mbs, v))

    def _base(self, dp: int, blocks: tuple[KindBlock, ...], mbs: int, num_chunks: int) -> Layout:
        return Layout(dp, blocks, mbs, self.global_batch_size // (dp * mbs), dp > 1, num_chunks)

    def _variants(self, base: Layout) -> list[Layout]:
        """``base`` with recompute on some kinds and/or sequence parallelism (where a stage has
        tp > 1 and the sequence divides): the options that trade time for memory."""
        kinds = list(dict.fromkeys(b.kind for b in base.blocks))
        sp_options = (
            (False, True)
            if any(b.tp > 1 for b in base.blocks)
            and all(self.seq_length % b.tp == 0 for b in base.blocks)
            else (False,)
        )
        out = []
        for mask, sp in itertools.product(range(1 << len(kinds)), sp_options):
            if mask or sp:
                out.append(
                    replace(
                        base,
                        sequence_parallel=sp,
                        blocks=tuple(
                            replace(b, recompute=bool(mask >> kinds.index(b.kind) & 1))
                            for b in base.blocks
                        ),
                    )
                )
        return out

    def _bounded(self, layout: Layout) -> tuple[float, Layout] | None:
        """(time bound, layout), or None (set aside as too big) when it cannot fit."""
        if self.check_memory and not memory_feasible(layout, self.costs, self.model.num_layers):
            self.too_big.append(
                (memory_pressure(layout, self.costs, self.model.num_layers), layout)
            )
            return None
        return self.bound(layout, tight=False), layout

    def bound(self, layout: Layout, tight: bool) -> float:
        """The time bound of a layout that may fit: the loose one orders every layout, the
        tight one (a search over the pipeline's fill, :func:`time_lower_bound`) is taken
        when the layout comes up."""
        layers = self.model.num_layers
        return time_lower_bound(layout, self.costs, layers, tight) + sync_lower_bound(
            layout, self.costs, layers, self.comm
        )

    def _add(self, out: list[tuple[float, Layout]], base: Layout) -> None:
        """``base`` bounded into ``out``; if it cannot fit, its variants that may."""
        found = self._bounded(base)
        if found is not None:
            out.append(found)
            return
        for variant in self._variants(base):
            found = self._bounded(variant)
            if found is not None:
                out.append(found)

    def run(self, max_micro_batch_size: int) -> None:
        """Probe layouts by increasing bound until the bound passes the top_k-th best time.

        A base layout whose split memory limited brings in its variants (recompute, sequence
        parallelism: their bounds are at least its own, since they only add per-layer time);
        variants are skipped where the base was not limited by memory."""
        times: list[float] = []
        interleaved = 0
        heap = [
            (bound, i, layout, False)
            for i, (bound, layout) in enumerate(self.layouts(max_micro_batch_size))
        ]
        heapq.heapify(heap)
        counter = len(heap)
        while heap:
            bound, _, layout, tightened = heapq.heappop(heap)
            if len(times) >= self.top_k and bound * (1 - 1e-6) >= times[self.top_k - 1]:
                break
            if not tightened:  # back in line with its tight bound where that is later
                tight = max(bound, self.bound(layout, tight=True))
                if heap and tight > heap[0][0]:
                    heapq.heappush(heap, (tight, counter, layout, True))
                    counter += 1
                    continue
            base = base_of(layout)
            if layout != base and base in self.unbound:
                continue
            if layout.num_chunks > 1:
                if interleaved >= INTERLEAVED_PROBES:
                    continue
                interleaved += 1
            before = len(self.scored)
            self.score(layout)
            if len(self.scored) > before:
                times.append(self.scored[-1][0])
                times.sort()
            if layout == base and base not in self.unbound:
                for variant in self._variants(base):
                    found = self._bounded(variant)
                    if found is not None:
                        heapq.heappush(heap, (max(found[0], bound), counter, variant, False))
                        counter += 1
        if not self.scored:  # nothing fits: measure how far the closest layouts are
            for _, layout in sorted(self.too_big, key=lambda item: item[0])[:SHORTFALL_PROBES]:
                self.score(layout)


def base_of(layout: Layout) -> Layout:
    """The layout without the options that only trade time for memory: recompute and sequence
    parallelism (which adds the norm weights' all-reduces and saves activations)."""
    return replace(
        layout,
        blocks=tuple(replace(b, recompute=False) for b in layout.blocks),
        sequence_parallel=False,
    )
