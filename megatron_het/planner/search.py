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
2. layouts are probed in that order (branch and bound,
   :mod:`megatron_het.planner.layout_search`) until the bound passes the ``top_k``-th
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
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import Prediction, Profile, fits, predict
from megatron_het.perf.cost.memory import GIB
from megatron_het.planner.chunk_polish import polish_chunks
from megatron_het.planner.kind_replicas import ReplicaSearch
from megatron_het.planner.layout_search import LayoutSearch
from megatron_het.planner.recompute_polish import relax_recompute
from megatron_het.planner.result import Candidate, SearchResult
from megatron_het.planner.space import (
    Layout,
    build_plan,
)
from megatron_het.planner.stage_model import (
    StageModel,
    balance_layers,
    layer_caps,
    polish_split,
)

# The best layouts retried without ZeRO-1 (it never adds time in the cost model, so this only
# confirms the choice; a cheap check against a change of the model).
ZERO1_RETRIES = 3


# The most interleaved chunks per device group the search tries: the bubble falls as 1 / v,
# the exchanges grow as v (overlapped with compute, they cost where a transfer outlasts it) and
# so do the activations held in the warm-up.
MAX_VIRTUAL_STAGES = 4

# Splits of the finalists are also polished under the 1F1B simulation when it is cheap (about
# stages^2 moves of stages x micro-batches steps each); with many micro-batches the closed form
# and the simulation agree closely anyway.
SIMULATED_POLISH_LIMIT = 200_000


def search_plan(
    model: ModelConfig,
    cluster: ClusterSpec,
    global_batch_size: int,
    seq_length: int,
    profiles: Mapping[str, Profile] | None = None,
    options: RunOptions | None = None,
    *,
    top_k: int = 5,
    refine: int = 16,
    max_micro_batch_size: int = 16,
    check_memory: bool = True,
    max_virtual_stages: int = MAX_VIRTUAL_STAGES,
    heterogeneous_dp: bool = True,
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
    ``options`` are the run's (:class:`~megatron_het.config.RunOptions`; None: the
    defaults, bf16 and fused layers, as the predictor's): plans are priced in its precision and
    layer mode (``fused_elementwise`` False plans for a run without ``--compile``: GPU kinds'
    decoder layers priced eager in bf16/fp16); the search chooses ZeRO-1, the DP overlaps,
    sequence parallelism and recompute itself.
    Raises UserError when no plan fits, with the smallest shortfall.
    """
    options = options if options is not None else RunOptions()
    if global_batch_size < 1 or seq_length < 1:
        raise UserError(
            f"--global-batch-size ({global_batch_size}) and --seq-length "
            f"({seq_length}) must be at least 1"
        )
    start = time.perf_counter()
    with _fewer_collections():
        search = LayoutSearch(
            model,
            cluster,
            global_batch_size,
            seq_length,
            profiles,
            options.dtype,
            check_memory,
            max(1, top_k),
            max(1, max_virtual_stages),
            options.fused_elementwise,
        )
        search.run(max_micro_batch_size)
        candidates = _finalists(search, top_k, refine) if search.scored else []
        beat = min((c.closed_form_s for c in candidates), default=math.inf)
        replicas = (
            _replica_candidates(search, max_micro_batch_size, beat) if heterogeneous_dp else []
        )
        if not candidates and not replicas:
            raise UserError(_no_fit_message(search))
        candidates = sorted(candidates + replicas, key=_simulated_s)[: max(1, top_k)]
    best = candidates[0]
    assert best.prediction is not None  # every finalist is simulated
    return SearchResult(
        best.plan, best.prediction, tuple(candidates), search.evaluated, time.perf_counter() - start
    )


def _simulated_s(candidate: Candidate) -> float:
    """A finalist's simulated iteration time (finalists are always simulated)."""
    assert candidate.prediction is not None
    return candidate.prediction.iteration_time_s


def _replica_candidates(
    search: LayoutSearch, max_micro_batch_size: int, beat: float
) -> list[Candidate]:
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


def _finalists(search: LayoutSearch, top_k: int, refine: int) -> list[Candidate]:
    """Polish the best ``refine`` splits (and try them without ZeRO-1), simulate the best
    ``top_k``, and order them by simulated iteration time."""
    search.scored.sort(key=lambda item: item[0])
    polished: list[tuple[float, StageModel, list[int]]] = []
    for rank, (_, sm, layers) in enumerate(search.scored[:refine]):
        polished.append(_polish(search, sm, layers))
        if sm.layout.zero1 and rank < ZERO1_RETRIES:
            no_zero1 = search.stage_model(replace(sm.layout, zero1=False))
            split = balance_layers(
                no_zero1, search.model.num_layers, check_memory=search.check_memory
            )
            if split is not None:
                polished.append((no_zero1.iteration_time(split), no_zero1, split))
    ranked = sorted(
        (_overlapped(search, t, sm, layers) for t, sm, layers in polished), key=lambda item: item[0]
    )
    out: list[Candidate] = []
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
            layers = [  # whole layers: the planner places no half-layer bounds
                int(sum(st.num_layers for st in chunks[g :: sm.num_stages]))
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
    out.sort(key=_simulated_s)
    return out


def _rings_or_collectives(
    plan: ParallelPlan,
    search: LayoutSearch,
    prediction: Prediction,
    distinct: list[int] | None = None,
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
    search: LayoutSearch, time_s: float, sm: StageModel, layers: list[int]
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
    search: LayoutSearch, sm: StageModel, layers: list[int]
) -> tuple[float, StageModel, list[int]]:
    caps = layer_caps(sm, search.model.num_layers, search.check_memory)
    better = polish_split(sm, layers, caps)
    return sm.iteration_time(better), sm, better


def _no_fit_message(search: LayoutSearch) -> str:
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
