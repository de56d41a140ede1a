"""Hybrid parallelism: the parallel plan (stages, TP, DP replicas), its validation and builders."""

from __future__ import annotations

from megatron_het.parallel.plan import PLAN_DTYPES, PLAN_FORMAT, ParallelPlan, dumps_plan
from megatron_het.parallel.plan_builders import (
    megatron_layer_split,
    megatron_rank,
    plan_from_megatron_flags,
)
from megatron_het.parallel.plan_validation import valid_tp_sizes, validate
from megatron_het.parallel.stage_plan import PipelinePlan, RankRole, StagePlan

__all__ = [
    "PLAN_DTYPES",
    "PLAN_FORMAT",
    "ParallelPlan",
    "PipelinePlan",
    "RankRole",
    "StagePlan",
    "dumps_plan",
    "megatron_layer_split",
    "megatron_rank",
    "plan_from_megatron_flags",
    "valid_tp_sizes",
    "validate",
]
