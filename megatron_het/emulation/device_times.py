"""Fixed device times of emulated stages from a host profile (``--emulation-profile``).

With a one-thread profile of the host, an emulated rank's stage forward and backward last
``slowdown x`` the profile's figures for that stage (the predictor's figures, TP communication
excluded) instead of ``slowdown x`` their measured CPU time, so the emulated kind keeps one speed
while the host's own speed drifts. :func:`emulated_device_times` gives every emulated rank's
figures; :func:`fixed_reference_times` turns one rank's into the emulator's fixed reference CPU
times per region key of the pipeline executor. Everything here is emulation.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf.cost.compute_time import (
    HOST_PROFILE,
    LayerBlocks,
    ProfileChoice,
    stage_compute,
)
from megatron_het.perf.cost.roofline import LayerShape
from megatron_het.perf.measure.profile_format import Profile
from megatron_het.pipeline.executor import compute_region_key

RegionKey = tuple[str, bool, int]


def emulated_device_times(
    profiles: Mapping[str, Profile] | None,
    profile_source: str | None,
    model: ModelConfig,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    seq_length: int,
    dtype: str,
    fused_elementwise: bool = False,
) -> dict[int, tuple[tuple[float, float], ...]]:
    """EMULATION: each emulated rank's (forward, backward) seconds per micro-batch of each of
    its stages (one per interleaved chunk, in pipeline order) on this host from the host
    profile ``profiles[HOST_PROFILE]`` (read from ``profile_source``, named in errors); empty
    without a profile (its entries of the run's mode: ``fused_elementwise``, the run's
    ``--compile``). UserError when the cluster has no emulated rank or the profile lacks the
    stage's shape or dtype."""
    if not profiles:
        return {}
    profile = profiles[HOST_PROFILE]
    times: dict[int, tuple[tuple[float, float], ...]] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            spec = cluster.accelerator_of(stage.ranks[0])
            if not spec.emulated:
                continue
            shape = LayerShape.of(model, seq_length, plan.micro_batch_size, stage.tp)
            compute = stage_compute(
                model,
                spec,
                shape,
                stage.num_layers,
                stage.has_embedding,
                stage.has_head,
                stage.recomputed_layers,
                dtype,
                ProfileChoice(profile),
                blocks=LayerBlocks.of(stage),
                fused_elementwise=fused_elementwise,
            )
            if "roofline" in compute.source:
                raise UserError(
                    f"--emulation-profile {profile_source}: no {dtype} figures for "
                    f"the stage on ranks {list(stage.ranks)} ({compute.source}); "
                    f"profile this model's shape with tools/profile_device.py "
                    f"--threads 1 --dtype {dtype} --seq-lengths {seq_length} "
                    f"--micro-batch-sizes {plan.micro_batch_size} --tp {stage.tp} (a plan "
                    "chosen by --plan auto may use any TP degree and micro-batch size the "
                    "profile does not hold: profile those it may pick)"
                )
            for rank in stage.ranks:
                times[rank] = times.get(rank, ()) + ((compute.forward_s, compute.backward_s),)
    if not times:
        raise UserError(
            f"--emulation-profile times emulated accelerator kinds, and cluster "
            f"{cluster.name} has none; drop the flag"
        )
    return times


def fixed_reference_times(
    times: tuple[tuple[float, float], ...] | None,
) -> dict[Hashable, float] | None:
    """The emulator's fixed reference CPU times of a rank's stage regions from its (forward,
    backward) seconds per chunk (None: measured): training forward and backward, and
    evaluation forward (the same work as the training forward), of each chunk, by
    :data:`RegionKey` (typed as the emulator's keys, any hashable)."""
    if times is None:
        return None
    keys: dict[Hashable, float] = {}
    for chunk, (forward, backward) in enumerate(times):
        keys[compute_region_key("forward", False, chunk)] = forward
        keys[compute_region_key("forward", True, chunk)] = forward
        keys[compute_region_key("backward", False, chunk)] = backward
    return keys


def describe_device_times(
    times: Mapping[int, tuple[tuple[float, float], ...]],
    cluster: ClusterSpec,
    profile_source: str | None,
) -> str:
    """One line: the profile that times the emulated ranks, and each rank's figures."""
    ranks = "; ".join(
        f"rank {rank} {cluster.accelerator_of(rank).slowdown:g} x "
        + " + ".join(f"({fwd * 1e3:.1f} + {bwd * 1e3:.1f})" for fwd, bwd in chunks)
        + " ms"
        for rank, chunks in sorted(times.items())
    )
    return (
        f"> EMULATION: stage compute of emulated ranks timed from profile "
        f"{profile_source} (slowdown x forward + backward per micro-batch): {ranks}"
    )


__all__ = ["describe_device_times", "emulated_device_times", "fixed_reference_times"]
