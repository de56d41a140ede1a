"""Block recompute where full recompute is more than the memory needs.

The search tries recompute per kind as all or nothing (every layer of the kind's stages keeps
only its input). Memory usually needs less: Megatron-LM's block method recomputes only the
first N layers of each stage (model chunk) and keeps the others' activations
(``--recompute-method block --recompute-num-layers N``; the plan's ``recompute_num_layers``).
Each recomputed layer costs time and saves memory, so for a plan that fits with full
recompute the best N of a kind is the smallest with which the plan still fits: found by
bisection over N (one prediction per step), kind by kind, and kept when it is faster.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.perf import Prediction


def with_block_recompute(plan: ParallelPlan, kind: str, layers: int) -> ParallelPlan:
    """``plan`` with every recomputing stage of ``kind`` recomputing its first ``layers``
    layers (all of them where it holds no more; none for 0)."""
    pipelines = []
    for pipeline in plan.pipelines:
        stages = []
        for stage in pipeline.stages:
            if stage.accelerator == kind and stage.recompute:
                stage = StagePlan.trusted(
                    stage.accelerator,
                    stage.tp,
                    stage.layers,
                    stage.ranks,
                    stage.has_embedding,
                    stage.has_head,
                    layers > 0,
                    layers if 0 < layers < stage.num_layers else None,  # None: all
                )
            stages.append(stage)
        pipelines.append(PipelinePlan.trusted(pipeline.micro_batches, tuple(stages)))
    return dataclasses.replace(plan, pipelines=tuple(pipelines))


def relax_recompute(
    plan: ParallelPlan,
    predict_plan: Callable[[ParallelPlan], Prediction],
    fits_plan: Callable[[Prediction], bool],
    prediction: Prediction,
) -> tuple[ParallelPlan, Prediction]:
    """``plan`` (and its ``prediction``, which fits) with each recomputing kind's stages
    recomputing the fewest layers with which the plan still fits, where that is faster (a
    plan that recomputes nothing comes back as it is, with no prediction made)."""
    kinds = list(
        dict.fromkeys(
            stage.accelerator
            for pipeline in plan.pipelines
            for stage in pipeline.stages
            if stage.recompute
        )
    )
    for kind in kinds:
        most = max(  # whole layers: only a split stage (none of the planner's) has a half
            math.ceil(stage.recomputed_layers)
            for pipeline in plan.pipelines
            for stage in pipeline.stages
            if stage.accelerator == kind
        )
        low, high = 0, most  # ``high`` fits: the plan as it is
        best = (plan, prediction)
        while low < high:
            middle = (low + high) // 2
            trial = with_block_recompute(plan, kind, middle)
            predicted = predict_plan(trial)
            if fits_plan(predicted):
                high, best = middle, (trial, predicted)
            else:
                low = middle + 1
        if best[1].iteration_time_s < prediction.iteration_time_s * (1 - 1e-9):
            plan, prediction = best
    return plan, prediction


__all__ = ["relax_recompute", "with_block_recompute"]
