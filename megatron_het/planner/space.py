"""The search space of the planner: pipeline layouts over accelerator kinds, and their plans.

A :class:`Layout` fixes everything but the layer split: the DP degree, the order in which the
accelerator kinds follow each other along every pipeline (HETHUB style: the first stages on one
kind, the next on another), the TP degree and number of stages of each kind, the micro-batch
size, recompute per kind and ZeRO-1. Every DP replica is the same pipeline, so the plan format's
rule (same layer ranges and TP per stage in all pipelines) holds by construction, and every
device of the cluster is used: ``dp * stages[k] * tp[k]`` equals the count of kind ``k``.

Ranks are taken in cluster rank order: pipeline ``d`` gets the ``d``-th contiguous block of each
kind's ranks, cut into TP groups of adjacent ranks in stage order. TP groups therefore stay
inside a node (layouts where one would cross a node are not generated) and consecutive stages
of one kind are neighbours, so stage boundaries cross nodes as rarely as the sizes allow.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.parallel.plan import ParallelPlan, PipelinePlan, StagePlan
from megatron_het.parallel.plan_validation import valid_tp_sizes


@dataclass(frozen=True)
class KindBlock:
    """``stages`` consecutive stages of accelerator ``kind``, each on ``tp`` devices."""

    kind: str
    tp: int
    stages: int
    recompute: bool = False


@dataclass(frozen=True)
class Layout:
    """A plan without its layer split. ``blocks`` are in pipeline order (first holds the
    embedding, last the head); ``micro_batches`` is per pipeline."""

    dp: int
    blocks: tuple[KindBlock, ...]
    micro_batch_size: int
    micro_batches: int
    zero1: bool

    @property
    def num_stages(self) -> int:
        return sum(b.stages for b in self.blocks)

    def stage_kinds(self) -> list[KindBlock]:
        """One entry per stage, in pipeline order."""
        return [b for b in self.blocks for _ in range(b.stages)]

    def describe(self) -> str:
        parts = " -> ".join(f"{b.stages}x {b.kind} tp={b.tp}{' rc' if b.recompute else ''}"
                            for b in self.blocks)
        return (f"dp={self.dp} pp={self.num_stages} [{parts}] mbs={self.micro_batch_size} "
                f"m={self.micro_batches}{' zero1' if self.zero1 else ''}")


class Placement:
    """The cluster's ranks by kind, in rank order, with their nodes (built once per search)."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self.ranks_of: dict[str, list[int]] = {}
        self.node_of: list[int] = []
        for info in cluster.rank_map():
            self.ranks_of.setdefault(info.accelerator.name, []).append(info.rank)
            self.node_of.append(info.node)

    @property
    def kinds(self) -> list[str]:
        """Kind names in order of their first rank."""
        return list(self.ranks_of)

    def count(self, kind: str) -> int:
        return len(self.ranks_of[kind])

    def node_local(self, kind: str, per_pipeline: int, tp: int) -> bool:
        """Whether every TP group of ``tp`` adjacent ranks of ``kind`` lies on one node."""
        ranks = self.ranks_of[kind]
        for start in range(0, len(ranks), tp):
            group = ranks[start:start + tp]
            if len({self.node_of[r] for r in group}) > 1:
                return False
        return per_pipeline % tp == 0

    def stage_ranks(self, layout: Layout) -> list[list[tuple[int, ...]]]:
        """``[pipeline][stage]`` -> the stage's TP group, in tp_rank order."""
        out = []
        for d in range(layout.dp):
            stages = []
            for block in layout.blocks:
                ranks = self.ranks_of[block.kind]
                per_pipeline = block.stages * block.tp
                mine = ranks[d * per_pipeline:(d + 1) * per_pipeline]
                stages += [tuple(mine[j * block.tp:(j + 1) * block.tp])
                           for j in range(block.stages)]
            out.append(stages)
        return out


def build_plan(layout: Layout, layers: Sequence[int], placement: Placement,
               dtype: str | None = None, description: str = "") -> ParallelPlan:
    """The plan of ``layout`` with ``layers[s]`` decoder layers on stage ``s`` (ranges are cut
    in order from layer 0; the counts need not sum to the model's layers for probes)."""
    ranks = placement.stage_ranks(layout)
    kinds = layout.stage_kinds()
    pipelines = []
    for d in range(layout.dp):
        stages, start = [], 0
        for s, block in enumerate(kinds):
            stages.append(StagePlan(block.kind, block.tp, (start, start + layers[s]), ranks[d][s],
                                    recompute=block.recompute))
            start += layers[s]
        pipelines.append(PipelinePlan(layout.micro_batches, tuple(stages)))
    return ParallelPlan(layout.micro_batch_size, tuple(pipelines), dtype=dtype,
                        use_distributed_optimizer=layout.zero1, description=description)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kind_shapes(model: ModelConfig, placement: Placement, dp: int,
                max_tp: int) -> dict[str, list[tuple[int, int]]]:
    """Per kind, the (tp, stages) pairs that use all of that kind's devices of one pipeline
    with node-local TP groups; ``max_tp`` caps the TP degree."""
    tps = [t for t in valid_tp_sizes(model) if t <= max_tp]
    out = {}
    for kind in placement.kinds:
        per_pipeline = placement.count(kind) // dp
        out[kind] = [(t, per_pipeline // t) for t in tps
                     if per_pipeline % t == 0 and per_pipeline // t <= model.num_layers
                     and placement.node_local(kind, per_pipeline, t)]
    return out


def pipeline_shapes(model: ModelConfig, placement: Placement, max_tp: int = 64
                    ) -> Iterator[tuple[int, tuple[KindBlock, ...]]]:
    """Every (dp, blocks in pipeline order) whose stage count fits the model's layers; the
    kinds are permuted (which kind holds the embedding matters)."""
    counts = [placement.count(k) for k in placement.kinds]
    for dp in divisors(math.gcd(*counts)):
        shapes = kind_shapes(model, placement, dp, max_tp)
        for choice in itertools.product(*(shapes[k] for k in placement.kinds)):
            if sum(stages for _, stages in choice) > model.num_layers:
                continue
            blocks = [KindBlock(k, tp, stages) for k, (tp, stages) in
                      zip(placement.kinds, choice)]
            for order in itertools.permutations(blocks):
                yield dp, tuple(order)


def micro_batch_sizes(global_batch_size: int, dp: int, max_micro_batch_size: int) -> list[int]:
    """Micro-batch sizes that split each pipeline's share of the batch evenly."""
    if global_batch_size % dp:
        return []
    share = global_batch_size // dp
    return [b for b in divisors(share) if b <= max_micro_batch_size]


__all__ = ["KindBlock", "Layout", "Placement", "build_plan", "divisors", "kind_shapes",
           "micro_batch_sizes", "pipeline_shapes"]
