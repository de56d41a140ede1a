"""Predict iteration time, throughput and memory of a parallel plan on a cluster.

One iteration = the slowest pipeline's 1F1B makespan (every DP replica syncs at the end of the
iteration, so all wait for the slowest), then the DP gradient sync (all device groups at once;
the slowest one's sync counts), then the optimizer step (the slowest device's). Per stage and
micro-batch: compute from a profile or roofline (:mod:`megatron_het.perf.stage_cost`) plus TP
communication (2 all-reduces of the ``[micro_batch, seq, hidden]`` activations per layer forward
and 2 backward within the stage's TP group, 2 more per layer in backward under recompute, one
for the vocab-parallel embedding forward and one for the head's input gradient; counted by
:func:`~megatron_het.perf.cost_model.tp_collectives`). Between stages: the boundary transfers
of :mod:`megatron_het.perf.boundary_cost`.

DP options, named like the runtime's flags (None: the plan's key, else off):
``overlap_grad_reduce`` starts each gradient bucket's reduction in the last backward, so the
iteration pays only ``dp_exposed_s`` of the sync (:mod:`megatron_het.perf.dp_overlap`: the
buckets as the runtime lays them out, each started when its last gradient is in, one after
another; ZeRO-1's parameter all-gather stays after the step unless ``overlap_param_gather``
runs it under the next forward, where it delays that forward only by what its first layers
cannot wait for). They change nothing for
pipelines of different layouts (their replica sums do not overlap in the runtime) nor where
a rate model prices the iteration (its DP sync stays whole). ``grad_reduce_in_bf16`` (bf16
training only) halves the gradient bytes of the DP reduction (:mod:`megatron_het.perf.dp_sync`).

Sequence parallelism (``plan.sequence_parallel``, stages with tp > 1): every all-reduce becomes
a reduce-scatter and an all-gather of the same bytes (each half the ring all-reduce's time),
the norm weights' gradients are all-reduced over TP in backward (2 per layer and the final
norm, ``[hidden]`` float32 each), boundaries move each rank's ``1/tp`` of the positions, and
the activations saved between TP blocks and the roofline work there (the norms and residual
adds) are ``1/tp`` (:mod:`megatron_het.perf.cost_model`). ``scatter_gather_tensors_in_pipeline``
(Megatron-LM 2021's flag, for predicting such runs; our runtime shards boundaries only with
sequence parallelism) moves the boundaries' ``1/tp`` shares alone: the layers run without
sequence parallelism.
``tp_comm_overlap`` (the runtime's ``--tp-comm-overlap``, sequence parallelism only) runs each
layer's all-gathers and reduce-scatters as rings beside the GEMMs they feed or drain
(:mod:`megatron_het.tensor_parallel.comm_overlap`): a layer pays only what its rings' steps
take beyond the GEMM blocks they run beside (:func:`~megatron_het.perf.cost_model.
overlapped_layer_tp`; the GEMMs priced by the roofline at the kind's efficiency), and keeps
the GEMMs' inputs ``1/tp`` too; the embedding's, the head's and the norm weights'
collectives stay whole.

The pipeline time is the event-driven simulation of the 1F1B step lists
(:mod:`megatron_het.perf.simulator`); the closed form and the lower bound are reported beside it
as checks (:mod:`megatron_het.perf.closed_forms`). ``pipeline_model="closed_form"`` skips the
simulation (for fast searches).

Interleaved pipelines (chunks of device groups, :mod:`megatron_het.parallel.plan`): one row
per stage (chunk) with its compute, TP communication and p2p to the next chunk; the per-group
lists are simulated over per-stage times. Memory, ``in_flight``, DP sync and optimizer step
are per device, over all its group's chunks, on each of their rows (:class:`StagePrediction`).

Pipelines of different layouts (heterogeneous data parallelism: other stage counts, layer
splits, TP degrees or interleaving) each get their own rows and times; their DP sync sums
parameter units over every holder, and ZeRO-1 splits each parameter's rows over the pipelines
(:mod:`megatron_het.perf.dp_sync`).

Every rank owns its device unless an optional rate model (:mod:`megatron_het.perf.rate_model`)
says otherwise: ranks that share a host's cores (CPU emulation's
:class:`~megatron_het.emulation.host_model.SharedHostModel`) then have all their pipelines
simulated together on the shared cores, with the model's DP sync, optimizer step and other
per-iteration time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.buckets import DEFAULT_BUCKET_SIZE_MB, bucket_size_mb
from megatron_het.parallel.plan import ParallelPlan, PipelinePlan, StagePlan
from megatron_het.parallel.plan_validation import validate as validate_plan
from megatron_het.parallel.sequence import sequence_sharded
from megatron_het.perf.boundary_cost import BoundaryCost
from megatron_het.perf.calibration import resolve_efficiency
from megatron_het.perf.closed_forms import (
    bubble_fraction,
    closed_form_1f1b,
    closed_form_interleaved,
    group_sums,
    last_backward_ends,
    lower_bound_1f1b,
    lower_bound_interleaved,
)
from megatron_het.perf.comm_cost import CommCost, SyncCost
from megatron_het.perf.cost_model import (
    DTYPE_BYTES,
    FP32_BYTES,
    Efficiency,
    LayerShape,
    TPCollectives,
    dtype_bytes,
    layer_forward_ops,
    op_time,
    overlapped_layer_tp,
    recomputed_count,
    ring_collectives,
    tp_collectives,
)
from megatron_het.perf.dp_overlap import exposed_sync
from megatron_het.perf.dp_sync import DPSync
from megatron_het.perf.memory import (
    MemoryBreakdown,
    device_capacity_bytes,
    device_memory,
    held_activations,
    in_flight_micro_batches,
    stage_parameters,
)
from megatron_het.perf.prediction import PipelinePrediction, Prediction, StagePrediction
from megatron_het.perf.profile import Profile
from megatron_het.perf.rate_model import RateModel, SharedIteration
from megatron_het.perf.simulator import SimulationCache, simulate_pipelines
from megatron_het.perf.stage_cost import (
    LayerBlocks,
    StageCompute,
    choose_profile,
    optimizer_time,
    stage_compute,
)

PIPELINE_MODELS = ("simulate", "closed_form")


def predict(
    model: ModelConfig,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    seq_length: int,
    profiles: Mapping[str, Profile] | None = None,
    dtype: str = "bf16",
    use_distributed_optimizer: bool = False,
    recompute: bool | None = None,
    *,
    efficiency: Efficiency | None = None,
    pipeline_model: str = "simulate",
    cache: SimulationCache | None = None,
    validate: bool = True,
    rate_model: RateModel | None = None,
    overlap_grad_reduce: bool | None = None,
    grad_reduce_in_bf16: bool | None = None,
    pipelines: Sequence[int] | None = None,
    comm: CommCost | None = None,
    overlap_p2p_comm: bool | None = None,
    overlap_param_gather: bool | None = None,
    tp_comm_overlap: bool | None = None,
    ddp_bucket_size: int | None = None,
    scatter_gather_tensors_in_pipeline: bool = False,
    fused_elementwise: bool = True,
) -> Prediction:
    """Estimate one training iteration of ``plan`` (see the module docstring for the model).

    ``dtype`` and ``use_distributed_optimizer`` apply where the plan leaves them unset;
    ``recompute`` None keeps each stage's own setting (``recompute`` and
    ``recompute_num_layers``), True/False recomputes every layer of every stage / none;
    ``overlap_grad_reduce``, ``overlap_param_gather`` (ZeRO-1 only; ignored without it) and
    ``grad_reduce_in_bf16`` None take the plan's keys (off where it has none), True/False
    override them (UserError for a bf16 reduction of non-bf16 training);
    ``tp_comm_overlap`` likewise (off where neither says; it changes only sequence-parallel
    stages with tp > 1); ``overlap_p2p_comm`` likewise, on where neither says (the runtime's
    default: interleaved pipelines overlap their transfers with compute).
    ``ddp_bucket_size`` (``--ddp-bucket-size``: parameters per gradient bucket; None: the
    runtime's default) lays out the buckets whose reductions the DP overlaps start one by one.
    ``fused_elementwise`` False prices the runtime's eager decoder layers on GPU kinds in
    bf16/fp16 (``--compile`` off): their elementwise kernels move
    :data:`~megatron_het.perf.cost_model.EAGER_ELEMENTWISE_TRAFFIC` times the fused minimum
    (:func:`~megatron_het.perf.calibration.layer_efficiency`; True, the default, prices fused
    layers, as the calibration's published runs have them; CPU and emulated kinds are priced
    as before either way); a kind's measured profile gives its entries of that mode, or those
    of the other mode scaled by the roofline's ratio of the modes
    (:func:`~megatron_het.perf.stage_cost.stage_compute`).
    ``scatter_gather_tensors_in_pipeline`` (Megatron-LM 2021's, not a runtime option): the
    boundaries of tp > 1 stages move ``1/tp`` shares as under sequence parallelism, in a plan
    without it (module docstring).
    ``profiles`` maps accelerator kind names to measured profiles (roofline where absent);
    ``efficiency`` None: each kind's calibrated efficiency factors (the cost model's defaults
    for emulated kinds and cpu; :mod:`megatron_het.perf.stage_cost`).
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
    dtype = plan.dtype or dtype
    dtype_bytes(dtype)
    zero1 = (
        plan.use_distributed_optimizer
        if plan.use_distributed_optimizer is not None
        else use_distributed_optimizer
    )
    overlap = _option(overlap_grad_reduce, plan.overlap_grad_reduce)
    gather_overlap = zero1 and _option(overlap_param_gather, plan.overlap_param_gather)
    bf16_reduce = _option(grad_reduce_in_bf16, plan.grad_reduce_in_bf16)
    overlap_p2p = _option(overlap_p2p_comm, plan.overlap_p2p_comm, default=True)
    tp_overlap = _option(tp_comm_overlap, plan.tp_comm_overlap)
    if bf16_reduce and dtype != "bf16":
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
        overlap,
        bf16_reduce,
        cache,
        gather_overlap,
        tp_overlap,
        bucket_size_mb(ddp_bucket_size),
        scatter_gather_tensors_in_pipeline,
        fused_elementwise,
    )
    overlapped = overlap and ctx.sync.uniform and plan.dp_size > 1
    gathered_under_forward = gather_overlap and ctx.sync.uniform and plan.dp_size > 1
    every = pipelines is None
    chosen = range(len(plan.pipelines)) if pipelines is None else sorted(set(pipelines))
    stages, pipelines, ends = [], [], []
    for p in chosen:
        pipeline = plan.pipelines[p]
        rows = ctx.pipeline_rows(p, pipeline, cache)
        stages += rows
        timed, last = _pipeline_time(
            p, pipeline, rows, pipeline_model, cache, overlap_p2p, overlapped
        )
        pipelines.append(timed)
        ends.append(last)
    shared = None
    if rate_model is not None and pipeline_model == "simulate" and every:
        shared = rate_model.shared_iteration(ctx, stages)
    if shared is not None:
        pipelines = _shared_pipelines(plan, stages, pipelines, shared, cache, overlap_p2p)
        return _assemble(
            ctx,
            stages,
            pipelines,
            pipeline_model,
            overlap_p2p,
            shared.optimizer_s,
            shared.overhead_s,
            shared.dp_sync_s,
        )
    exposed = (
        _exposed_sync(
            ctx, pipelines, ends if overlapped else None, stages if gathered_under_forward else None
        )
        if overlapped or gathered_under_forward
        else None
    )
    return _assemble(ctx, stages, pipelines, pipeline_model, overlap_p2p, dp_exposed=exposed)


