"""Every communication group a rank needs, built once from the parallel plan.

:func:`build_process_groups` walks the plan in one fixed order and asks the communicator for each
group; ``UnifiedCommunicator.new_group`` is collective over ALL ranks, so every rank creates
every group (also those it is not in) in the same order. Groups with the same members are made
once and shared (a TP group of one rank is also its DP group when dp == 1, for instance), which
keeps the number of backend groups down.

Groups of one rank (its fields in :class:`ProcessGroups`):

    world           every rank
    tp              the ranks of its stage (its device group, which runs all its interleaved
                    stages), in tp_rank order
    dp              the ranks with the same stage index and tp_rank in every pipeline (size 1
                    when dp == 1): gradients of identical parameter shards are summed over it
    pipeline        every rank of its pipeline: stage-boundary transfers go over it
    embedding       tied embeddings only (None when untied, pp == 1 or the rank is on neither
                    end stage): the first- and last-stage ranks of its pipeline that hold
                    copies of the same embedding rows, whose gradients are summed over it
    stage_cross_dp  every rank holding its stage in any pipeline
    replica_units   heterogeneous data parallelism only (pipelines of different layouts): the
                    parameter units this rank holds, each with the group of every rank that
                    holds part of it in any pipeline
                    (:func:`~megatron_het.parallel.replicas.replica_units`); gradients are
                    summed over those groups in the full parameter shapes. ``dp`` and
                    ``stage_cross_dp`` are then this rank alone.

Embedding groups: when the first and last stages have the same TP degree, rank t of the first
stage pairs with rank t of the last stage (they hold the same vocabulary rows). When the degrees
differ, the rows do not line up, so the group is all ranks of both end stages and the gradient
sum runs over full-vocabulary buffers (see
``megatron_het.pipeline.stage_boundary.sync_tied_embedding_grads``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_het.comm.communicator import UnifiedCommunicator
from megatron_het.comm.groups import UnifiedGroup
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.replicas import ReplicaUnit, replica_units, uniform_layouts
from megatron_het.parallel.stage_plan import RankRole


@dataclass(frozen=True)
class LocalGroup:
    """A group of this rank alone (no communication): the DP group of a heterogeneous plan,
    whose replicas sum their gradients over :attr:`ProcessGroups.replica_units` instead."""

    me: int

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.me,)

    size = 1
    rank = 0


@dataclass
class ProcessGroups:
    """The groups of one rank (see the module docstring); built by :func:`build_process_groups`.

    ``embedding_pairs`` is True when the embedding group pairs equal-TP end stages rank by rank
    (each member holds the same rows), False when it spans both end stages whole.
    """

    comm: UnifiedCommunicator
    plan: ParallelPlan
    role: RankRole
    world: UnifiedGroup
    tp: UnifiedGroup
    dp: UnifiedGroup | LocalGroup  # LocalGroup: replicas of different layouts
    pipeline: UnifiedGroup
    embedding: UnifiedGroup | None
    stage_cross_dp: UnifiedGroup | LocalGroup
    embedding_pairs: bool = True
    replica_units: list[tuple[ReplicaUnit, UnifiedGroup]] = field(default_factory=list)

    @property
    def uniform_dp(self) -> bool:
        """True unless the pipelines' layouts differ (heterogeneous data parallelism)."""
        return not isinstance(self.dp, LocalGroup)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.comm.rank


def _check_stage_ranks(plan: ParallelPlan) -> None:
    """The communicator numbers group ranks by ascending global rank; the plan's tp_rank is the
    position in the stage's list, so the two agree only for ascending lists."""
    for p, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            if list(stage.ranks) != sorted(stage.ranks):
                raise UserError(
                    f"stage {s} of pipeline {p} lists ranks {list(stage.ranks)}; "
                    f"list a stage's ranks in ascending order "
                    f"({sorted(stage.ranks)})"
                )


def dp_members(plan: ParallelPlan, stage: int, tp_rank: int) -> tuple[int, ...]:
    """Ranks with stage index ``stage`` and tp_rank ``tp_rank`` in every pipeline, in pipeline
    order (validated plans give every pipeline the same layout)."""
    return tuple(p.stages[stage].ranks[tp_rank] for p in plan.pipelines)


def stage_members(plan: ParallelPlan, stage: int) -> tuple[int, ...]:
    """Ranks holding stage index ``stage`` in any pipeline, pipeline by pipeline."""
    return tuple(r for p in plan.pipelines for r in p.stages[stage].ranks)


