"""Predict iteration time, throughput and memory of a parallel plan on a cluster.

One iteration = the slowest pipeline's 1F1B makespan (every DP replica syncs at the end of the
iteration, so all wait for the slowest), then the DP gradient sync (all stages at once; the
slowest stage's sync counts), then the optimizer step (the slowest device's). Per stage and
micro-batch: compute from a profile or roofline (:mod:`megatron_het.perf.stage_cost`) plus TP
communication (2 all-reduces of the ``[micro_batch, seq, hidden]`` activations per layer forward
and 2 backward within the stage's TP group, 2 more per layer in backward under recompute, one
for the vocab-parallel embedding forward and one for the head's input gradient). Between stages,
without sequence parallelism every TP rank holds the whole activation: with equal TP degrees each
rank sends it to its peer (concurrent streams share a NIC); with different degrees one rank
sends and the receiving stage broadcasts it within its TP group.

The pipeline time is the event-driven simulation of the 1F1B step lists
(:mod:`megatron_het.perf.simulator`); the closed form and the lower bound are reported beside it
as checks. ``pipeline_model="closed_form"`` skips the simulation (for fast searches).

Ranks that share a host CPU (every rank of a CPU-emulated kind, with host-sharing figures in the
host profile): the pipelines are simulated together on the shared cores, the DP sync and the
optimizer step (at host speed) share them too, and the driver's per-iteration world collectives
are added (:mod:`megatron_het.perf.shared_host`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan, PipelinePlan
from megatron_het.perf.comm_cost import CommCost, broadcast_time, p2p_time
from megatron_het.perf.cost_model import (DEFAULT_EFFICIENCY, DTYPE_BYTES, FP32_BYTES,
                                          Efficiency, LayerShape, dtype_bytes)
from megatron_het.perf.memory import (MemoryBreakdown, device_capacity_bytes,
                                      in_flight_micro_batches, stage_memory, stage_parameters)
from megatron_het.perf.profile import Profile
from megatron_het.perf.shared_host import shared_host_times
from megatron_het.perf.simulator import (SimulationCache, bubble_fraction, closed_form_1f1b,
                                         lower_bound_1f1b)
from megatron_het.perf.stage_cost import (StageCompute, choose_profile, optimizer_time,
                                          stage_compute)

PIPELINE_MODELS = ("simulate", "closed_form")


@dataclass(frozen=True)
class StagePrediction:
    """One stage of one pipeline; times per micro-batch unless named otherwise.

    ``forward_s`` / ``backward_s`` include TP communication (``tp_comm_s`` is its forward +
    backward share) and recompute; ``p2p_*_s`` is the boundary to the next stage (0 on the
    last); ``dp_sync_s`` and ``optimizer_s`` are per iteration; ``memory`` is one device's.
    """

    pipeline: int
    stage: int
    accelerator: str
    tp: int
    layers: tuple[int, int]
    ranks: tuple[int, ...]
    forward_s: float
    backward_s: float
    tp_comm_s: float
    p2p_forward_s: float
    p2p_backward_s: float
    dp_sync_s: float
    dp_algorithm: str
    optimizer_s: float
    parameters: int
    in_flight: int
    memory: MemoryBreakdown
    capacity_bytes: float
    source: str

    @property
    def headroom_bytes(self) -> float:
        return self.capacity_bytes - self.memory.total_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"], d["ranks"] = list(self.layers), list(self.ranks)
        d["memory"] = self.memory.to_dict()
        return d


@dataclass(frozen=True)
class PipelinePrediction:
    """One DP replica: its 1F1B time (simulated or closed form) and the analytic checks."""

    pipeline: int
    micro_batches: int
    time_s: float
    closed_form_s: float
    lower_bound_s: float
    bubble_fraction: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Prediction:
    """Everything :func:`predict` estimates for one iteration; ``stages`` is the per-stage table."""

    model: str
    seq_length: int
    dtype: str
    use_distributed_optimizer: bool
    micro_batch_size: int
    global_batch_size: int
    pipeline_model: str
    stages: tuple[StagePrediction, ...]
    pipelines: tuple[PipelinePrediction, ...]
    pipeline_time_s: float
    dp_sync_s: float
    optimizer_s: float
    iteration_time_s: float
    tokens_per_s: float
    model_flops_per_iteration: float
    num_devices: int
    peak_flops_sum: float
    bubble_fraction: float
    overhead_s: float = 0.0  # per-iteration work outside pipeline, sync and step (shared host)

    @property
    def achieved_tflops_per_device(self) -> float:
        """Model FLOP/s per device in use, in TFLOP/s."""
        return self.model_flops_per_iteration / self.iteration_time_s / self.num_devices / 1e12

    @property
    def mfu(self) -> float:
        """Heterogeneity-aware MFU: model FLOP/s over the sum of the devices' peak FLOP/s."""
        return self.model_flops_per_iteration / self.iteration_time_s / self.peak_flops_sum

    @property
    def peak_memory_bytes(self) -> float:
        return max(s.memory.total_bytes for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: scalars, the derived figures and the per-stage and per-pipeline tables."""
        d = {k: v for k, v in asdict(self).items() if k not in ("stages", "pipelines")}
        d.update(achieved_tflops_per_device=self.achieved_tflops_per_device, mfu=self.mfu,
                 peak_memory_bytes=self.peak_memory_bytes,
                 stages=[s.to_dict() for s in self.stages],
                 pipelines=[p.to_dict() for p in self.pipelines])
        return d

    def table(self) -> str:
        """The per-stage table as text, one row per stage of every pipeline."""
        rows = [("pipe", "stage", "accelerator", "tp", "layers", "fwd ms", "bwd ms", "tp ms",
                 "p2p ms", "dp ms", "opt ms", "mem GiB", "cap GiB")]
        for s in self.stages:
            rows.append((str(s.pipeline), str(s.stage), s.accelerator, str(s.tp),
                         f"{s.layers[0]}-{s.layers[1]}", *(f"{1e3 * v:.2f}" for v in (
                             s.forward_s, s.backward_s, s.tp_comm_s, s.p2p_forward_s,
                             s.dp_sync_s, s.optimizer_s)),
                         f"{s.memory.total_bytes / 2**30:.1f}", f"{s.capacity_bytes / 2**30:.0f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        lines.append(f"iteration {self.iteration_time_s:.3f} s = pipeline "
                     f"{self.pipeline_time_s:.3f} + dp sync {self.dp_sync_s:.3f} + optimizer "
                     f"{self.optimizer_s:.3f} + other {self.overhead_s:.3f}; "
                     f"{self.tokens_per_s:,.0f} tokens/s, "
                     f"{self.achieved_tflops_per_device:.1f} TFLOP/s per device, MFU "
                     f"{100 * self.mfu:.1f}%, bubble {100 * self.bubble_fraction:.1f}%")
        return "\n".join(lines)


def predict(model: ModelConfig, plan: ParallelPlan, cluster: ClusterSpec, seq_length: int,
            profiles: Optional[Mapping[str, Profile]] = None, dtype: str = "bf16",
            use_distributed_optimizer: bool = False, recompute: Optional[bool] = None, *,
            efficiency: Efficiency = DEFAULT_EFFICIENCY, pipeline_model: str = "simulate",
            cache: Optional[SimulationCache] = None, validate: bool = True) -> Prediction:
    """Estimate one training iteration of ``plan`` (see the module docstring for the model).

    ``dtype`` and ``use_distributed_optimizer`` apply where the plan leaves them unset;
    ``recompute`` None keeps each stage's own flag, True/False overrides every stage.
    ``profiles`` maps accelerator kind names to measured profiles (roofline where absent).
    ``cache`` reuses built schedules across calls (a planner's loop); ``validate=False`` skips
    the plan check for plans known to be valid. Pure: no processes, no I/O.
    """
    if seq_length < 1:
        raise UserError(f"seq_length must be at least 1, got {seq_length}")
    if pipeline_model not in PIPELINE_MODELS:
        raise UserError(f"pipeline_model must be one of {', '.join(PIPELINE_MODELS)}")
    dtype = plan.dtype or dtype
    dtype_bytes(dtype)
    zero1 = (plan.use_distributed_optimizer if plan.use_distributed_optimizer is not None
             else use_distributed_optimizer)
    if validate:
        plan.validate(model, cluster)
    ctx = _Context(model, plan, cluster, seq_length, profiles, dtype, zero1, recompute,
                   efficiency, CommCost(cluster, profiles))
    cache = cache or SimulationCache()
    stages, pipelines = [], []
    for p, pipeline in enumerate(plan.pipelines):
        rows = ctx.pipeline_rows(p, pipeline)
        stages += rows
        pipelines.append(_pipeline_time(p, pipeline.micro_batches, rows, pipeline_model, cache))
    shared = shared_host_times(ctx, stages) if pipeline_model == "simulate" else None
    if shared is not None:
        pipelines = [dataclasses.replace(pp, time_s=t, bubble_fraction=bubble_fraction(
            t, [r.forward_s for r in stages if r.pipeline == pp.pipeline],
            [r.backward_s for r in stages if r.pipeline == pp.pipeline], pp.micro_batches))
            for pp, t in zip(pipelines, shared.pipelines_s)]
        return _assemble(ctx, stages, pipelines, pipeline_model, shared.optimizer_s,
                         shared.overhead_s, shared.dp_sync_s)
    return _assemble(ctx, stages, pipelines, pipeline_model)


class _Context:
    """The inputs of one prediction and its per-call memo of stage computes."""

    def __init__(self, model: ModelConfig, plan: ParallelPlan, cluster: ClusterSpec,
                 seq_length: int, profiles: Optional[Mapping[str, Profile]], dtype: str,
                 zero1: bool, recompute: Optional[bool], efficiency: Efficiency,
                 comm: CommCost) -> None:
        self.model, self.plan, self.cluster, self.seq = model, plan, cluster, seq_length
        self.profiles, self.dtype, self.zero1 = profiles, dtype, zero1
        self.recompute, self.efficiency, self.comm = recompute, efficiency, comm
        self.act_bytes = plan.micro_batch_size * seq_length * model.hidden_size * DTYPE_BYTES[
            dtype]
        self._computes: dict[tuple, StageCompute] = {}
        self._dp: dict[int, tuple[float, str]] = {}
        self._senders = self._boundary_senders()

    def _boundary_senders(self) -> list[dict[int, int]]:
        """Per boundary: cross-node streams leaving each node (all pipelines at once)."""
        first = self.plan.pipelines[0]
        out: list[dict[int, int]] = []
        for b in range(first.pp_size - 1):
            counts: dict[int, int] = {}
            for pipeline in self.plan.pipelines:
                src, dst = pipeline.stages[b], pipeline.stages[b + 1]
                streams = src.tp if src.tp == dst.tp else 1
                node = self.comm.node_of(src.ranks[-1])
                if node != self.comm.node_of(dst.ranks[0]):
                    counts[node] = counts.get(node, 0) + streams
            out.append(counts)
        return out

    def compute(self, stage_index: int, pipeline: PipelinePlan) -> StageCompute:
        stage = pipeline.stages[stage_index]
        spec = self.comm.spec_of(stage.ranks[0])
        recompute = stage.recompute if self.recompute is None else self.recompute
        key = (spec.name, stage.tp, stage.num_layers, stage.has_embedding, stage.has_head,
               recompute)
        if key not in self._computes:
            shape = LayerShape.of(self.model, self.seq, self.plan.micro_batch_size, stage.tp)
            self._computes[key] = stage_compute(
                self.model, spec, shape, stage.num_layers, stage.has_embedding, stage.has_head,
                recompute, self.dtype, choose_profile(spec, self.profiles), self.efficiency)
        return self._computes[key]

    def tp_comm(self, stage_index: int, pipeline: PipelinePlan) -> tuple[float, float]:
        """(forward, backward) TP all-reduce seconds per micro-batch of one stage."""
        stage = pipeline.stages[stage_index]
        if stage.tp == 1:
            return 0.0, 0.0
        recompute = stage.recompute if self.recompute is None else self.recompute
        one = self.comm.tp_all_reduce(stage.ranks, self.act_bytes)
        forward = 2 * stage.num_layers + (1 if stage.has_embedding else 0)
        backward = 2 * stage.num_layers * (2 if recompute else 1) + (1 if stage.has_head else 0)
        return forward * one, backward * one

    def p2p(self, b: int, pipeline: PipelinePlan) -> tuple[float, float]:
        """(forward, backward) seconds over boundary ``b`` (stage b to b + 1) per micro-batch."""
        src, dst = pipeline.stages[b], pipeline.stages[b + 1]
        share = self._senders[b].get(self.comm.node_of(src.ranks[-1]), 1)
        path = self.comm.path(src.ranks[-1], dst.ranks[0], "p2p", share)
        one = p2p_time(self.act_bytes, path)
        if src.tp == dst.tp:
            return one, one
        forward = one + self._broadcast(dst.ranks)
        backward = one + self._broadcast(src.ranks)
        return forward, backward

    def _broadcast(self, ranks: tuple[int, ...]) -> float:
        if len(ranks) <= 1:
            return 0.0
        return broadcast_time(self.act_bytes, len(ranks), self.comm.ring_path(ranks))

    def dp_sync(self, stage_index: int) -> tuple[float, str]:
        if stage_index not in self._dp:
            group = [p.stages[stage_index].ranks[0] for p in self.plan.pipelines]
            params = stage_parameters(self.model, self.plan.pipelines[0].stages[stage_index])
            param_bytes = params * DTYPE_BYTES[self.dtype] if self.zero1 else None
            cost = self.comm.dp_sync(group, params * FP32_BYTES, param_bytes)
            self._dp[stage_index] = (cost.time_s, cost.algorithm)
        return self._dp[stage_index]

    def pipeline_rows(self, p: int, pipeline: PipelinePlan) -> list[StagePrediction]:
        rows = []
        for s, stage in enumerate(pipeline.stages):
            spec = self.comm.spec_of(stage.ranks[0])
            compute = self.compute(s, pipeline)
            tp_fwd, tp_bwd = self.tp_comm(s, pipeline)
            p2p_fwd, p2p_bwd = self.p2p(s, pipeline) if s < pipeline.pp_size - 1 else (0.0, 0.0)
            dp_time, dp_algorithm = self.dp_sync(s)
            params = stage_parameters(self.model, stage)
            dp = self.plan.dp_size if self.zero1 else 1
            in_flight = in_flight_micro_batches(pipeline.pp_size, s, pipeline.micro_batches)
            memory = stage_memory(params, self.dtype, dp, compute.activation_bytes, in_flight,
                                  compute.transient_bytes)
            choice = choose_profile(spec, self.profiles)
            rows.append(StagePrediction(
                p, s, spec.label, stage.tp, stage.layers, stage.ranks,
                compute.forward_s + tp_fwd, compute.backward_s + tp_bwd, tp_fwd + tp_bwd,
                p2p_fwd, p2p_bwd, dp_time, dp_algorithm,
                optimizer_time(spec, params / dp, self.dtype, choice, self.efficiency),
                params, in_flight, memory, device_capacity_bytes(spec), compute.source))
        return rows


def _pipeline_time(p: int, micro_batches: int, rows: list[StagePrediction], pipeline_model: str,
                   cache: SimulationCache) -> PipelinePrediction:
    f = [r.forward_s for r in rows]
    b = [r.backward_s for r in rows]
    cf = [r.p2p_forward_s for r in rows[:-1]]
    cb = [r.p2p_backward_s for r in rows[:-1]]
    closed = closed_form_1f1b(f, b, micro_batches, cf, cb)
    time = closed if pipeline_model == "closed_form" else cache.makespan(f, b, micro_batches,
                                                                         cf, cb)
    return PipelinePrediction(p, micro_batches, time, closed, lower_bound_1f1b(f, b,
                              micro_batches), bubble_fraction(time, f, b, micro_batches))


def _assemble(ctx: _Context, stages: list[StagePrediction],
              pipelines: list[PipelinePrediction], pipeline_model: str,
              optimizer: Optional[float] = None, overhead: float = 0.0,
              dp_sync: Optional[float] = None) -> Prediction:
    plan, model = ctx.plan, ctx.model
    slowest = max(pipelines, key=lambda pp: pp.time_s)
    if dp_sync is None:
        dp_sync = max(s.dp_sync_s for s in stages)
    if optimizer is None:
        optimizer = max(s.optimizer_s for s in stages)
    iteration = slowest.time_s + dp_sync + optimizer + overhead
    tokens = plan.global_batch_size * ctx.seq
    flops = model.flops_per_token(ctx.seq) * tokens
    ranks = plan.ranks()
    peak_of: dict[str, float] = {}  # peak FLOP/s per kind, looked up once
    peak = 0.0
    for r in ranks:
        kind = ctx.comm.kind_of(r)
        if kind not in peak_of:
            peak_of[kind] = ctx.comm.spec_of(r).peak_tflops(ctx.dtype) * 1e12
        peak += peak_of[kind]
    return Prediction(
        model=model.name, seq_length=ctx.seq, dtype=ctx.dtype,
        use_distributed_optimizer=ctx.zero1, micro_batch_size=plan.micro_batch_size,
        global_batch_size=plan.global_batch_size, pipeline_model=pipeline_model,
        stages=tuple(stages), pipelines=tuple(pipelines), pipeline_time_s=slowest.time_s,
        dp_sync_s=dp_sync, optimizer_s=optimizer, iteration_time_s=iteration,
        tokens_per_s=tokens / iteration, model_flops_per_iteration=flops,
        num_devices=len(ranks), peak_flops_sum=peak, bubble_fraction=slowest.bubble_fraction,
        overhead_s=overhead)


__all__ = ["PIPELINE_MODELS", "PipelinePrediction", "Prediction",
           "StagePrediction", "predict"]