def _option(argument: bool | None, planned: bool | None, default: bool = False) -> bool:
    """A run option: the argument where given, else the plan's, else ``default``."""
    if argument is not None:
        return argument
    return default if planned is None else planned


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


class PredictionContext:
    """The inputs of one prediction and its per-call memo of stage computes (what a
    :class:`~megatron_het.perf.rate_model.RateModel` reads, as
    :class:`~megatron_het.perf.rate_model.PredictionInputs`). ``efficiency`` None: each kind's
    calibrated figures (:mod:`megatron_het.perf.stage_cost`); the two DP options are resolved
    already (see :func:`predict`)."""

    def __init__(
        self,
        model: ModelConfig,
        plan: ParallelPlan,
        cluster: ClusterSpec,
        seq_length: int,
        profiles: Mapping[str, Profile] | None,
        dtype: str,
        zero1: bool,
        recompute: bool | None,
        efficiency: Efficiency | None,
        comm: CommCost,
        overlap_grad_reduce: bool = False,
        grad_reduce_in_bf16: bool = False,
        cache: SimulationCache | None = None,
        overlap_param_gather: bool = False,
        tp_comm_overlap: bool = False,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        scatter_gather: bool = False,
        fused_elementwise: bool = True,
    ) -> None:
        self.model, self.plan, self.cluster, self.seq = model, plan, cluster, seq_length
        self.tp_comm_overlap = tp_comm_overlap
        self.bucket_size_mb = bucket_size_mb
        self.profiles, self.dtype, self.zero1 = profiles, dtype, zero1
        self.recompute, self.efficiency, self.comm = recompute, efficiency, comm
        self.fused_elementwise = fused_elementwise
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.grad_reduce_in_bf16 = grad_reduce_in_bf16
        self.act_bytes = plan.micro_batch_size * seq_length * model.hidden_size * DTYPE_BYTES[dtype]
        self._computes: dict[tuple, StageCompute] = {}
        self._shared = cache  # stage computes of earlier predictions of a planner's loop
        self._dp: dict[tuple[int, int], tuple[float, str]] = {}
        self._devices: dict[tuple, DeviceFigures] = {}
        self._tp: dict[tuple, tuple[float, float]] = {}
        # Scatter/gather boundaries are priced as sequence-parallel ones (their bytes and
        # messages); nothing else of the plan changes.
        bounded = (
            dataclasses.replace(plan, sequence_parallel=True)
            if scatter_gather and not plan.sequence_parallel
            else plan
        )
        self.boundaries = BoundaryCost(bounded, comm, self.act_bytes, seq_length)
        self.sync = DPSync(model, plan, dtype, zero1, grad_reduce_in_bf16)

    def recomputed_layers_of(self, stage: StagePlan) -> int:
        if self.recompute is None:
            return stage.recomputed_layers
        return stage.num_layers if self.recompute else 0

    def compute(self, stage_index: int, pipeline: PipelinePlan) -> StageCompute:
        stage = pipeline.stages[stage_index]
        spec = self.comm.spec_of(stage.ranks[0])
        recompute = self.recomputed_layers_of(stage)
        blocks = LayerBlocks.of(stage)
        key = (
            spec.name,
            stage.tp,
            stage.num_layers,
            stage.has_embedding,
            stage.has_head,
            recompute,
            blocks,
        )
        if key not in self._computes:
            sharded = sequence_sharded(self.plan, stage)
            shape = LayerShape.of(self.model, self.seq, self.plan.micro_batch_size, stage.tp)
            choice = choose_profile(spec, self.profiles)
            args = (
                self.model,
                spec,
                shape,
                stage.num_layers,
                stage.has_embedding,
                stage.has_head,
                recompute,
                self.dtype,
                choice,
                self.efficiency,
                sharded,
                sharded and self.tp_comm_overlap,
                blocks,
                self.fused_elementwise,
            )
            self._computes[key] = (
                stage_compute(*args) if self._shared is None else self._shared.stage_compute(args)
            )
        return self._computes[key]

    def tp_collectives(self, stage_index: int, pipeline: PipelinePlan) -> TPCollectives:
        """The stage's TP collectives per micro-batch (:func:`tp_collectives`)."""
        stage = pipeline.stages[stage_index]
        return tp_collectives(
            stage.tp,
            stage.num_layers,
            stage.has_embedding,
            stage.has_head,
            self.recomputed_layers_of(stage),
            sequence_sharded(self.plan, stage),
        )

    def tp_comm(self, stage_index: int, pipeline: PipelinePlan) -> tuple[float, float]:
        """(forward, backward) TP collective seconds per micro-batch of one stage (the same
        for every TP group of one node group that lies on one node: memoized)."""
        stage = pipeline.stages[stage_index]
        if stage.tp == 1:
            return 0.0, 0.0
        first, comm = stage.ranks[0], self.comm
        if any(comm.node_of(r) != comm.node_of(first) for r in stage.ranks):
            return self._tp_comm(stage_index, pipeline)
        key = (
            comm.group_of(first),
            stage.tp,
            stage.num_layers,
            stage.has_embedding,
            stage.has_head,
            self.recomputed_layers_of(stage),
            sequence_sharded(self.plan, stage),
        )
        if key not in self._tp:
            self._tp[key] = self._tp_comm(stage_index, pipeline)
        return self._tp[key]

    def _tp_comm(self, stage_index: int, pipeline: PipelinePlan) -> tuple[float, float]:
        stage = pipeline.stages[stage_index]
        # The cross-entropy's small all-reduces are left out: a few numbers per token.
        counts = self.tp_collectives(stage_index, pipeline)
        if not sequence_sharded(self.plan, stage):
            one = self.comm.tp_all_reduce(stage.ranks, self.act_bytes)
            return counts.forward * one, counts.backward * one
        gather = self.comm.tp_gather(stage.ranks, self.act_bytes)
        norm = self.comm.tp_all_reduce(stage.ranks, self.model.hidden_size * FP32_BYTES)
        if not self.tp_comm_overlap:
            return (
                counts.forward_gathers * gather,
                counts.backward_gathers * gather + counts.norm_grads * norm,
            )
        layers = stage.num_layers
        recomputed = recomputed_count(self.recomputed_layers_of(stage), layers)
        fwd, bwd = overlapped_layer_tp(gather, self.layer_gemms(stage), stage.tp)
        # The embedding's and the head's collectives are not overlapped.
        rings_forward, rings_backward = ring_collectives(layers, recomputed)
        ends_forward = counts.forward_gathers - rings_forward
        ends_backward = counts.backward_gathers - rings_backward
        return (
            layers * fwd + ends_forward * gather,
            layers * bwd + recomputed * fwd + ends_backward * gather + counts.norm_grads * norm,
        )

    def layer_gemms(self, stage: StagePlan) -> dict[str, float]:
        """Forward seconds of one layer's qkv, proj, gate_up and down GEMMs on one rank of
        ``stage`` (roofline at the kind's efficiency)."""
        spec = self.comm.spec_of(stage.ranks[0])
        shape = LayerShape.of(self.model, self.seq, self.plan.micro_batch_size, stage.tp)
        efficiency = resolve_efficiency(spec, self.efficiency)
        return {
            op.name: op_time(op, spec, self.dtype, efficiency)
            for op in layer_forward_ops(shape, efficiency.attention_kernel)
            if op.name in ("qkv", "proj", "gate_up", "down")
        }

    def p2p(self, b: int, pipeline: PipelinePlan) -> tuple[float, float]:
        """(forward, backward) seconds over boundary ``b`` (stage b to b + 1) per micro-batch."""
        return self.boundaries.time(pipeline, b)

    def dp_sync(self, pipeline: int, stage_index: int) -> tuple[float, str]:
        """(seconds, algorithm) of the DP sync of the device group running the stage."""
        pp = self.plan.pipelines[0 if self.sync.uniform else pipeline]
        key = (0 if self.sync.uniform else pipeline, stage_index % pp.pp_size)
        if key not in self._dp:
            cost = self.dp_sync_over(self.comm, stage_index, pipeline)
            self._dp[key] = (cost.time_s, cost.algorithm)
        return self._dp[key]

    def dp_sync_over(self, comm: CommCost, stage_index: int, pipeline: int = 0) -> SyncCost:
        """The gradient (and ZeRO-1 parameter) sync of the device group running stage
        ``stage_index`` of pipeline ``pipeline`` (with interleaving, all the group's chunks at
        once), costed by ``comm`` (:class:`~megatron_het.perf.dp_sync.DPSync`)."""
        return self.sync.over(comm, pipeline, stage_index)

    def device(self, p: int, group: int, cache: SimulationCache | None = None) -> DeviceFigures:
        """What one device of ``group`` of pipeline ``p`` holds and steps: all its chunks'
        parameters, its peak memory under the pipeline's 1F1B schedule (interleaved when it has
        several chunks) and its optimizer step (over the state it owns under ZeRO-1)."""
        pipeline = self.plan.pipelines[p]
        chunks = pipeline.group_stages(group)
        stage = pipeline.stages[chunks[0]]
        spec = self.comm.spec_of(stage.ranks[0])
        params = sum(stage_parameters(self.model, pipeline.stages[s]) for s in chunks)
        dp = self.plan.dp_size if self.zero1 else 1
        owned = self.sync.owned_parameters(p, group)
        computes = {s: self.compute(s, pipeline) for s in chunks}
        transient = max(c.transient_bytes for c in computes.values())
        m = pipeline.micro_batches
        if not pipeline.interleaved:
            in_flight = in_flight_micro_batches(pipeline.pp_size, group, m)
            activation = computes[group].activation_bytes * in_flight
        else:
            counts = (cache or SimulationCache()).held_counts(
                pipeline.pp_size, m, pipeline.num_chunks, group
            )
            activation, in_flight = held_activations(counts, lambda s: computes[s].activation_bytes)
        memory = device_memory(
            params,
            self.dtype,
            dp,
            activation,
            transient,
            owned,
            self.sync.buffer_bytes(stage.ranks),
        )
        optimizer = optimizer_time(
            spec,
            params / dp if owned is None else owned,
            self.dtype,
            choose_profile(spec, self.profiles),
            self.efficiency,
        )
        return DeviceFigures(in_flight, memory, optimizer)

    def _device(
        self, signature: object, p: int, group: int, cache: SimulationCache | None
    ) -> DeviceFigures:
        """:meth:`device`, shared by the pipelines of one ``signature`` (with uniform layouts,
        the stages' kinds, TP and layers: such DP replicas hold and step the same)."""
        key = (signature, group)
        if key not in self._devices:
            self._devices[key] = self.device(p, group, cache)
        return self._devices[key]

    def pipeline_rows(
        self, p: int, pipeline: PipelinePlan, cache: SimulationCache | None = None
    ) -> list[StagePrediction]:
        """One row per stage (chunk) of pipeline ``p``: its per-micro-batch times and p2p to
        the next stage, and its device group's figures (see the module docstring)."""
        signature = (
            (
                pipeline.micro_batches,
                tuple(
                    (st.accelerator, st.tp, st.layers, st.recomputed_layers)
                    for st in pipeline.stages
                ),
            )
            if self.sync.uniform
            else p
        )
        devices = [self._device(signature, p, g, cache) for g in range(pipeline.pp_size)]
        rows = []
        for s, stage in enumerate(pipeline.stages):
            spec = self.comm.spec_of(stage.ranks[0])
            compute = self.compute(s, pipeline)
            tp_fwd, tp_bwd = self.tp_comm(s, pipeline)
            last = s == pipeline.num_stages - 1
            p2p_fwd, p2p_bwd = (0.0, 0.0) if last else self.p2p(s, pipeline)
            dp_time, dp_algorithm = self.dp_sync(p, s)
            device = devices[s % pipeline.pp_size]
            rows.append(
                StagePrediction(
                    p,
                    s,
                    spec.label,
                    stage.tp,
                    stage.layers,
                    stage.ranks,
                    compute.forward_s + tp_fwd,
                    compute.backward_s + tp_bwd,
                    tp_fwd + tp_bwd,
                    p2p_fwd,
                    p2p_bwd,
                    dp_time,
                    dp_algorithm,
                    device.optimizer_s,
                    stage_parameters(self.model, stage),
                    device.in_flight,
                    device.memory,
                    device_capacity_bytes(spec),
                    compute.source,
                )
            )
        return rows


@dataclasses.dataclass(frozen=True)
class DeviceFigures:
    """One device of a device group (all its chunks): the most (chunk, micro-batch) pairs it
    holds activations for, its peak memory, its optimizer step."""

    in_flight: int
    memory: MemoryBreakdown
    optimizer_s: float


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
    if v == 1:
        closed = closed_form_1f1b(f, b, m, cf, cb)
        lower = lower_bound_1f1b(f, b, m)
        group_f, group_b = f, b
    else:
        closed = closed_form_interleaved(f, b, m, v, cf, cb, overlap_p2p)
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


__all__ = [
    "DeviceFigures",
    "PIPELINE_MODELS",
    "PipelinePrediction",
    "Prediction",
    "PredictionContext",
    "StagePrediction",
    "predict",
]
