"""Predict iteration time, throughput and memory of a parallel plan on a cluster.

One iteration = the slowest pipeline's 1F1B makespan (every DP replica syncs at the end of the
iteration, so all wait for the slowest), then the DP gradient sync (all stages at once; the
slowest stage's sync counts), then the optimizer step (the slowest device's). Per stage and
micro-batch: compute from a profile or roofline (:mod:`megatron_het.perf.stage_cost`) plus TP
communication (2 all-reduces of the ``[micro_batch, seq, hidden]`` activations per layer forward
and 2 backward within the stage's TP group, 2 more per layer in backward under recompute, one
for the vocab-parallel embedding forward and one for the head's input gradient; counted by
:func:`~megatron_het.perf.cost_model.tp_collectives`). Between stages,
without sequence parallelism every TP rank holds the whole activation: with equal TP degrees each
rank sends it to its peer (concurrent streams share a NIC); with different degrees one rank
sends and the receiving stage broadcasts it within its TP group.

The pipeline time is the event-driven simulation of the 1F1B step lists
(:mod:`megatron_het.perf.simulator`); the closed form and the lower bound are reported beside it
as checks. ``pipeline_model="closed_form"`` skips the simulation (for fast searches).

Every rank owns its device unless an optional rate model (:mod:`megatron_het.perf.rate_model`)
says otherwise: ranks that share a host's cores (CPU emulation's
:class:`~megatron_het.emulation.host_model.SharedHostModel`) then have all their pipelines
simulated together on the shared cores, with the model's DP sync, optimizer step and other
per-iteration time.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan, PipelinePlan, StagePlan
from megatron_het.parallel.plan_validation import validate as validate_plan
from megatron_het.perf.comm_cost import CommCost, SyncCost, broadcast_time, p2p_time
from megatron_het.perf.cost_model import (DEFAULT_EFFICIENCY, DTYPE_BYTES, FP32_BYTES,
                                          Efficiency, LayerShape, dtype_bytes, tp_collectives)
from megatron_het.perf.memory import (device_capacity_bytes, in_flight_micro_batches,
                                      stage_memory, stage_parameters)
from megatron_het.perf.prediction import PipelinePrediction, Prediction, StagePrediction
from megatron_het.perf.profile import Profile
from megatron_het.perf.rate_model import RateModel, SharedIteration
from megatron_het.perf.simulator import (SimulationCache, bubble_fraction, closed_form_1f1b,
                                         lower_bound_1f1b, simulate_pipelines)
from megatron_het.perf.stage_cost import (StageCompute, choose_profile, optimizer_time,
                                          stage_compute)

PIPELINE_MODELS = ("simulate", "closed_form")


def predict(model: ModelConfig, plan: ParallelPlan, cluster: ClusterSpec, seq_length: int,
            profiles: Optional[Mapping[str, Profile]] = None, dtype: str = "bf16",
            use_distributed_optimizer: bool = False, recompute: Optional[bool] = None, *,
            efficiency: Efficiency = DEFAULT_EFFICIENCY, pipeline_model: str = "simulate",
            cache: Optional[SimulationCache] = None, validate: bool = True,
            rate_model: Optional[RateModel] = None) -> Prediction:
    """Estimate one training iteration of ``plan`` (see the module docstring for the model).

    ``dtype`` and ``use_distributed_optimizer`` apply where the plan leaves them unset;
    ``recompute`` None keeps each stage's own flag, True/False overrides every stage.
    ``profiles`` maps accelerator kind names to measured profiles (roofline where absent).
    ``cache`` reuses built schedules across calls (a planner's loop); ``validate=False`` skips
    the plan check for plans known to be valid. ``rate_model`` (with ``pipeline_model``
    "simulate") models ranks that share their compute where it applies. Pure: no processes,
    no I/O.
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
        validate_plan(plan, model, cluster)
    ctx = PredictionContext(model, plan, cluster, seq_length, profiles, dtype, zero1, recompute,
                            efficiency, CommCost(cluster, profiles))
    cache = cache or SimulationCache()
    stages, pipelines = [], []
    for p, pipeline in enumerate(plan.pipelines):
        rows = ctx.pipeline_rows(p, pipeline)
        stages += rows
        pipelines.append(_pipeline_time(p, pipeline.micro_batches, rows, pipeline_model, cache))
    shared = None
    if rate_model is not None and pipeline_model == "simulate":
        shared = rate_model.shared_iteration(ctx, stages)
    if shared is not None:
        pipelines = _shared_pipelines(plan, stages, pipelines, shared, cache)
        return _assemble(ctx, stages, pipelines, pipeline_model, shared.optimizer_s,
                         shared.overhead_s, shared.dp_sync_s)
    return _assemble(ctx, stages, pipelines, pipeline_model)


def _shared_pipelines(plan: ParallelPlan, rows: list[StagePrediction],
                      pipelines: list[PipelinePrediction], shared: SharedIteration,
                      cache: SimulationCache) -> list[PipelinePrediction]:
    """Every pipeline's time when all run at once on the rate model's shared cores."""
    schedules = [cache.schedule(pp.pp_size, pp.micro_batches) for pp in plan.pipelines]
    result = simulate_pipelines(schedules, shared.stages, shared.sharing)
    return [dataclasses.replace(pp, time_s=t, bubble_fraction=bubble_fraction(
        t, [r.forward_s for r in rows if r.pipeline == pp.pipeline],
        [r.backward_s for r in rows if r.pipeline == pp.pipeline], pp.micro_batches))
        for pp, t in zip(pipelines, result.makespans_s)]


class PredictionContext:
    """The inputs of one prediction and its per-call memo of stage computes (what a
    :class:`~megatron_het.perf.rate_model.RateModel` reads, as
    :class:`~megatron_het.perf.rate_model.PredictionInputs`)."""

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

    def recompute_of(self, stage: StagePlan) -> bool:
        return stage.recompute if self.recompute is None else self.recompute

    def compute(self, stage_index: int, pipeline: PipelinePlan) -> StageCompute:
        stage = pipeline.stages[stage_index]
        spec = self.comm.spec_of(stage.ranks[0])
        recompute = self.recompute_of(stage)
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
        # The cross-entropy's small all-reduces are left out: a few numbers per token.
        counts = tp_collectives(stage.tp, stage.num_layers, stage.has_embedding,
                                stage.has_head, self.recompute_of(stage))
        one = self.comm.tp_all_reduce(stage.ranks, self.act_bytes)
        return counts.forward * one, counts.backward * one

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
            cost = self.dp_sync_over(self.comm, stage_index)
            self._dp[stage_index] = (cost.time_s, cost.algorithm)
        return self._dp[stage_index]

    def dp_sync_over(self, comm: CommCost, stage_index: int) -> SyncCost:
        """The gradient (and ZeRO-1 parameter) sync of stage ``stage_index`` costed by
        ``comm``."""
        group = [p.stages[stage_index].ranks[0] for p in self.plan.pipelines]
        params = stage_parameters(self.model, self.plan.pipelines[0].stages[stage_index])
        param_bytes = params * DTYPE_BYTES[self.dtype] if self.zero1 else None
        return comm.dp_sync(group, params * FP32_BYTES, param_bytes)

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


def _assemble(ctx: PredictionContext, stages: list[StagePrediction],
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


__all__ = ["PIPELINE_MODELS", "PipelinePrediction", "Prediction", "PredictionContext",
           "StagePrediction", "predict"]
