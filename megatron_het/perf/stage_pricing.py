"""The per-stage rows of one prediction: what each stage of each pipeline costs per
micro-batch, and what each device holds and steps per iteration.

Per stage and micro-batch: compute from a profile or roofline
(:mod:`megatron_het.perf.cost.compute_time`) plus TP communication (2 all-reduces of the
``[micro_batch, seq, hidden]`` activations per layer forward and 2 backward within the stage's
TP group, 2 more per layer in backward under recompute, one for the vocab-parallel embedding
forward and one for the head's input gradient; counted by
:func:`~megatron_het.perf.cost.tp_collectives.tp_collectives`). Between stages: the boundary
transfers of :mod:`megatron_het.perf.cost.boundary_time`. Per device: its DP sync
(:mod:`megatron_het.perf.cost.dp_sync`), its peak memory (:mod:`megatron_het.perf.cost.memory`)
and its optimizer step.

Sequence parallelism (``plan.sequence_parallel``, stages with tp > 1): every all-reduce becomes
a reduce-scatter and an all-gather of the same bytes (each half the ring all-reduce's time),
the norm weights' gradients are all-reduced over TP in backward (2 per layer and the final
norm, ``[hidden]`` float32 each), boundaries move each rank's ``1/tp`` of the positions, and
the activations saved between TP blocks and the roofline work there (the norms and residual
adds) are ``1/tp`` (:mod:`megatron_het.perf.cost.roofline`). ``scatter_gather`` (Megatron-LM
2021's ``scatter_gather_tensors_in_pipeline``, for predicting such runs; our runtime shards
boundaries only with sequence parallelism) moves the boundaries' ``1/tp`` shares alone: the
layers run without sequence parallelism.
``tp_comm_overlap`` (the runtime's ``--tp-comm-overlap``, sequence parallelism only) runs each
layer's all-gathers and reduce-scatters as rings beside the GEMMs they feed or drain
(:mod:`megatron_het.tensor_parallel.comm_overlap`): a layer pays only what its rings' steps
take beyond the GEMM blocks they run beside
(:func:`~megatron_het.perf.cost.tp_collectives.overlapped_layer_tp`; the GEMMs priced by the
roofline at the kind's efficiency), and keeps the GEMMs' inputs ``1/tp`` too; the
embedding's, the head's and the norm weights' collectives stay whole.

Interleaved pipelines (chunks of device groups, :mod:`megatron_het.parallel.plan`): one row
per stage (chunk) with its compute, TP communication and p2p to the next chunk. Memory,
``in_flight``, DP sync and optimizer step are per device, over all its group's chunks, on each
of their rows (:class:`~megatron_het.perf.estimates.StagePrediction`). Pipelines of different
layouts (heterogeneous data parallelism: other stage counts, layer splits, TP degrees or
interleaving) each get their own rows; their DP sync sums parameter units over every holder,
and ZeRO-1 splits each parameter's rows over the pipelines (:mod:`megatron_het.perf.cost.dp_sync`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.parallel.buckets import DEFAULT_BUCKET_SIZE_MB
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.sequence import sequence_sharded
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.perf.cost.boundary_time import BoundaryCost
from megatron_het.perf.cost.calibration import resolve_efficiency
from megatron_het.perf.cost.comm_time import CommCost, SyncCost
from megatron_het.perf.cost.compute_time import (
    LayerBlocks,
    StageCompute,
    choose_profile,
    optimizer_time,
    stage_compute,
)
from megatron_het.perf.cost.dp_sync import DPSync
from megatron_het.perf.cost.memory import (
    MemoryBreakdown,
    device_capacity_bytes,
    device_memory,
    held_activations,
    in_flight_micro_batches,
    stage_parameters,
)
from megatron_het.perf.cost.roofline import (
    DTYPE_BYTES,
    FP32_BYTES,
    Efficiency,
    LayerShape,
    layer_forward_ops,
    op_time,
)
from megatron_het.perf.cost.tp_collectives import (
    TPCollectives,
    overlapped_layer_tp,
    recomputed_count,
    ring_collectives,
    tp_collectives,
)
from megatron_het.perf.estimates import StagePrediction
from megatron_het.perf.measure.profile_format import Profile
from megatron_het.perf.schedule.simulation_cache import SimulationCache


class PredictionContext:
    """The inputs of one prediction and its per-call memo of stage computes (what a
    :class:`~megatron_het.perf.cost.rate_model.RateModel` reads, as
    :class:`~megatron_het.perf.cost.rate_model.PredictionInputs`). ``efficiency`` None: each
    kind's calibrated figures (:mod:`megatron_het.perf.cost.compute_time`); the DP options are
    resolved already (see :func:`~megatron_het.perf.predictor.predict`)."""

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
        self.act_bytes: float = (
            plan.micro_batch_size * seq_length * model.hidden_size * DTYPE_BYTES[dtype]
        )
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

    def recomputed_layers_of(self, stage: StagePlan) -> float:
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
        once), costed by ``comm`` (:class:`~megatron_het.perf.cost.dp_sync.DPSync`)."""
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


__all__ = ["DeviceFigures", "PredictionContext"]
