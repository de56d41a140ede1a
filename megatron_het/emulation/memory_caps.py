"""The memory cap of emulated kinds, checked before a run: does every emulated stage fit?

An emulated kind may declare ``memory_cap_gib``: the memory one of its devices would hold. A
CPU rank has the host's memory, so nothing would stop a plan that the emulated device could not
hold; :func:`check_memory_caps` refuses it up front with the project's memory model (the
predictor's per-stage peak, :mod:`megatron_het.perf.cost.memory`: weights, fp32 gradients, optimizer
state, activations of the micro-batches in flight). Kinds without a cap, and real kinds, are
not checked here (the planner and :func:`megatron_het.perf.fits` judge real devices).
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf.cost.memory import GIB
from megatron_het.perf.measure.profile_format import Profile
from megatron_het.perf.predictor import predict


def check_memory_caps(
    model_config: ModelConfig,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    seq_length: int,
    options: RunOptions,
    profiles: Mapping[str, Profile] | None = None,
) -> None:
    """Raise a one-line UserError naming the first stage (pipeline, stage, kind, ranks) of an
    emulated kind with a memory cap whose predicted peak per device exceeds that cap.

    ``plan`` must be valid for ``model_config`` and ``cluster``; ``options`` are the run's (its
    precision, ZeRO-1, its layers' mode: ``fused_elementwise`` is ``--compile``), as
    :func:`~megatron_het.perf.predict` takes them; ``profiles`` (e.g. the host profile) give
    measured activation sizes where they have them (the analytic model otherwise)."""
    capped = [
        s
        for pipeline in plan.pipelines
        for s in pipeline.stages
        if _cap_gib(cluster, s.ranks[0]) is not None
    ]
    if not capped:
        return
    prediction = predict(
        model_config,
        plan,
        cluster,
        seq_length,
        profiles,
        options,
        pipeline_model="closed_form",
        validate=False,
    )
    for row in prediction.stages:
        cap = _cap_gib(cluster, row.ranks[0])
        need = row.memory.total_bytes / GIB
        if cap is None or need <= cap:
            continue
        spec = cluster.accelerator_of(row.ranks[0])
        raise UserError(
            f"pipeline {row.pipeline} stage {row.stage} ({spec.label}, tp={row.tp}, ranks "
            f"{list(row.ranks)}) needs {need:.3g} GiB per device but the emulated memory cap "
            f"of {spec.name} is {cap:g} GiB; give it fewer layers, a larger tp, recompute or "
            f"the distributed optimizer, or raise memory_cap_gib"
        )


def _cap_gib(cluster: ClusterSpec, rank: int) -> float | None:
    spec = cluster.accelerator_of(rank)
    return spec.memory_cap_gib if spec.emulated else None


__all__ = ["check_memory_caps"]
