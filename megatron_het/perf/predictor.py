"""Predict iteration time, throughput and memory of a parallel plan on a cluster: :func:`predict`.

One iteration = the slowest pipeline's 1F1B makespan (every DP replica syncs at the end of the
iteration, so all wait for the slowest), then the DP gradient sync (all device groups at once;
the slowest one's sync counts), then the optimizer step (the slowest device's). What each stage
costs per micro-batch and each device per iteration (compute, TP communication, boundaries,
DP sync, memory, optimizer step; sequence parallelism, interleaving, heterogeneous DP) is
:class:`~megatron_het.perf.stage_pricing.PredictionContext`'s part; this module times the
pipelines and assembles the iteration (:class:`~megatron_het.perf.estimates.Prediction`).

The run's options (:class:`~megatron_het.config.RunOptions`) set the DP overlaps:
``overlap_grad_reduce`` starts each gradient bucket's reduction in the last backward, so the
iteration pays only ``dp_exposed_s`` of the sync (:mod:`megatron_het.perf.cost.dp_sync_overlap`:
the buckets as the runtime lays them out, each started when its last gradient is in, one after
another; ZeRO-1's parameter all-gather stays after the step unless ``overlap_param_gather``
runs it under the next forward, where it delays that forward only by what its first layers
cannot wait for). They change nothing for
pipelines of different layouts (their replica sums do not overlap in the runtime) nor where
a rate model prices the iteration (its DP sync stays whole). ``grad_reduce_in_bf16`` (bf16
training only) halves the gradient bytes of the DP reduction
(:mod:`megatron_het.perf.cost.dp_sync`).

The pipeline time is the event-driven simulation of the 1F1B step lists
(:mod:`megatron_het.perf.schedule.simulator`); the closed form and the lower bound are reported
beside it as checks (:mod:`megatron_het.perf.schedule.closed_forms`).
``pipeline_model="closed_form"`` skips the simulation (for fast searches): the pipeline time is
then :func:`~megatron_het.perf.schedule.closed_forms.closed_form_pipeline`, the same function
the planner's per-stage model prices a split with. Interleaved pipelines' per-group step lists
are simulated over per-stage (per-chunk) times.

Every rank owns its device unless an optional rate model
(:mod:`megatron_het.perf.cost.rate_model`) says otherwise: ranks that share a host's cores
(CPU emulation's :class:`~megatron_het.emulation.host_model.SharedHostModel`) then have all
their pipelines simulated together on the shared cores, with the model's DP sync, optimizer
step and other per-iteration time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.errors import UserError
from megatron_het.parallel.buckets import bucket_size_mb
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_validation import validate as validate_plan
from megatron_het.parallel.stage_plan import PipelinePlan
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.perf.cost.dp_sync_overlap import exposed_sync
from megatron_het.perf.cost.rate_model import RateModel, SharedIteration
from megatron_het.perf.cost.roofline import Efficiency, dtype_bytes
from megatron_het.perf.estimates import PipelinePrediction, Prediction, StagePrediction
from megatron_het.perf.measure.profile_format import Profile
from megatron_het.perf.schedule.closed_forms import (
    bubble_fraction,
    closed_form_pipeline,
    group_sums,
    last_backward_ends,
    lower_bound_1f1b,
    lower_bound_interleaved,
)
from megatron_het.perf.schedule.simulation_cache import SimulationCache
from megatron_het.perf.schedule.simulator import simulate_pipelines
from megatron_het.perf.stage_pricing import PredictionContext

PIPELINE_MODELS = ("simulate", "closed_form")


def predict(
    model: ModelConfig,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    seq_length: int,
    profiles: Mapping[str, Profile] | None = None,
    options: RunOptions | None = None,
    *,
    recompute: bool | None = None,
    efficiency: Efficiency | None = None,
    pipeline_model: str = "simulate",
    cache: SimulationCache | None = None,
    validate: bool = True,
    rate_model: RateModel | None = None,
    pipelines: Sequence[int] | None = None,
    comm: CommCost | None = None,
    scatter_gather_tensors_in_pipeline: bool = False,
) -> Prediction:
    """Estimate one training iteration of ``plan`` (see the module docstring for the model).

    ``options`` are the run's (:class:`~megatron_het.config.RunOptions`, resolved once from a
    run's flags and plan; None: what ``plan`` says, :meth:`RunOptions.from_plan`): the
    precision, ZeRO-1, the DP reduction's overlap with backward (``overlap_param_gather`` only
    counts under ZeRO-1) in buckets of ``ddp_bucket_size`` parameters and its bf16 copies
    (UserError for a bf16 reduction of non-bf16 training), interleaved pipelines' transfers
    overlapped with compute, and ``fused_elementwise``: False prices the runtime's eager
    decoder layers on GPU kinds in bf16/fp16 (``--compile`` off): their elementwise kernels
    move :data:`~megatron_het.perf.cost.roofline.EAGER_ELEMENTWISE_TRAFFIC` times the fused
    minimum (:func:`~megatron_het.perf.cost.calibration.layer_efficiency`; True prices fused
    layers, as the calibration's published runs have them; CPU and emulated kinds are priced
    alike either way); a kind's measured profile gives its entries of that mode, or those of
    the other mode scaled by the roofline's ratio of the modes
    (:func:`~megatron_het.perf.cost.compute_time.stage_compute`). Sequence parallelism, its TP
    overlap (``tp_comm_overlap``: sequence-parallel stages with tp > 1) and each stage's
    recompute are the plan's.
    ``recompute`` (a what-if) None keeps each stage's own setting (``recompute`` and
    ``recompute_num_layers``), True/False recomputes every layer of every stage / none.
    ``scatter_gather_tensors_in_pipeline`` (Megatron-LM 2021's, not a runtime option): the
    boundaries of tp > 1 stages move ``1/tp`` shares as under sequence parallelism, in a plan
    without it (module docstring).
    ``profiles`` maps accelerator kind names to measured profiles (roofline where absent);
    ``efficiency`` None: each kind's calibrated efficiency factors (the cost model's defaults
    for emulated kinds and cpu; :mod:`megatron_het.perf.cost.compute_time`).
    ``cache`` reuses built schedules across calls (a planner's loop); ``validate=False`` skips
    the plan check for plans known to be valid; ``pipelines`` (indices) prices only those DP
    replicas, for a caller that knows every other one runs like one of them (a planner's
    probes of identical replicas): rows, times and the iteration are theirs, the DP sync still
    spans every replica; ``comm`` reuses a communication model of this cluster and these
    profiles across calls (it memoizes links and rings). ``rate_model`` (with ``pipeline_model``
    "simulate") models ranks that share their compute where it applies. Pure: no processes,
    no I/O.
    """
    if seq_length < 1:
        raise UserError(f"seq_length must be at least 1, got {seq_length}")
    if pipeline_model not in PIPELINE_MODELS:
        raise UserError(f"pipeline_model must be one of {', '.join(PIPELINE_MODELS)}")
    options = options if options is not None else RunOptions.from_plan(plan)
    dtype = options.dtype
    dtype_bytes(dtype)
    zero1 = options.use_distributed_optimizer
    if options.grad_reduce_in_bf16 and dtype != "bf16":
        raise UserError(
            f"grad_reduce_in_bf16 needs bf16 training but this one is {dtype}; "
            "train in bf16 or drop grad_reduce_in_bf16"
        )
    if validate:
        validate_plan(plan, model, cluster, seq_length=seq_length)
    cache = cache or SimulationCache()
    ctx = PredictionContext(
        model,
        plan,
        cluster,
        seq_length,
        profiles,
        dtype,
        zero1,
        recompute,
        efficiency,
        comm or CommCost(cluster, profiles),
        options.overlap_grad_reduce,
        options.grad_reduce_in_bf16,
        cache,
        zero1 and options.overlap_param_gather,
        bool(plan.tp_comm_overlap),
        bucket_size_mb(options.ddp_bucket_size),
        scatter_gather_tensors_in_pipeline,
        options.fused_elementwise,
    )
    chosen = range(len(plan.pipelines)) if pipelines is None else sorted(set(pipelines))
    shared_by = rate_model if pipeline_model == "simulate" and pipelines is None else None
    return _iteration(ctx, chosen, pipeline_model, cache, options.overlap_p2p_comm, shared_by)


def _iteration(
    ctx: PredictionContext,
    chosen: Sequence[int],
    pipeline_model: str,
    cache: SimulationCache,
    overlap_p2p: bool,
    rate_model: RateModel | None,
) -> Prediction:
    """Price the ``chosen`` pipelines' stages, time the pipelines and assemble the iteration
    (see :func:`predict`); ``rate_model``: where it applies, all pipelines run on its shared
    cores."""
    plan = ctx.plan
    overlapped = ctx.overlap_grad_reduce and ctx.sync.uniform and plan.dp_size > 1
    gathered_under_forward = ctx.overlap_param_gather and ctx.sync.uniform and plan.dp_size > 1
    stages: list[StagePrediction] = []
    timed: list[PipelinePrediction] = []
    ends: list[LastBackwards | None] = []
    for p in chosen:
        pipeline = plan.pipelines[p]
        rows = ctx.pipeline_rows(p, pipeline, cache)
        stages += rows
        timing, last = _pipeline_time(
            p, pipeline, rows, pipeline_model, cache, overlap_p2p, overlapped
        )
        timed.append(timing)
        ends.append(last)
    shared = None if rate_model is None else rate_model.shared_iteration(ctx, stages)
    if shared is not None:
        timed = _shared_pipelines(plan, stages, timed, shared, cache, overlap_p2p)
        return _assemble(
            ctx,
            stages,
            timed,
            pipeline_model,
            overlap_p2p,
            shared.optimizer_s,
            shared.overhead_s,
            shared.dp_sync_s,
        )
    exposed = (
        _exposed_sync(
            ctx, timed, ends if overlapped else None, stages if gathered_under_forward else None
        )
        if overlapped or gathered_under_forward
        else None
    )
    return _assemble(ctx, stages, timed, pipeline_model, overlap_p2p, dp_exposed=exposed)


def _shared_pipelines(
    plan: ParallelPlan,
    rows: list[StagePrediction],
    pipelines: list[PipelinePrediction],
    shared: SharedIteration,
    cache: SimulationCache,
    overlap_p2p: bool,
) -> list[PipelinePrediction]:
    """Every pipeline's time when all run at once on the rate model's shared cores."""
    schedules = [
        cache.schedule(pp.pp_size, pp.micro_batches, pp.num_chunks, overlap_p2p)
        for pp in plan.pipelines
    ]
    result = simulate_pipelines(schedules, shared.stages, shared.sharing)
    out = []
    for pp, plan_pp, t in zip(pipelines, plan.pipelines, result.makespans_s):
        mine = [r for r in rows if r.pipeline == pp.pipeline]
        f, b = group_sums(
            plan_pp.pp_size, [r.forward_s for r in mine], [r.backward_s for r in mine]
        )
        out.append(
            dataclasses.replace(
                pp, time_s=t, bubble_fraction=bubble_fraction(t, f, b, pp.micro_batches)
            )
        )
    return out


# per device group, per chunk: (end, duration) of the chunk's last backward
LastBackwards = list[tuple[tuple[float, float], ...]]


def _pipeline_time(
    p: int,
    pipeline: PipelinePlan,
    rows: list[StagePrediction],
    pipeline_model: str,
    cache: SimulationCache,
    overlap_p2p: bool,
    with_ends: bool = False,
) -> tuple[PipelinePrediction, LastBackwards | None]:
    """Simulated (or closed-form) time, with the closed form, lower bound and bubble; with
    ``with_ends`` also when and for how long each device group runs its last backward (from
    the simulated timeline, or :func:`last_backward_ends` with the closed form), chunk by
    chunk;
    ``overlap_p2p``: an interleaved pipeline's transfers overlap its compute."""
    m, v = pipeline.micro_batches, pipeline.num_chunks
    f, b = [r.forward_s for r in rows], [r.backward_s for r in rows]
    cf, cb = [r.p2p_forward_s for r in rows[:-1]], [r.p2p_backward_s for r in rows[:-1]]
    closed = closed_form_pipeline(f, b, m, v, cf, cb, overlap_p2p)
    if v == 1:
        lower = lower_bound_1f1b(f, b, m)
        group_f, group_b = f, b
    else:
        lower = lower_bound_interleaved(f, b, m, v, cf, cb)
        group_f, group_b = group_sums(pipeline.pp_size, f, b)
    ends: LastBackwards | None = None
    if pipeline_model == "closed_form":
        time = closed
        if with_ends:
            groups, stages = pipeline.pp_size, len(b)
            per_stage = list(zip(last_backward_ends(b, time, stages, cb), b))
            ends = [tuple(per_stage[g::groups]) for g in range(groups)]
    elif with_ends:
        time, held = cache.last_backwards(f, b, m, cf, cb, v, overlap_p2p)
        ends = list(held)
    else:
        time = cache.makespan(f, b, m, cf, cb, v, overlap_p2p)
    return (
        PipelinePrediction(p, m, time, closed, lower, bubble_fraction(time, group_f, group_b, m)),
        ends,
    )


def _exposed_sync(
    ctx: PredictionContext,
    pipelines: list[PipelinePrediction],
    ends: list[LastBackwards | None] | None,
    rows: list[StagePrediction] | None,
) -> float:
    """The DP sync the iteration pays past the slowest pipeline (uniform layouts;
    :func:`exposed_sync`): with ``ends`` the buckets' reductions start in the last backward,
    with ``rows`` the parameter all-gathers run under the next forward."""
    starts = None
    if rows is not None:
        starts = []
        for pp in pipelines:
            mine = [r for r in rows if r.pipeline == pp.pipeline]
            groups = ctx.plan.pipelines[pp.pipeline].pp_size
            fill, firsts = 0.0, []
            for row in mine:  # every chunk, in pipeline order: when micro-batch 0 reaches it
                firsts.append((fill, row.forward_s))
                fill += row.forward_s + row.p2p_forward_s
            starts.append([tuple(firsts[g::groups]) for g in range(groups)])
    return exposed_sync(
        ctx.model,
        ctx.plan,
        lambda g: ctx.sync.split(ctx.comm, 0, g),
        [pp.time_s for pp in pipelines],
        None if ends is None else [e for e in ends if e is not None],
        ctx.bucket_size_mb,
        first_forwards=starts,
    )


def _assemble(
    ctx: PredictionContext,
    stages: list[StagePrediction],
    pipelines: list[PipelinePrediction],
    pipeline_model: str,
    overlap_p2p: bool,
    optimizer: float | None = None,
    overhead: float = 0.0,
    dp_sync: float | None = None,
    dp_exposed: float | None = None,
) -> Prediction:
    """The iteration's figures; ``dp_exposed`` None: the whole DP sync is paid."""
    plan, model = ctx.plan, ctx.model
    slowest = max(pipelines, key=lambda pp: pp.time_s)
    if dp_sync is None:
        dp_sync = max(s.dp_sync_s for s in stages)
    if dp_exposed is None:
        dp_exposed = dp_sync
    if optimizer is None:
        optimizer = max(s.optimizer_s for s in stages)
    iteration = slowest.time_s + dp_exposed + optimizer + overhead
    tokens = plan.global_batch_size * ctx.seq
    flops = model.flops_per_token(ctx.seq) * tokens
    peak_of: dict[str, float] = {}  # peak FLOP/s per kind, looked up once
    peak, devices = 0.0, 0
    for pipeline in plan.pipelines:
        for group in pipeline.device_groups:
            kind = ctx.comm.kind_of(group[0])  # a device group is of one kind
            if kind not in peak_of:
                peak_of[kind] = ctx.comm.spec_of(group[0]).peak_tflops(ctx.dtype) * 1e12
            peak += peak_of[kind] * len(group)
            devices += len(group)
    return Prediction(
        model=model.name,
        seq_length=ctx.seq,
        dtype=ctx.dtype,
        use_distributed_optimizer=ctx.zero1,
        overlap_grad_reduce=ctx.overlap_grad_reduce,
        overlap_param_gather=ctx.overlap_param_gather,
        grad_reduce_in_bf16=ctx.grad_reduce_in_bf16,
        overlap_p2p_comm=overlap_p2p and any(pp.interleaved for pp in plan.pipelines),
        micro_batch_size=plan.micro_batch_size,
        global_batch_size=plan.global_batch_size,
        pipeline_model=pipeline_model,
        stages=tuple(stages),
        pipelines=tuple(pipelines),
        pipeline_time_s=slowest.time_s,
        dp_sync_s=dp_sync,
        dp_exposed_s=dp_exposed,
        optimizer_s=optimizer,
        iteration_time_s=iteration,
        tokens_per_s=tokens / iteration,
        model_flops_per_iteration=flops,
        num_devices=devices,
        peak_flops_sum=peak,
        bubble_fraction=slowest.bubble_fraction,
        overhead_s=overhead,
    )


__all__ = ["PIPELINE_MODELS", "predict"]