def embedding_members(plan: ParallelPlan, pipeline: int) -> tuple[list[tuple[int, ...]], bool]:
    """The tied-embedding groups of one pipeline and whether they are rank-by-rank pairs.

    Empty when the pipeline has a single stage. Equal TP on both end stages: one pair per
    tp_rank; otherwise one group of every rank of both end stages.
    """
    stages = plan.pipelines[pipeline].stages
    if plan.pipelines[pipeline].pp_size == 1:
        return [], True
    first, last = stages[0], stages[-1]
    if first.tp == last.tp:
        return [(a, b) for a, b in zip(first.ranks, last.ranks)], True
    return [first.ranks + last.ranks], False


def build_process_groups(
    comm: UnifiedCommunicator,
    plan: ParallelPlan,
    tie_embeddings: bool | None = None,
    num_layers: int | None = None,
) -> ProcessGroups:
    """Create every group of ``plan`` on every rank and return this rank's.

    Collective over all ranks of ``comm`` (call it on every rank, with the same plan). The plan
    must place exactly ``comm.world_size`` ranks. ``tie_embeddings`` False skips the embedding
    groups; None (the contract's default) builds them whenever pp > 1, and they are only used
    when the model ties its embeddings. Pipelines of different layouts get ``replica_units``
    instead of rank-by-rank DP groups (``num_layers``: the model's, default the plan's last
    layer). Raises UserError for a plan this world cannot run.
    """
    if plan.world_size != comm.world_size or plan.ranks() != tuple(range(comm.world_size)):
        raise UserError(
            f"the plan places ranks {list(plan.ranks())} but {comm.world_size} "
            f"ranks were launched; launch {plan.world_size} ranks or fix the plan"
        )
    _check_stage_ranks(plan)
    me = comm.rank
    role = plan.rank_role(me)
    made: dict[tuple[int, ...], UnifiedGroup] = {tuple(comm.world.ranks): comm.world}

    def group(ranks: tuple[int, ...], name: str) -> UnifiedGroup:
        key = tuple(sorted(ranks))
        if key not in made:
            made[key] = comm.new_group(key, name=name)
        return made[key]

    mine: dict[str, UnifiedGroup] = {}
    for p, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            g = group(stage.ranks, f"tp-p{p}s{s}")
            if me in stage.ranks:
                mine["tp"] = g
    units: list[tuple[ReplicaUnit, UnifiedGroup]] = []
    alone = None  # the DP groups of replicas of different layouts: this rank alone
    if uniform_layouts(plan):
        # Stage s < pp_size is the first chunk of device group s: one group per device group.
        for s in range(plan.pipelines[0].pp_size):
            for t in range(plan.pipelines[0].stages[s].tp):
                members = dp_members(plan, s, t)
                g = group(members, f"dp-s{s}t{t}")
                if me in members:
                    mine["dp"] = g
            members = stage_members(plan, s)
            g = group(members, f"stage-s{s}")
            if me in members:
                mine["stage_cross_dp"] = g
    else:
        alone = LocalGroup(me)
        # The last stage ends where the model does: a whole bound.
        layers = num_layers or int(plan.pipelines[0].stages[-1].layers[1])
        for u, (unit, members) in enumerate(
            replica_units(plan, layers, tie_embeddings is not False)
        ):
            g = group(members, f"replica-u{u}")
            if me in members:
                units.append((unit, g))
    for p, pipeline in enumerate(plan.pipelines):
        g = group(pipeline.ranks, f"pipeline-p{p}")
        if me in pipeline.ranks:
            mine["pipeline"] = g
    pairs = True
    if tie_embeddings is not False:
        for p in range(plan.dp_size):
            sets, paired = embedding_members(plan, p)
            for i, members in enumerate(sets):
                g = group(members, f"embedding-p{p}-{i}")
                if me in members:
                    mine["embedding"], pairs = g, paired
    return ProcessGroups(
        comm=comm,
        plan=plan,
        role=role,
        world=comm.world,
        tp=mine["tp"],
        dp=mine["dp"] if alone is None else alone,
        pipeline=mine["pipeline"],
        embedding=mine.get("embedding"),
        stage_cross_dp=mine["stage_cross_dp"] if alone is None else alone,
        embedding_pairs=pairs,
        replica_units=units,
    )
