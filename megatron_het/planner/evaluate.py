"""What-if: predict a given plan as the planner would report it, without searching."""

from __future__ import annotations

import time
from collections.abc import Mapping

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_validation import validate
from megatron_het.perf import Profile, predict
from megatron_het.planner.baseline import homogeneous_baseline
from megatron_het.planner.result import SearchResult


def evaluate_plan(
    model: ModelConfig,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    seq_length: int,
    profiles: Mapping[str, Profile] | None = None,
    options: RunOptions | None = None,
    global_batch_size: int | None = None,
    with_baseline: bool = True,
) -> SearchResult:
    """Validate ``plan`` against the model and the cluster (and ``global_batch_size`` when
    given; a mismatch raises the validator's UserError), predict it with the 1F1B simulation
    and, with ``with_baseline``, search the homogeneous baseline for its batch. Memory is not
    enforced: the caller reports :func:`megatron_het.perf.fits`. ``options`` as
    :func:`~megatron_het.perf.predict` takes them (None: what the plan says); the baseline's
    searches price in their precision and layer mode."""
    start = time.perf_counter()
    validate(plan, model, cluster, global_batch_size, seq_length=seq_length)
    prediction = predict(
        model,
        plan,
        cluster,
        seq_length,
        profiles,
        options=options,
        validate=False,
    )
    result = SearchResult(plan, prediction, (), 0, time.perf_counter() - start)
    if with_baseline:
        result = result.with_baseline(
            homogeneous_baseline(
                model,
                cluster,
                plan.global_batch_size,
                seq_length,
                profiles,
                options if options is not None else RunOptions.from_plan(plan),
            )
        )
    return result


__all__ = ["evaluate_plan"]
