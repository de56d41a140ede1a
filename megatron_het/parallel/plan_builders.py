"""Plans built from Megatron-LM's command-line flags, for uniform clusters.

Rank order follows Megatron-LM's default ``order="tp-cp-ep-dp-pp"`` with cp = ep = 1: tp varies
fastest, then dp, then pp. The rank of (pipeline d, stage p, tp_rank t) is therefore
``t + tp * (d + dp * p)``: each TP group is a block of adjacent ranks (one node, where the node
is large enough), DP replicas of a stage are next to each other, and stages are the outermost
axis. For world 8, tp 2, pp 2 (dp 2): stage 0 holds ranks 0-3 (pipeline 0 on 0-1, pipeline 1
on 2-3) and stage 1 holds ranks 4-7.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatron_het.cluster import AcceleratorSpec, ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.megatron_layout import layout_layer_counts
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_validation import validate
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan

AcceleratorOf = str | ClusterSpec | Callable[[int], str | AcceleratorSpec]


def megatron_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    """Global rank of (tp_rank, dp_rank, pp_rank) in Megatron's default order (tp fastest)."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def megatron_layer_split(
    num_layers: int, pp: int, first: int | None = None, last: int | None = None
) -> list[tuple[int, int]]:
    """Layer ranges per stage as Megatron's flags give them.

    ``first`` / ``last`` (--decoder-first/last-pipeline-num-layers) fix the first and last
    stage's layer counts; the remaining layers are split evenly over the other stages.
    """
    if pp < 1:
        raise UserError(f"--pipeline-model-parallel-size must be at least 1, got {pp}")
    for flag, value in (("first", first), ("last", last)):
        if value is not None and (pp == 1 or value < 1):
            raise UserError(
                f"--decoder-{flag}-pipeline-num-layers {value} needs "
                f"--pipeline-model-parallel-size > 1 and a value of at least 1"
            )
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0:
        raise UserError(
            f"--decoder-first/last-pipeline-num-layers add up to "
            f"{(first or 0) + (last or 0)}, more than --num-layers {num_layers}"
        )
    if middle == 0 and rest != 0 or middle > 0 and (rest < middle or rest % middle):
        fixed = (
            ""
            if first is None and last is None
            else (f" after the first/last stages' {(first or 0) + (last or 0)}")
        )
        raise UserError(
            f"{rest} remaining layers{fixed} of --num-layers {num_layers} do not "
            f"split evenly over {middle} pipeline stages; change "
            f"--pipeline-model-parallel-size or set "
            f"--decoder-first/last-pipeline-num-layers, or write a plan file"
        )
    counts = ([first] if first is not None else []) + [rest // middle if middle else 0] * middle
    counts += [last] if last is not None else []
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def _accelerator_lookup(accelerator_of: AcceleratorOf) -> Callable[[int], str]:
    if isinstance(accelerator_of, str):
        return lambda rank: accelerator_of
    if isinstance(accelerator_of, ClusterSpec):
        return lambda rank: accelerator_of.accelerator_of(rank).name

    def name_of(rank: int) -> str:
        kind = accelerator_of(rank)
        return kind.name if isinstance(kind, AcceleratorSpec) else str(kind)

    return name_of


def plan_from_megatron_flags(
    model: ModelConfig,
    world_size: int,
    tp: int,
    pp: int,
    micro_batch_size: int,
    global_batch_size: int,
    decoder_first_pipeline_num_layers: int | None = None,
    decoder_last_pipeline_num_layers: int | None = None,
    accelerator_of: AcceleratorOf = "cpu",
    recompute: bool = False,
    virtual_stages: int | None = None,
    layout: str | None = None,
) -> ParallelPlan:
    """The plan Megatron-LM's flags describe: dp = world / (tp * pp) identical pipelines.

    ``virtual_stages`` (Megatron's virtual pipeline size, > 1) interleaves: the layers split
    evenly into ``pp * virtual_stages`` model chunks, chunk i on pipeline rank i mod pp.
    ``layout`` (Megatron's ``--pipeline-model-parallel-layout``,
    :mod:`megatron_het.parallel.megatron_layout`) gives every chunk's layer count instead.

    ``accelerator_of`` names each rank's kind: a ClusterSpec, a callable rank -> name (or
    AcceleratorSpec), or one name for all ranks. Every stage must hold one kind; a mixed
    cluster needs a plan file. Each pipeline gets global / (micro_batch_size * dp)
    micro-batches. The result is validated against ``model`` (and the cluster, if given).
    """
    if tp < 1 or pp < 1 or world_size < 1 or micro_batch_size < 1:
        raise UserError(
            f"tp ({tp}), pp ({pp}), world size ({world_size}) and micro batch size "
            f"({micro_batch_size}) must all be at least 1"
        )
    if world_size % (tp * pp):
        raise UserError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size"
            f" {tp} x --pipeline-model-parallel-size {pp} = {tp * pp}; pick tp and pp "
            f"whose product divides {world_size}"
        )
    cluster = accelerator_of if isinstance(accelerator_of, ClusterSpec) else None
    if cluster is not None and cluster.world_size != world_size:
        raise UserError(
            f"world size {world_size} differs from cluster {cluster.name}'s "
            f"{cluster.world_size} ranks; launch {cluster.world_size} ranks"
        )
    dp = world_size // (tp * pp)
    if global_batch_size % (micro_batch_size * dp):
        raise UserError(
            f"--global-batch-size {global_batch_size} is not divisible by "
            f"--micro-batch-size {micro_batch_size} x data-parallel size {dp} = "
            f"{micro_batch_size * dp}; use a multiple of {micro_batch_size * dp}"
        )
    layer_ranges = _chunk_layers(
        model,
        pp,
        decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers,
        virtual_stages,
        layout,
    )
    name_of = _accelerator_lookup(accelerator_of)
    pipelines = []
    for d in range(dp):
        stages = []
        for chunk, layers in enumerate(layer_ranges):
            p = chunk % pp
            ranks = tuple(megatron_rank(t, d, p, tp, dp) for t in range(tp))
            kinds = sorted({name_of(r) for r in ranks})
            if len(kinds) > 1:
                raise UserError(
                    f"Megatron's rank order puts ranks {list(ranks)} "
                    f"({', '.join(kinds)}) in one TP group; a mixed cluster needs a "
                    f"--plan file"
                )
            stages.append(
                StagePlan(
                    accelerator=kinds[0], tp=tp, layers=layers, ranks=ranks, recompute=recompute
                )
            )
        pipelines.append(PipelinePlan(global_batch_size // (micro_batch_size * dp), tuple(stages)))
    plan = ParallelPlan(micro_batch_size=micro_batch_size, pipelines=tuple(pipelines))
    validate(plan, model, cluster, global_batch_size)
    return plan


def _chunk_layers(
    model: ModelConfig,
    pp: int,
    first: int | None,
    last: int | None,
    virtual_stages: int | None,
    layout: str | None,
) -> list[tuple[int, int]]:
    """Layer ranges of every stage (chunk i runs on pipeline rank i mod pp) from Megatron's
    layout string, its virtual pipeline size, or its first/last-stage layer counts."""
    if layout is not None:
        counts = layout_layer_counts(layout, model.num_layers, pp)
        if virtual_stages is not None and virtual_stages != len(counts) // pp:
            raise UserError(
                f"--pipeline-model-parallel-layout has {len(counts) // pp} chunks "
                f"per pipeline rank but the virtual pipeline size is "
                f"{virtual_stages}; drop one of them"
            )
        starts = [sum(counts[:i]) for i in range(len(counts) + 1)]
        return list(zip(starts, starts[1:]))
    v = virtual_stages or 1
    if v > 1:
        if pp == 1 or first is not None or last is not None:
            raise UserError(
                "interleaving (--virtual-pipeline-model-parallel-size / "
                "--num-layers-per-virtual-pipeline-stage) needs "
                "--pipeline-model-parallel-size > 1 and even chunks; for uneven "
                "chunks give --pipeline-model-parallel-layout or write a plan file"
            )
        if model.num_layers % (pp * v):
            raise UserError(
                f"--num-layers {model.num_layers} does not split into {pp} x {v} "
                f"interleaved chunks of equal size; use a virtual size whose "
                f"product with pp divides {model.num_layers}"
            )
    return megatron_layer_split(model.num_layers, pp * v, first, last)


def with_recompute(plan: ParallelPlan, num_layers: int | None) -> ParallelPlan:
    """``plan`` with activation recompute on every stage (model chunk): all its layers where
    ``num_layers`` is None (Megatron's uniform method, one layer per checkpoint), else its
    first ``num_layers`` (the block method; all where it holds fewer)."""
    return dataclasses.replace(
        plan,
        pipelines=tuple(
            PipelinePlan.trusted(
                pipeline.micro_batches,
                tuple(
                    dataclasses.replace(
                        st,
                        recompute=True,
                        recompute_num_layers=None
                        if num_layers is None
                        else min(num_layers, len(st.layer_indices)),
                    )
                    for st in pipeline.stages
                ),
            )
            for pipeline in plan.pipelines
        ),
    )


def interleave_plan(plan: ParallelPlan, num_chunks: int) -> ParallelPlan:
    """``plan`` with every pipeline's device groups running ``num_chunks`` interleaved chunks.

    Each device group keeps its ranks, kind, TP degree and layer count ``L_g``; the model's
    layers are dealt out in ``num_chunks`` rounds over the groups in pipeline order, group g
    taking ``L_g / num_chunks`` consecutive layers per round (the earlier rounds one more while
    ``L_g`` does not divide evenly), so chunk i runs on group i mod pp, as interleaved 1F1B
    needs. ``num_chunks`` 1 returns ``plan``. UserError when a pipeline is already
    interleaved, a group has fewer layers than ``num_chunks``, or it has fewer micro-batches
    than groups.
    """
    if num_chunks < 1:
        raise UserError(f"the number of interleaved chunks must be at least 1, got {num_chunks}")
    if num_chunks == 1:
        return plan
    pipelines = []
    for p, pipeline in enumerate(plan.pipelines):
        if pipeline.interleaved:
            raise UserError(f"pipeline {p} is interleaved already; interleave a plain plan")
        pp = pipeline.pp_size
        if pp < 2:
            raise UserError(f"pipeline {p} has one stage; interleaving needs at least 2")
        split = [s for s, st in enumerate(pipeline.stages) if st.splits_layers]
        if split:
            raise UserError(
                f"stage {split[0]} of pipeline {p} has half-layer bounds "
                f"{pipeline.stages[split[0]].layers_label}; interleave a plan of "
                f"whole layers, or write the interleaved plan's chunks out"
            )
        short = [s for s, st in enumerate(pipeline.stages) if st.num_layers < num_chunks]
        if short:
            st = pipeline.stages[short[0]]
            raise UserError(
                f"stage {short[0]} of pipeline {p} has {st.num_layers} layers, "
                f"fewer than {num_chunks} interleaved chunks; use at most "
                f"{st.num_layers} chunks"
            )
        if pipeline.micro_batches < pp:
            raise UserError(
                f"pipeline {p} has {pipeline.micro_batches} micro-batches, fewer "
                f"than its {pp} device groups, which interleaving needs"
            )
        stages: list[StagePlan] = []
        start, last = 0, num_chunks * pp - 1
        for c in range(num_chunks):
            for st in pipeline.stages:
                held = int(st.num_layers)  # whole layers: split stages were refused above
                size = held // num_chunks + (c < held % num_chunks)
                count = (
                    None if st.recompute_num_layers is None else min(st.recompute_num_layers, size)
                )
                stages.append(
                    StagePlan.trusted(
                        st.accelerator,
                        st.tp,
                        (start, start + size),
                        st.ranks,
                        not stages,
                        len(stages) == last,
                        st.recompute,
                        count,
                    )
                )
                start += size
        pipelines.append(PipelinePlan.trusted(pipeline.micro_batches, tuple(stages)))
    return dataclasses.replace(plan, pipelines=tuple(pipelines))
