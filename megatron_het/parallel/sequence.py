"""Which sequence positions a rank of a stage holds between TP blocks, from the plan alone.

Without sequence parallelism (or on a stage with tp 1) every rank holds all ``S`` positions.
With it, tp_rank ``t`` of a stage with ``tp > 1`` holds ``[t S/tp, (t+1) S/tp)``. The runtime's
stage boundaries (:mod:`megatron_het.pipeline.stage_boundary`) and the predictor's
(:mod:`megatron_het.perf.cost.boundary_time`) both exchange the overlaps that
:func:`position_overlaps` lists. No torch.
"""

from __future__ import annotations

from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import StagePlan


def sequence_range(seq_length: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """Positions ``[start, stop)`` that ``tp_rank`` of ``tp`` holds (``tp`` divides S)."""
    if seq_length % tp:
        raise ValueError(f"sequence length {seq_length} is not divisible by the TP size {tp}")
    width = seq_length // tp
    return tp_rank * width, (tp_rank + 1) * width


def sequence_sharded(plan: ParallelPlan, stage: StagePlan) -> bool:
    """Whether ``stage``'s activations between TP blocks are split along the sequence."""
    return bool(plan.sequence_parallel) and stage.tp > 1


def local_positions(
    plan: ParallelPlan, stage: StagePlan, tp_rank: int, seq_length: int
) -> tuple[int, int]:
    """Sequence positions a rank of ``stage`` holds between layers: all of them, or its
    ``S / tp`` block under sequence parallelism."""
    if sequence_sharded(plan, stage):
        return sequence_range(seq_length, stage.tp, tp_rank)
    return 0, seq_length


def position_overlaps(
    plan: ParallelPlan, src: StagePlan, dst: StagePlan, seq_length: int
) -> list[tuple[int, int, int, int]]:
    """``(i, j, lo, hi)`` for every tp_rank ``i`` of ``src`` and ``j`` of ``dst`` whose blocks
    share the positions ``[lo, hi)`` (non-empty), in ``(i, j)`` order."""
    out = []
    for i in range(src.tp):
        lo_a, hi_a = local_positions(plan, src, i, seq_length)
        for j in range(dst.tp):
            lo_b, hi_b = local_positions(plan, dst, j, seq_length)
            lo, hi = max(lo_a, lo_b), min(hi_a, hi_b)
            if lo < hi:
                out.append((i, j, lo, hi))
    return out
