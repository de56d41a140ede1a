"""Checks that a ParallelPlan is consistent and fits a model, a cluster and a batch size.

Every problem a user can cause raises :class:`UserError` with one line that names the stage,
pipeline, layers or ranks at fault and says how to fix it. The first problem found is reported;
checks run from the plan's own shape outwards (sizes, layers, ranks, TP, cluster, batch).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan


def validate(
    plan: ParallelPlan,
    model: ModelConfig,
    cluster: ClusterSpec | None = None,
    global_batch_size: int | None = None,
    seq_length: int | None = None,
) -> None:
    """Raise UserError for the first thing wrong with ``plan``; return None if it is sound.

    Checks: positive sizes; each pipeline covers layers ``0..model.num_layers-1`` exactly once in
    stage order (bounds may be half-layer bounds ``x.5``); every stage lists ``tp`` ranks;
    ``tp`` divides the attention heads, the query groups and the FFN size (pipelines may split
    the model differently: heterogeneous data parallelism); ranks are used once and are exactly
    ``0..world-1`` (world from ``cluster`` if given, else the number of ranks placed); each stage's
    accelerator is that of its ranks in ``cluster``; the batch adds up to ``global_batch_size`` if
    given. Interleaved pipelines (stages sharing ranks): at least two device groups, each holding
    the same number of stages, round-robin (stage i on group i mod pp), one accelerator per group,
    and at least as many micro_batches as groups. Sequence parallelism: ``seq_length`` (when given)
    divisible by every stage's tp.
    """
    _check_sizes(plan)
    for p, pipeline in enumerate(plan.pipelines):
        _check_layers(p, pipeline, model.num_layers)
        for s, stage in enumerate(pipeline.stages):
            _check_stage_tp(_where(p, s), stage, model)
            count = stage.recompute_num_layers
            if count is not None and stage.splits_layers:
                raise UserError(
                    f"{_where(p, s)} has half-layer bounds {stage.layers_label} and "
                    f"recompute_num_layers {count}; recompute all of it (drop "
                    f"recompute_num_layers) or give it whole layers"
                )
            if count is not None and count > stage.num_layers:
                raise UserError(
                    f"{_where(p, s)} recomputes its first {count} layers but holds "
                    f"{stage.num_layers}; use recompute_num_layers <= "
                    f"{stage.num_layers}, or leave it out to recompute all"
                )
        _check_interleaving(p, pipeline)
    _check_ranks(plan, cluster)
    if cluster is not None:
        _check_accelerators(plan, cluster)
    if global_batch_size is not None:
        _check_batch(plan, global_batch_size)
    if plan.sequence_parallel and seq_length is not None:
        _check_sequence(plan, seq_length)


def _check_sequence(plan: ParallelPlan, seq_length: int) -> None:
    for p, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            if seq_length % stage.tp:
                raise UserError(
                    f"{_where(p, s)} has tp={stage.tp}, which does not divide "
                    f"--seq-length {seq_length}; sequence parallelism splits the "
                    f"sequence over the TP ranks: use a multiple of {stage.tp} or "
                    f"drop sequence parallelism"
                )


def valid_tp_sizes(model: ModelConfig) -> list[int]:
    """TP degrees that divide the attention heads, the query groups and the FFN size."""
    return [
        t
        for t in range(1, model.num_attention_heads + 1)
        if not (
            model.num_attention_heads % t or model.num_query_groups % t or model.ffn_hidden_size % t
        )
    ]


def _where(pipeline: int, stage: int) -> str:
    return f"stage {stage} of pipeline {pipeline}"


def _span(values: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    parts: list[list[int]] = []  # [first, last] of each run
    for v in sorted(values):
        if parts and parts[-1][1] == v - 1:
            parts[-1][1] = v
        else:
            parts.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _check_sizes(plan: ParallelPlan) -> None:
    if plan.micro_batch_size < 1:
        raise UserError(f"plan: micro_batch_size must be at least 1, got {plan.micro_batch_size}")
    if not plan.pipelines:
        raise UserError("plan: give at least one pipeline (one per data-parallel replica)")
    for p, pipeline in enumerate(plan.pipelines):
        if pipeline.micro_batches < 1:
            raise UserError(
                f"pipeline {p}: micro_batches must be at least 1, got "
                f"{pipeline.micro_batches}; give every pipeline a share of the batch"
            )
        if not pipeline.stages:
            raise UserError(f"pipeline {p}: give at least one stage")
        for s, stage in enumerate(pipeline.stages):
            if stage.tp < 1:
                raise UserError(f"{_where(p, s)}: tp must be at least 1, got {stage.tp}")


def _check_layers(p: int, pipeline: PipelinePlan, num_layers: int) -> None:
    """Stages must tile ``[0, num_layers)`` in order, without gaps or overlaps."""
    expected: float = 0  # where the next stage starts (a half-layer bound may end a stage)
    for s, stage in enumerate(pipeline.stages):
        start, end = stage.layers
        where = _where(p, s)
        if end <= start:
            raise UserError(
                f"{where} has an empty layer range [{start}, {end}); give it at least "
                f"one layer (end > start)"
            )
        if start < 0 or end > num_layers:
            raise UserError(
                f"{where} has layers [{start}, {end}) but the model's layers are "
                f"[0, {num_layers}); keep every range inside it"
            )
        if start > expected:
            raise UserError(
                f"layers [{expected}, {start}) are on no stage of pipeline {p}: "
                f"{where} starts at layer {start}; make it start at {expected}"
            )
        if start < expected:
            raise UserError(
                f"layers [{start}, {min(expected, end)}) are on both stage {s - 1} and "
                f"stage {s} of pipeline {p}; make stage {s} start at layer {expected}, "
                f"where stage {s - 1} ends"
            )
        expected = end
    if expected < num_layers:
        raise UserError(
            f"layers [{expected}, {num_layers}) are on no stage of pipeline {p}: its "
            f"last stage ends at layer {expected}; end it at {num_layers}"
        )


def _check_stage_tp(where: str, stage: StagePlan, model: ModelConfig) -> None:
    if len(stage.ranks) != stage.tp:
        raise UserError(
            f"{where} has tp={stage.tp} but lists {_plural(len(stage.ranks), 'rank')} "
            f"{list(stage.ranks)}; list exactly {stage.tp} (its TP group in tp_rank "
            f"order)"
        )
    if list(stage.ranks) != sorted(stage.ranks):
        raise UserError(
            f"{where} lists ranks {list(stage.ranks)} out of order; list a stage's "
            f"ranks in ascending order ({sorted(stage.ranks)}): tp_rank follows the "
            f"global rank order inside a TP group"
        )
    sizes = (
        (model.num_attention_heads, f"{model.num_attention_heads} attention heads"),
        (model.num_query_groups, f"{model.num_query_groups} query groups (kv heads)"),
        (model.ffn_hidden_size, f"ffn_hidden_size {model.ffn_hidden_size}"),
    )
    bad = [what for n, what in sizes if n % stage.tp]
    if bad:
        valid = ", ".join(map(str, valid_tp_sizes(model)))
        raise UserError(
            f"{where} has tp={stage.tp}, which does not divide the model's "
            f"{' or '.join(bad)}; use tp in {{{valid}}}"
        )


def _check_interleaving(p: int, pipeline: PipelinePlan) -> None:
    """Stages that share ranks are virtual stages of one device group: round-robin, even."""
    if not pipeline.interleaved:
        return
    groups, n = pipeline.device_groups, pipeline.num_stages
    pp = len(groups)
    holder: dict[int, int] = {}
    for s, stage in enumerate(pipeline.stages):
        for rank in stage.ranks:
            other = pipeline.stages[holder.setdefault(rank, s)]
            if other.ranks != stage.ranks:
                raise UserError(
                    f"rank {rank} is on {_where(p, holder[rank])} (ranks "
                    f"{list(other.ranks)}) and on {_where(p, s)} (ranks "
                    f"{list(stage.ranks)}); the stages of one device group list the "
                    f"same ranks"
                )
    if pp == 1:
        raise UserError(
            f"pipeline {p} runs all {n} stages on ranks {list(groups[0])}; "
            f"interleaving needs at least 2 device groups: merge the stages into "
            f"one or give them different ranks"
        )
    if n % pp:
        counts = ", ".join(
            f"ranks {list(g)}: {len(pipeline.group_stages(i))}" for i, g in enumerate(groups)
        )
        raise UserError(
            f"pipeline {p} has {n} stages on {pp} device groups ({counts}); "
            f"stages that share ranks are interleaved chunks of one group, and "
            f"every group must hold the same number: use a multiple of {pp} "
            f"stages, or give each stage ranks of its own"
        )
    for s, stage in enumerate(pipeline.stages):
        want = groups[s % pp]
        if stage.ranks != want:
            raise UserError(
                f"{_where(p, s)} runs on ranks {list(stage.ranks)} but interleaved "
                f"stages go round-robin over the device groups (stage i on group "
                f"i mod {pp}): give it ranks {list(want)}"
            )
        first = pipeline.stages[s % pp]
        if stage.accelerator.lower() != first.accelerator.lower():
            raise UserError(
                f"{_where(p, s)} says {stage.accelerator} but stage {s % pp} on the "
                f"same ranks says {first.accelerator}; a device group has one kind"
            )
    m = pipeline.micro_batches
    if m < pp:
        raise UserError(
            f"pipeline {p} interleaves {n // pp} chunks on {pp} device groups, so "
            f"it needs at least {pp} micro_batches (got {m}): use {pp} or more"
        )


def _check_ranks(plan: ParallelPlan, cluster: ClusterSpec | None) -> None:
    placed: dict[int, str] = {}
    group_of: dict[int, tuple[int, tuple[int, ...]]] = {}
    for p, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            for rank in stage.ranks:
                if rank < 0:
                    raise UserError(f"{_where(p, s)} lists rank {rank}; ranks are numbered from 0")
                if rank in placed and group_of[rank] != (p, stage.ranks):
                    raise UserError(
                        f"rank {rank} is on {placed[rank]} and on {_where(p, s)}; "
                        f"give every rank exactly one stage, or (interleaving) "
                        f"list the same ranks on every stage of its device group"
                    )
                placed.setdefault(rank, _where(p, s))
                group_of[rank] = (p, stage.ranks)
    if cluster is None:
        world = len(placed)
        owner = f"the plan places {_plural(world, 'rank')}, so its ranks"
    else:
        world, owner = cluster.world_size, f"the ranks of cluster {cluster.name}"
    outside = sorted(r for r in placed if r >= world)
    if outside:
        raise UserError(
            f"{placed[outside[0]]} lists rank {outside[0]} but {owner} are "
            f"0-{world - 1}; use ranks in that range"
        )
    missing = sorted(set(range(world)) - set(placed))
    if missing:
        raise UserError(
            f"{'rank' if len(missing) == 1 else 'ranks'} {_span(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} on no stage but {owner} are "
            f"0-{world - 1}; put every rank on exactly one stage"
        )


def _check_accelerators(plan: ParallelPlan, cluster: ClusterSpec) -> None:
    for p, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            for rank in stage.ranks:
                actual = cluster.accelerator_of(rank).name
                if actual.lower() == stage.accelerator.lower():
                    continue
                have = cluster.ranks_of_accelerator(stage.accelerator)
                hint = (
                    f"or use {stage.accelerator} ranks ({_span(have)})"
                    if have
                    else f"(the cluster has no {stage.accelerator})"
                )
                raise UserError(
                    f"{_where(p, s)} says {stage.accelerator} but rank {rank} is "
                    f"{actual} in cluster {cluster.name}; set the stage's "
                    f"accelerator to {actual} {hint}"
                )


def _check_batch(plan: ParallelPlan, global_batch_size: int) -> None:
    if plan.global_batch_size == global_batch_size:
        return
    counts = " + ".join(str(p.micro_batches) for p in plan.pipelines)
    mbs = plan.micro_batch_size
    if global_batch_size % mbs:
        fix = (
            f"{global_batch_size} is not a multiple of micro_batch_size {mbs}; set "
            f"--global-batch-size {plan.global_batch_size}"
        )
    else:
        fix = (
            f"set --global-batch-size {plan.global_batch_size} or make the pipelines' "
            f"micro_batches sum to {global_batch_size // mbs}"
        )
    raise UserError(
        f"the plan's batch is micro_batch_size {mbs} x ({counts}) micro-batches = "
        f"{plan.global_batch_size} sequences but --global-batch-size is "
        f"{global_batch_size}; {fix}"
    )
