"""Pipeline parallelism: schedules written as data (checked without processes), the executor
that runs them over the unified communicator, and stage building."""

from __future__ import annotations

from megatron_het.pipeline.schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    P2PBatch,
    P2PPost,
    P2PWait,
    ScheduleError,
    ScheduleReport,
    Step,
    build_schedule,
    check_schedule,
    gpipe,
    interleaved_group_size,
    interleaved_micro_batch_counts_ok,
    interleaved_one_f_one_b,
    interleaved_order,
    interleaved_warmup,
    one_f_one_b,
    overlap_transfers,
    peak_activation,
    sequential_forward,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "P2PBatch",
    "P2PPost",
    "P2PWait",
    "ScheduleError",
    "ScheduleReport",
    "Step",
    "build_schedule",
    "check_schedule",
    "gpipe",
    "interleaved_group_size",
    "interleaved_micro_batch_counts_ok",
    "interleaved_one_f_one_b",
    "interleaved_order",
    "interleaved_warmup",
    "one_f_one_b",
    "overlap_transfers",
    "peak_activation",
    "sequential_forward",
]
