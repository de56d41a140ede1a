"""The search space of the planner: pipeline layouts over accelerator kinds, and their plans.

A :class:`Layout` fixes everything but the layer split: the DP degree, the order in which the
accelerator kinds follow each other along every pipeline (HETHUB style: the first stages on one
kind, the next on another), the TP degree and number of stages of each kind, the micro-batch
size, recompute per kind, ZeRO-1, the interleaving degree (``num_chunks`` model chunks per
device group, run with interleaved 1F1B) and sequence parallelism (on every stage with
tp > 1). Every DP replica is the same pipeline, so the plan format's rule (same layer ranges
and TP per stage in all pipelines) holds by construction, and every device of the cluster is
used: the stages of kind ``k`` hold ``count(k) / dp`` devices of every pipeline.

A kind's stages use one TP degree (:func:`pipeline_shapes`; two, ``2 t`` on all its stages but
one of ``t``, where its share is an odd multiple of ``t``). Interleaved layouts take the same
shapes: a group count that does not divide the micro-batches runs in micro-batch groups
(HETHUB's 16 + 80 devices per pipeline make 2 + 10 = 12 groups at tp 8 for 128
micro-batches, run as 8 groups of 16).

Ranks are taken in cluster rank order: pipeline ``d`` gets the ``d``-th contiguous block of each
kind's ranks, cut into TP groups of adjacent ranks in stage order. TP groups therefore stay
inside a node (layouts where one would cross a node are not generated) and consecutive stages
of one kind are neighbours, so stage boundaries cross nodes as rarely as the sizes allow.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_builders import interleave_plan
from megatron_het.parallel.plan_validation import valid_tp_sizes
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan


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
    num_chunks: int = 1
    sequence_parallel: bool = False

    @property
    def num_stages(self) -> int:
        """Stages of the plain plan: the device groups of an interleaved one."""
        return sum(b.stages for b in self.blocks)

    def stage_kinds(self) -> list[KindBlock]:
        """One entry per stage, in pipeline order."""
        return [b for b in self.blocks for _ in range(b.stages)]

    def describe(self) -> str:
        parts = " -> ".join(
            f"{b.stages}x {b.kind} tp={b.tp}{' rc' if b.recompute else ''}" for b in self.blocks
        )
        return (
            f"dp={self.dp} pp={self.num_stages}"
            f"{f' v={self.num_chunks}' if self.num_chunks > 1 else ''} [{parts}] "
            f"mbs={self.micro_batch_size} m={self.micro_batches}"
            f"{' zero1' if self.zero1 else ''}{' sp' if self.sequence_parallel else ''}"
        )


class Placement:
    """The cluster's ranks by kind, in rank order, with their nodes (built once per search)."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self.ranks_of: dict[str, list[int]] = {}
        self.node_of: list[int] = []
        for info in cluster.rank_map():
            self.ranks_of.setdefault(info.accelerator.name, []).append(info.rank)
            self.node_of.append(info.node)
        self._stage_ranks: dict[tuple, tuple[tuple[tuple[int, ...], ...], ...]] = {}
        self._local: dict[tuple, bool] = {}
        # per kind, per position in its rank list: the last position of the run of ranks on
        # the same node (a TP group of consecutive positions is node-local iff it ends there
        # or before)
        self._run_end: dict[str, list[int]] = {}
        for kind, ranks in self.ranks_of.items():
            ends = list(range(len(ranks)))
            for i in range(len(ranks) - 2, -1, -1):
                if self.node_of[ranks[i]] == self.node_of[ranks[i + 1]]:
                    ends[i] = ends[i + 1]
            self._run_end[kind] = ends
        # per kind whose nodes all hold the same number of its ranks, starting at a node
        # boundary: that number (the node pattern repeats with it)
        self._node_period: dict[str, int] = {}
        for kind, ranks in self.ranks_of.items():
            runs = [
                i + 1
                for i, end in enumerate(self._run_end[kind])
                if i == len(ranks) - 1 or end == i
            ]
            sizes = {b - a for a, b in zip([0] + runs[:-1], runs)}
            if len(sizes) == 1:
                self._node_period[kind] = sizes.pop()

    @property
    def kinds(self) -> list[str]:
        """Kind names in order of their first rank."""
        return list(self.ranks_of)

    def count(self, kind: str) -> int:
        return len(self.ranks_of[kind])

    def split_local(self, kind: str, dp: int, parts: Sequence[tuple[int, int]]) -> bool:
        """Whether every TP group of a kind whose pipeline share is ``parts`` ((tp, stages) in
        pipeline order) lies on one node, in every one of the ``dp`` pipelines."""
        key = (kind, dp, tuple(parts))
        if key not in self._local:
            self._local[key] = self._all_local(kind, dp, parts)
        return self._local[key]

    def _all_local(self, kind: str, dp: int, parts: Sequence[tuple[int, int]]) -> bool:
        ends, start = self._run_end[kind], 0
        share = sum(tp * stages for tp, stages in parts)
        period = self._node_period.get(kind)
        if period:  # pipeline d sees the node pattern shifted by d * share mod period
            dp = min(dp, period // math.gcd(share, period))
        for _ in range(dp):
            for tp, stages in parts:
                for _ in range(stages):
                    if ends[start] < start + tp - 1:
                        return False
                    start += tp
        return True

    def distinct_pipelines(self, layout: Layout) -> list[int]:
        """One pipeline of each crossing pattern: replicas whose every stage boundary stays
        in or leaves its node alike and whose TP groups match run alike (the first of each,
        in pipeline order)."""
        seen: dict[tuple, int] = {}
        node = self.node_of
        for d, stages in enumerate(self.stage_ranks(layout)):
            key = tuple(node[a[-1]] == node[b[0]] for a, b in zip(stages, stages[1:]))
            seen.setdefault(key, d)
        return sorted(seen.values())

    def stage_ranks(self, layout: Layout) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """``[pipeline][stage]`` -> the stage's TP group, in tp_rank order (a kind's blocks
        take consecutive ranks of its pipeline share); memoized by the layout's shape (a
        search builds each shape's plans and probes many times)."""
        key = (layout.dp, tuple((b.kind, b.tp, b.stages) for b in layout.blocks))
        if key not in self._stage_ranks:
            self._stage_ranks[key] = self._assign(layout)
        return self._stage_ranks[key]

    def _assign(self, layout: Layout) -> tuple[tuple[tuple[int, ...], ...], ...]:
        share: dict[str, int] = {}
        for block in layout.blocks:
            share[block.kind] = share.get(block.kind, 0) + block.stages * block.tp
        out = []
        for d in range(layout.dp):
            taken = {kind: d * n for kind, n in share.items()}
            stages = []
            for block in layout.blocks:
                ranks = self.ranks_of[block.kind]
                for _ in range(block.stages):
                    start = taken[block.kind]
                    stages.append(tuple(ranks[start : start + block.tp]))
                    taken[block.kind] = start + block.tp
            out.append(tuple(stages))
        return tuple(out)


def build_plan(
    layout: Layout,
    layers: Sequence[int],
    placement: Placement,
    dtype: str | None = None,
    description: str = "",
) -> ParallelPlan:
    """The plan of ``layout`` with ``layers[s]`` decoder layers on stage ``s`` (ranges are cut
    in order from layer 0; the counts need not sum to the model's layers for probes)."""
    ranks = placement.stage_ranks(layout)
    kinds, last = layout.stage_kinds(), layout.num_stages - 1
    ends = list(itertools.accumulate(layers[: len(kinds)]))
    spans = [
        (block.kind, block.tp, (end - n, end), s == 0, s == last, block.recompute)
        for s, (block, n, end) in enumerate(zip(kinds, layers, ends))
    ]
    stage, pipeline = StagePlan.trusted, PipelinePlan.trusted  # built valid: no checks
    pipelines = tuple(
        pipeline(
            layout.micro_batches,
            tuple(
                stage(kind, tp, span, group, first, head, recompute)
                for (kind, tp, span, first, head, recompute), group in zip(spans, ranks[d])
            ),
        )
        for d in range(layout.dp)
    )
    plan = ParallelPlan(
        layout.micro_batch_size,
        pipelines,
        dtype=dtype,
        use_distributed_optimizer=layout.zero1,
        sequence_parallel=layout.sequence_parallel or None,
        tp_comm_overlap=layout.sequence_parallel or None,
        description=description,
    )
    return interleave_plan(plan, layout.num_chunks)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kind_shapes(
    model: ModelConfig, placement: Placement, dp: int, max_tp: int
) -> dict[str, list[tuple[tuple[int, int], ...]]]:
    """Per kind, the ``(tp, stages)`` parts of one pipeline's share of its devices, TP groups
    node-local, ``max_tp`` capping the degree: ``D / t`` stages of every ``t`` that divides
    the share ``D``, and where ``D / t`` is odd and above 1 also ``(D / t - 1) / 2`` stages of
    ``2 t`` and one of ``t`` (a share of 3 or 5 devices can still use TP 2, and an odd count
    of 8-device nodes TP 16 ... on all but one stage)."""
    tps = [t for t in valid_tp_sizes(model) if t <= max_tp]
    out = {}
    for kind in placement.kinds:
        share = placement.count(kind) // dp
        options: list[tuple[tuple[int, int], ...]] = []
        for t in tps:
            if share % t:
                continue
            units = share // t
            candidates: list[tuple[tuple[int, int], ...]] = [((t, units),)]
            if units % 2 and units > 1 and 2 * t in tps:
                candidates.append(((2 * t, units // 2), (t, 1)))
            for parts in candidates:
                if sum(n for _, n in parts) <= model.num_layers and placement.split_local(
                    kind, dp, parts
                ):
                    options.append(parts)
        out[kind] = options
    return out


def pipeline_shapes(
    model: ModelConfig, placement: Placement, max_tp: int = 64
) -> Iterator[tuple[int, tuple[KindBlock, ...]]]:
    """Every (dp, blocks in pipeline order) whose stage count fits the model's layers
    (:func:`kind_shapes` per kind); the kinds are permuted (which kind holds the embedding
    matters), a kind's wider block first."""
    counts = [placement.count(k) for k in placement.kinds]
    for dp in divisors(math.gcd(*counts)):
        shapes = kind_shapes(model, placement, dp, max_tp)
        for choice in itertools.product(*(shapes[k] for k in placement.kinds)):
            if sum(n for parts in choice for _, n in parts) > model.num_layers:
                continue
            groups = [
                tuple(KindBlock(k, tp, n) for tp, n in parts)
                for k, parts in zip(placement.kinds, choice)
            ]
            for order in itertools.permutations(groups):
                yield dp, tuple(b for group in order for b in group)


def micro_batch_sizes(global_batch_size: int, dp: int, max_micro_batch_size: int) -> list[int]:
    """Micro-batch sizes that split each pipeline's share of the batch evenly."""
    if global_batch_size % dp:
        return []
    share = global_batch_size // dp
    return [b for b in divisors(share) if b <= max_micro_batch_size]


__all__ = [
    "KindBlock",
    "Layout",
    "Placement",
    "build_plan",
    "divisors",
    "kind_shapes",
    "micro_batch_sizes",
    "pipeline_shapes",
]
