"""The automatic parallel planner: search layouts, balance layers, rank by the predictor.

Search order (all predictions are pure computations, no processes):

1. enumerate layouts (:mod:`megatron_het.planner.space`): DP degree, the order of the
   accelerator kinds along the pipeline, TP and stage count per kind, micro-batch size,
   recompute per kind, sequence parallelism and the interleaving degree (v = 2 ..
   ``max_virtual_stages`` chunks per device group, any group count up to the micro-batches:
   Megatron-LM's micro-batch groups run the counts that do not divide them); ZeRO-1 is on
   whenever dp > 1 (it never adds time in the cost model) and the best layouts are retried
   without it. Recompute and sequence parallelism only trade time for memory, so they are
   tried where the layout without them is limited by memory. Layouts whose per-layer bytes
   cannot fit are dropped, the rest ordered by a lower bound on their time
   (:mod:`megatron_het.planner.bounds`; a cheap one for all, tightened over the pipeline's
   fill and drain when a layout comes up, which sends most back down the line);
2. layouts are probed in that order (branch and bound) until the bound passes the ``top_k``-th
   best time found (interleaved ones at most ``INTERLEAVED_PROBES``): two closed-form
   predictions of its distinct replicas give affine per-stage costs
   (:func:`~megatron_het.planner.stage_model.probe_stage_model`) and the layer split is balanced
   on them under every device's memory. A layout limited by memory brings in its recompute and
   sequence-parallel variants;
3. the best ``refine`` splits get a local search, the best ``top_k`` are predicted with the
   event-driven pipeline simulation (small ones polished under it: plain splits per stage,
   interleaved ones per chunk, :mod:`megatron_het.planner.chunk_polish`), and those that
   recompute recompute only the layers their memory needs (Megatron's block method:
   :mod:`megatron_het.planner.recompute_polish`);
4. on clusters of two or more kinds, heterogeneous DP (every kind its own replicas, the batch
   shared by speed: :mod:`megatron_het.planner.kind_replicas`) is searched where its bound
   is under the best closed-form time found, and its best plans join the candidates; the
   fastest candidate is the plan.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import Prediction, Profile, SimulationCache, fits, predict
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.perf.cost.memory import GIB
from megatron_het.planner.bounds import (
    KindCosts,
    memory_feasible,
    memory_pressure,
    sync_lower_bound,
    time_lower_bound,
)
from megatron_het.planner.chunk_polish import polish_chunks
from megatron_het.planner.kind_replicas import ReplicaSearch
from megatron_het.planner.recompute_polish import relax_recompute
from megatron_het.planner.result import Candidate, SearchResult
from megatron_het.planner.space import (
    KindBlock,
    Layout,
    Placement,
    build_plan,
    micro_batch_sizes,
    pipeline_shapes,
)
from megatron_het.planner.stage_model import (
    StageModel,
    balance_layers,
    layer_caps,
    polish_split,
    probe_stage_model,
)

# The best layouts retried without ZeRO-1 (it never adds time in the cost model, so this only
# confirms the choice; a cheap check against a change of the model).
ZERO1_RETRIES = 3


# When nothing fits, the layouts closest to fitting by the per-layer bound that are probed to
# report the smallest memory shortfall.
SHORTFALL_PROBES = 16

# The most interleaved chunks per device group the search tries: the bubble falls as 1 / v,
# the exchanges grow as v (overlapped with compute, they cost where a transfer outlasts it) and
# so do the activations held in the warm-up.
MAX_VIRTUAL_STAGES = 4

# Interleaved layouts probed at most (by increasing bound): their bound leaves out the
# exchanges and the uneven rounds of unequal chunks, so it lies further below their time than
# a plain layout's and would let hundreds through.
INTERLEAVED_PROBES = 32

# Splits of the finalists are also polished under the 1F1B simulation when it is cheap (about
# stages^2 moves of stages x micro-batches steps each); with many micro-batches the closed form
# and the simulation agree closely anyway.
SIMULATED_POLISH_LIMIT = 200_000


@dataclass
class _Search:
    """The inputs and running state of one search."""

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
            self.unbound.add(_base_of(layout))

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
            base = _base_of(layout)
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


def _base_of(layout: Layout) -> Layout:
    """The layout without the options that only trade time for memory: recompute and sequence
    parallelism (which adds the norm weights' all-reduces and saves activations)."""
    return replace(
        layout,
        blocks=tuple(replace(b, recompute=False) for b in layout.blocks),
        sequence_parallel=False,
    )


def search_plan(
    model: ModelConfig,
    cluster: ClusterSpec,
    global_batch_size: int,
    seq_length: int,
    profiles: Mapping[str, Profile] | None = None,
    dtype: str = "bf16",
    *,
    top_k: int = 5,
    refine: int = 16,
    max_micro_batch_size: int = 16,
    check_memory: bool = True,
    max_virtual_stages: int = MAX_VIRTUAL_STAGES,
    heterogeneous_dp: bool = True,
    fused_elementwise: bool = True,
) -> SearchResult:
    """Search the best plan for ``model`` on every device of ``cluster``.

    Returns the fastest plan by the simulated prediction among the ``top_k`` best closed-form
    candidates (each checked with :func:`megatron_het.perf.fits`; ``refine`` is how many get a
    local search of their split first), without the efficiency figures: a caller attaches
    :func:`~megatron_het.planner.baseline.homogeneous_baseline` and
    :func:`~megatron_het.planner.ceiling.compute_ceiling` (``with_baseline``,
    ``with_ceiling``). Micro-batch sizes go up to ``max_micro_batch_size``.
    ``check_memory=False`` ignores device memory (used for the bound of a kind that cannot hold
    the model alone). ``max_virtual_stages`` caps the interleaving degree (1: plain 1F1B only).
    ``heterogeneous_dp`` also searches replicas of one kind each with batch shares by speed
    (:mod:`megatron_het.planner.kind_replicas`; clusters of two or more kinds).
    ``fused_elementwise`` False plans for a run without ``--compile``: GPU kinds' decoder
    layers are priced eager in bf16/fp16, as :func:`~megatron_het.perf.predict` prices them
    (True, the default, prices fused layers, as the predictor's default does).
    Raises UserError when no plan fits, with the smallest shortfall.
    """
    if global_batch_size < 1 or seq_length < 1:
        raise UserError(
            f"--global-batch-size ({global_batch_size}) and --seq-length "
            f"({seq_length}) must be at least 1"
        )
    start = time.perf_counter()
    with _fewer_collections():
        search = _Search(
            model,
            cluster,
            global_batch_size,
            seq_length,
            profiles,
            dtype,
            check_memory,
            max(1, top_k),
            max(1, max_virtual_stages),
            fused_elementwise,
        )
        search.run(max_micro_batch_size)
        candidates = _finalists(search, top_k, refine) if search.scored else []
        beat = min((c.closed_form_s for c in candidates), default=math.inf)
        replicas = (
            _replica_candidates(search, max_micro_batch_size, beat) if heterogeneous_dp else []
        )
        if not candidates and not replicas:
            raise UserError(_no_fit_message(search))
        candidates = sorted(candidates + replicas, key=lambda c: c.prediction.iteration_time_s)[
            : max(1, top_k)
        ]
    best = candidates[0]
    return SearchResult(
        best.plan, best.prediction, tuple(candidates), search.evaluated, time.perf_counter() - start
    )


def _replica_candidates(search: _Search, max_micro_batch_size: int, beat: float) -> list[Candidate]:
    """The best heterogeneous-DP plans (replicas of one kind each) whose bound is under
    ``beat`` seconds (the closed-form time of the best other plan), predicted in full."""
    replicas = ReplicaSearch(
        search.model,
        search.cluster,
        search.placement,
        search.global_batch_size,
        search.seq_length,
        search.profiles,
        search.dtype,
        search.check_memory,
        search.cache,
        search.comm,
        search.fused_elementwise,
    )
    found = replicas.candidates(max_micro_batch_size, search.top_k, beat)
    search.evaluated += replicas.probes
    out = []
    for layout, plan, prediction, closed_form in found:
        plan, prediction = relax_recompute(plan, search.predict, search.fits, prediction)
        plan, prediction = _rings_or_collectives(plan, search, prediction)
        out.append(
            Candidate(
                layout,
                tuple(n for part in layout.parts for n in part.layers),
                closed_form,
                plan,
                prediction,
            )
        )
    return out


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """Run the cyclic garbage collector about a hundred times less often while searching: a
    search allocates millions of small objects that stay alive (probe plans of thousands of
    stages, memos) and makes little cyclic garbage, so the collector's passes over them took a
    third of a 16,384-device search."""
    before = gc.get_threshold()
    gc.set_threshold(100_000, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _finalists(search: _Search, top_k: int, refine: int) -> list[Candidate]:
    """Polish the best ``refine`` splits (and try them without ZeRO-1), simulate the best
    ``top_k``, and order them by simulated iteration time."""
    search.scored.sort(key=lambda item: item[0])
    polished: list[tuple[float, StageModel, list[int]]] = []
    for rank, (_, sm, layers) in enumerate(search.scored[:refine]):
        polished.append(_polish(search, sm, layers))
        if sm.layout.zero1 and rank < ZERO1_RETRIES:
            plain = search.stage_model(replace(sm.layout, zero1=False))
            split = balance_layers(plain, search.model.num_layers, check_memory=search.check_memory)
            if split is not None:
                polished.append((plain.iteration_time(split), plain, split))
    ranked = sorted(
        (_overlapped(search, t, sm, layers) for t, sm, layers in polished), key=lambda item: item[0]
    )
    out = []
    for _, sm, layers, overlap in ranked:
        if len(out) == max(1, top_k):
            break
        plain = sm.layout.num_chunks == 1
        if (
            plain
            and not overlap
            and sm.num_stages**3 * sm.layout.micro_batches <= SIMULATED_POLISH_LIMIT
        ):
            caps = layer_caps(sm, search.model.num_layers, search.check_memory)
            layers = polish_split(
                sm, layers, caps, lambda split: sm.simulated_time(split, search.cache)
            )
        plan = build_plan(
            sm.layout,
            layers,
            search.placement,
            search.dtype,
            description=f"megatron_het planner: {sm.layout.describe()}"
            f"{_overlap_words(sm, overlap)}",
        )
        if overlap:
            plan = replace(
                plan,
                overlap_grad_reduce=True,
                overlap_param_gather=True if sm.layout.zero1 else None,
            )
        prediction = search.predict(plan)
        if not search.fits(prediction):
            if not plain:  # its memory between the probes was interpolated: drop it
                continue
            raise AssertionError(
                f"planner produced a plan that does not fit: "
                f"{fits(prediction, search.cluster).message}"
            )
        n = sm.num_stages * sm.layout.num_chunks
        if (
            not plain and n**3 * sm.layout.micro_batches * sm.layout.dp <= SIMULATED_POLISH_LIMIT
        ):  # every replica is predicted per move
            plan, prediction = polish_chunks(plan, search.predict, search.fits, prediction)
            chunks = plan.pipelines[0].stages
            layers = [
                sum(st.num_layers for st in chunks[g :: sm.num_stages])
                for g in range(sm.num_stages)
            ]
        plan, prediction = relax_recompute(plan, search.predict, search.fits, prediction)
        plan, prediction = _rings_or_collectives(
            plan, search, prediction, search.placement.distinct_pipelines(sm.layout)
        )
        out.append(Candidate(sm.layout, tuple(layers), sm.iteration_time(layers), plan, prediction))
    if not out:
        raise AssertionError(
            "every finalist of the planner exceeded memory once predicted in "
            "full (interleaved layouts whose memory was interpolated)"
        )
    out.sort(key=lambda c: c.prediction.iteration_time_s)
    return out


def _rings_or_collectives(
    plan: ParallelPlan, search: _Search, prediction: Prediction, distinct: list[int] | None = None
) -> tuple[ParallelPlan, Prediction]:
    """A sequence-parallel plan with the TP rings (``tp_comm_overlap``, as the search prices
    it) or with whole collectives, whichever is predicted faster and fits: the rings gather
    the GEMMs' inputs again in backward, which costs more than they hide where the GEMMs are
    short beside slow links. ``distinct``: the pipelines that price every replica of identical
    ones; the whole-collectives plan is priced on them first and in full only if faster."""
    if not plan.tp_comm_overlap:
        return plan, prediction
    whole = replace(plan, tp_comm_overlap=None)
    if distinct is not None:
        quick = predict(
            search.model,
            whole,
            search.cluster,
            search.seq_length,
            search.profiles,
            options=RunOptions.from_plan(
                whole, dtype=search.dtype, fused_elementwise=search.fused_elementwise
            ),
            cache=search.cache,
            validate=False,
            comm=search.comm,
            pipelines=distinct,
        )
        if quick.iteration_time_s >= prediction.iteration_time_s * (1 - 1e-9):
            return plan, prediction
    other = search.predict(whole)
    if other.iteration_time_s < prediction.iteration_time_s * (1 - 1e-9) and search.fits(other):
        return whole, other
    return plan, prediction


def _overlap_words(sm: StageModel, overlap: bool) -> str:
    """The DP overlap options a plan's description names."""
    if not overlap:
        return ""
    return " overlap_grad_reduce" + (" overlap_param_gather" if sm.layout.zero1 else "")


def _overlapped(
    search: _Search, time_s: float, sm: StageModel, layers: list[int]
) -> tuple[float, StageModel, list[int], bool]:
    """(closed-form time, stage model, split, overlap): with the DP gradient reduction
    started in the last backward and, under ZeRO-1, the parameter all-gather run under the
    next forward, where that hides time (dp > 1; the stage model pays the whole sync, so the
    overlap is credited here, on the finalists)."""
    if sm.layout.dp == 1:
        return time_s, sm, layers, False
    plan = build_plan(sm.layout, layers, search.placement, search.dtype)
    overlapped = predict(
        search.model,
        plan,
        search.cluster,
        search.seq_length,
        search.profiles,
        options=RunOptions.from_plan(
            plan,
            dtype=search.dtype,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            fused_elementwise=search.fused_elementwise,
        ),
        pipeline_model="closed_form",
        cache=search.cache,
        validate=False,
        comm=search.comm,
        pipelines=search.placement.distinct_pipelines(sm.layout),
    )
    if overlapped.iteration_time_s < time_s * (1 - 1e-9):
        return overlapped.iteration_time_s, sm, layers, True
    return time_s, sm, layers, False


def _polish(
    search: _Search, sm: StageModel, layers: list[int]
) -> tuple[float, StageModel, list[int]]:
    caps = layer_caps(sm, search.model.num_layers, search.check_memory)
    better = polish_split(sm, layers, caps)
    return sm.iteration_time(better), sm, better


def _no_fit_message(search: _Search) -> str:
    cluster, model = search.cluster, search.model
    counts = ", ".join(f"{n} {k}" for k, n in cluster.accelerator_counts().items())
    if search.shortfall is None:
        return (
            f"no layout of {model.name} fits cluster {cluster.name} ({counts}): every "
            f"pipeline would need more stages than the model's {model.num_layers} layers or "
            f"a TP degree that divides no node; use a cluster whose kinds' device counts "
            f"share a divisor and fit the model"
        )
    short, sm, stage = search.shortfall
    block = sm.layout.stage_kinds()[stage]
    usable = sm.usable_bytes[stage]
    ratio = (usable + short) / usable
    return (
        f"cluster {cluster.name} ({counts}) cannot hold {model.name}: the closest plan "
        f"({_knobs(sm.layout)}) lacks {short / GIB:.1f} GiB per {block.kind} device "
        f"(needs {(usable + short) / GIB:.1f} of {usable / GIB:.1f} GiB usable); add devices "
        f"(about {ratio:.1f}x as many) or use a smaller model, since recompute and ZeRO-1 "
        f"were already tried"
    )


def _knobs(layout: Layout) -> str:
    rc = [b.kind for b in layout.blocks if b.recompute]
    return (
        f"{layout.describe()}, recompute {'on ' + '/'.join(rc) if rc else 'off'}, "
        f"ZeRO-1 {'on' if layout.zero1 else 'off (dp=1)'}"
    )


__all__ = ["search_plan"]
