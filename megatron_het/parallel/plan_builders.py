"""Plans built from Megatron-LM's command-line flags, for uniform clusters.

Rank order follows Megatron-LM's default ``order="tp-cp-ep-dp-pp"`` with cp = ep = 1: tp varies
fastest, then dp, then pp. The rank of (pipeline d, stage p, tp_rank t) is therefore
``t + tp * (d + dp * p)``: each TP group is a block of adjacent ranks (one node, where the node
is large enough), DP replicas of a stage are next to each other, and stages are the outermost
axis. For world 8, tp 2, pp 2 (dp 2): stage 0 holds ranks 0-3 (pipeline 0 on 0-1, pipeline 1
on 2-3) and stage 1 holds ranks 4-7.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

from megatron_het.cluster import AcceleratorSpec, ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan, PipelinePlan, StagePlan
from megatron_het.parallel.plan_validation import validate

AcceleratorOf = Union[str, ClusterSpec, Callable[[int], Union[str, AcceleratorSpec]]]


def megatron_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    """Global rank of (tp_rank, dp_rank, pp_rank) in Megatron's default order (tp fastest)."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def megatron_layer_split(num_layers: int, pp: int, first: Optional[int] = None,
                         last: Optional[int] = None) -> list[tuple[int, int]]:
    """Layer ranges per stage as Megatron's flags give them.

    ``first`` / ``last`` (--decoder-first/last-pipeline-num-layers) fix the first and last
    stage's layer counts; the remaining layers are split evenly over the other stages.
    """
    if pp < 1:
        raise UserError(f"--pipeline-model-parallel-size must be at least 1, got {pp}")
    for flag, value in (("first", first), ("last", last)):
        if value is not None and (pp == 1 or value < 1):
            raise UserError(f"--decoder-{flag}-pipeline-num-layers {value} needs "
                            f"--pipeline-model-parallel-size > 1 and a value of at least 1")
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0:
        raise UserError(f"--decoder-first/last-pipeline-num-layers add up to "
                        f"{(first or 0) + (last or 0)}, more than --num-layers {num_layers}")
    if middle == 0 and rest != 0 or middle > 0 and (rest < middle or rest % middle):
        fixed = "" if first is None and last is None else (
            f" after the first/last stages' {(first or 0) + (last or 0)}")
        raise UserError(f"{rest} remaining layers{fixed} of --num-layers {num_layers} do not "
                        f"split evenly over {middle} pipeline stages; change "
                        f"--pipeline-model-parallel-size or set "
                        f"--decoder-first/last-pipeline-num-layers, or write a plan file")
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


def plan_from_megatron_flags(model: ModelConfig, world_size: int, tp: int, pp: int,
                             micro_batch_size: int, global_batch_size: int,
                             decoder_first_pipeline_num_layers: Optional[int] = None,
                             decoder_last_pipeline_num_layers: Optional[int] = None,
                             accelerator_of: AcceleratorOf = "cpu",
                             recompute: bool = False) -> ParallelPlan:
    """The plan Megatron-LM's flags describe: dp = world / (tp * pp) identical pipelines.

    ``accelerator_of`` names each rank's kind: a ClusterSpec, a callable rank -> name (or
    AcceleratorSpec), or one name for all ranks. Every stage must hold one kind; a mixed
    cluster needs a plan file. Each pipeline gets global / (micro_batch_size * dp)
    micro-batches. The result is validated against ``model`` (and the cluster, if given).
    """
    if tp < 1 or pp < 1 or world_size < 1 or micro_batch_size < 1:
        raise UserError(f"tp ({tp}), pp ({pp}), world size ({world_size}) and micro batch size "
                        f"({micro_batch_size}) must all be at least 1")
    if world_size % (tp * pp):
        raise UserError(f"world size {world_size} is not divisible by --tensor-model-parallel-size"
                        f" {tp} x --pipeline-model-parallel-size {pp} = {tp * pp}; pick tp and pp "
                        f"whose product divides {world_size}")
    cluster = accelerator_of if isinstance(accelerator_of, ClusterSpec) else None
    if cluster is not None and cluster.world_size != world_size:
        raise UserError(f"world size {world_size} differs from cluster {cluster.name}'s "
                        f"{cluster.world_size} ranks; launch {cluster.world_size} ranks")
    dp = world_size // (tp * pp)
    if global_batch_size % (micro_batch_size * dp):
        raise UserError(f"--global-batch-size {global_batch_size} is not divisible by "
                        f"--micro-batch-size {micro_batch_size} x data-parallel size {dp} = "
                        f"{micro_batch_size * dp}; use a multiple of {micro_batch_size * dp}")
    layer_ranges = megatron_layer_split(model.num_layers, pp, decoder_first_pipeline_num_layers,
                                        decoder_last_pipeline_num_layers)
    name_of = _accelerator_lookup(accelerator_of)
    pipelines = []
    for d in range(dp):
        stages = []
        for p, layers in enumerate(layer_ranges):
            ranks = tuple(megatron_rank(t, d, p, tp, dp) for t in range(tp))
            kinds = sorted({name_of(r) for r in ranks})
            if len(kinds) > 1:
                raise UserError(f"Megatron's rank order puts ranks {list(ranks)} "
                                f"({', '.join(kinds)}) in one TP group; a mixed cluster needs a "
                                f"--plan file")
            stages.append(StagePlan(accelerator=kinds[0], tp=tp, layers=layers, ranks=ranks,
                                    recompute=recompute))
        pipelines.append(PipelinePlan(global_batch_size // (micro_batch_size * dp),
                                      tuple(stages)))
    plan = ParallelPlan(micro_batch_size=micro_batch_size, pipelines=tuple(pipelines))
    validate(plan, model, cluster, global_batch_size)
    return plan
