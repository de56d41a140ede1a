"""Layer moves between the chunks of an interleaved plan, judged by the simulated prediction.

The search balances an interleaved layout per device group and deals a group's layers out
evenly over its chunks (:func:`~megatron_het.parallel.plan_builders.interleave_plan`). The
best split can be uneven across chunks: a chunk beside the embedding or the head does more
per layer, and the rounds of chunks pace every group by the slowest chunk of the round. For
small pipelines the finalists therefore get a local search over chunk sizes: move one layer
from any chunk to any other (every chunk keeps one), keep the move that lowers the simulated
iteration time most while the plan still fits, and repeat while a move gains at least
:data:`MIN_GAIN` of the iteration (finer gains are below what the predictor resolves, and a
round of moves costs ``chunks x (chunks - 1)`` predictions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.perf import Prediction

# The least relative drop of the iteration time a move must bring to be kept.
MIN_GAIN = 1e-3


def with_chunk_sizes(plan: ParallelPlan, sizes: list[int]) -> ParallelPlan:
    """``plan`` (every pipeline alike) with stage ``s`` of every pipeline holding ``sizes[s]``
    consecutive layers."""
    pipelines = []
    for pipeline in plan.pipelines:
        stages, start = [], 0
        for stage, size in zip(pipeline.stages, sizes):
            stages.append(
                StagePlan.trusted(
                    stage.accelerator,
                    stage.tp,
                    (start, start + size),
                    stage.ranks,
                    stage.has_embedding,
                    stage.has_head,
                    stage.recompute,
                    None
                    if stage.recompute_num_layers is None
                    else min(stage.recompute_num_layers, size),
                )
            )
            start += size
        pipelines.append(PipelinePlan.trusted(pipeline.micro_batches, tuple(stages)))
    return dataclasses.replace(plan, pipelines=tuple(pipelines))


def polish_chunks(
    plan: ParallelPlan,
    predict_plan: Callable[[ParallelPlan], Prediction],
    fits_plan: Callable[[Prediction], bool],
    prediction: Prediction,
) -> tuple[ParallelPlan, Prediction]:
    """The plan reached from ``plan`` (its ``prediction``) by single-layer moves between
    chunks while ``predict_plan``'s iteration time drops by :data:`MIN_GAIN` or more per move
    and ``fits_plan`` holds."""
    # An interleaved plan's chunks hold whole layers.
    sizes = [int(stage.num_layers) for stage in plan.pipelines[0].stages]
    best_plan, best = plan, prediction
    while True:
        found: tuple[ParallelPlan, Prediction, list[int]] | None = None
        for i in range(len(sizes)):
            if sizes[i] == 1:
                continue
            for j in range(len(sizes)):
                if j == i:
                    continue
                trial = list(sizes)
                trial[i] -= 1
                trial[j] += 1
                candidate = with_chunk_sizes(plan, trial)
                predicted = predict_plan(candidate)
                limit = best.iteration_time_s * (1 - MIN_GAIN)
                if found is not None:
                    limit = min(limit, found[1].iteration_time_s)
                if predicted.iteration_time_s < limit and fits_plan(predicted):
                    found = (candidate, predicted, trial)
        if found is None:
            return best_plan, best
        best_plan, best, sizes = found


__all__ = ["MIN_GAIN", "polish_chunks", "with_chunk_sizes"]
