"""A pipeline's stages: which layers, TP degree, ranks and accelerator each stage has.

A stage holds a half-open range ``[start, end)`` of global decoder-layer indices; a bound may
fall inside a layer, between its attention block (input norm, attention) and its MLP block
(post-attention norm, MLP): ``x.5`` is that point of layer ``x`` (the block helpers below).
The ranks of a stage are its tensor-parallel group in tp_rank order. Stages that share ranks
are interleaved chunks of one device group (:class:`PipelinePlan`); :class:`RankRole` is one
rank's place in a plan. The whole plan and its file: :mod:`megatron_het.parallel.plan`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

# The two blocks of a decoder layer, in order; a half-layer bound falls between them.
ATTENTION_BLOCK, MLP_BLOCK = "attention", "mlp"
LAYER_PARTS = (ATTENTION_BLOCK, MLP_BLOCK)
# A decoder layer's parameters (names inside the layer), in the order the model registers them.
LAYER_PARAMETERS = (
    "input_norm.weight",
    "attention.qkv.weight",
    "attention.proj.weight",
    "post_attention_norm.weight",
    "mlp.gate.weight",
    "mlp.up.weight",
    "mlp.down.weight",
)
# A layer's parameters of its MLP block start with these (the rest are its attention block's).
_MLP_PREFIXES = ("post_attention_norm.", "mlp.")

LayerBound = float  # an int, or an int + 0.5 (a half-layer bound)


def part_of(local_name: str) -> str:
    """The block (ATTENTION_BLOCK or MLP_BLOCK) of a layer parameter, by its name inside the
    layer (``mlp.up.weight`` -> MLP_BLOCK, ``input_norm.weight`` -> ATTENTION_BLOCK)."""
    return MLP_BLOCK if local_name.startswith(_MLP_PREFIXES) else ATTENTION_BLOCK


def block_of(name: str) -> int:
    """The position of a global ``layers.<i>.*`` parameter in half-layer blocks: ``2 i`` for
    layer ``i``'s attention block, ``2 i + 1`` for its MLP block."""
    _, index, local = name.split(".", 2)
    return 2 * int(index) + (part_of(local) == MLP_BLOCK)


def layer_parts(layers: tuple[LayerBound, LayerBound], index: int) -> tuple[str, ...]:
    """The blocks of layer ``index`` that the range ``layers`` holds (empty if none)."""
    first, end = round(2 * layers[0]), round(2 * layers[1])
    return tuple(part for half, part in enumerate(LAYER_PARTS) if first <= 2 * index + half < end)


def held_parameters(layers: tuple[LayerBound, LayerBound], index: int) -> tuple[str, ...]:
    """The parameters of layer ``index`` (names inside the layer) that the range ``layers``
    holds, in :data:`LAYER_PARAMETERS` order."""
    parts = layer_parts(layers, index)
    return tuple(local for local in LAYER_PARAMETERS if part_of(local) in parts)


def block_counts(layers: tuple[LayerBound, LayerBound]) -> tuple[int, int]:
    """How many attention blocks and MLP blocks the range ``layers`` holds."""
    first, end = round(2 * layers[0]), round(2 * layers[1])
    attention = (end + 1) // 2 - (first + 1) // 2
    return attention, (end - first) - attention


def format_bound(bound: LayerBound) -> str:
    """``3`` -> "3", ``3.5`` -> "3.5"."""
    return str(int(bound)) if bound == int(bound) else str(bound)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: ``tp`` ranks of one accelerator kind holding layers ``[start, end)``
    (each bound an integer or a half-layer bound ``x.5``, see the module's text).

    ``ranks`` is the stage's TP group in tp_rank order. ``has_embedding`` / ``has_head`` follow
    the stage's position: :class:`PipelinePlan` sets them for its first and last stage.
    ``recompute``: activation recompute on the stage's first ``recompute_num_layers`` decoder
    layers (None: all of them; :attr:`recomputed_layers`).
    """

    accelerator: str
    tp: int
    layers: tuple[LayerBound, LayerBound]
    ranks: tuple[int, ...]
    has_embedding: bool = False
    has_head: bool = False
    recompute: bool = False
    recompute_num_layers: int | None = None

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if type(layers[0]) is not int or type(layers[1]) is not int:
            # A whole bound given as a float (2.0) is kept as the int it is.
            layers = tuple(int(b) if b == int(b) else float(b) for b in layers)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "ranks", tuple(self.ranks))

    @classmethod
    def trusted(
        cls,
        accelerator: str,
        tp: int,
        layers: tuple[LayerBound, LayerBound],
        ranks: tuple[int, ...],
        has_embedding: bool,
        has_head: bool,
        recompute: bool,
        recompute_num_layers: int | None = None,
    ) -> StagePlan:
        """The same stage as the constructor's, built without its conversions: for callers
        that build many stages at once from tuples (a planner's probes of thousands of
        devices)."""
        stage = object.__new__(cls)
        stage.__dict__.update(
            accelerator=accelerator,
            tp=tp,
            layers=layers,
            ranks=ranks,
            has_embedding=has_embedding,
            has_head=has_head,
            recompute=recompute,
            recompute_num_layers=recompute_num_layers,
        )
        return stage

    @property
    def num_layers(self) -> LayerBound:
        """``end - start``: a half-layer bound counts each of a layer's blocks as half a layer
        (cost models weigh the blocks by their real work, :attr:`block_counts`)."""
        return self.layers[1] - self.layers[0]

    @property
    def splits_layers(self) -> bool:
        """Whether a bound falls inside a layer (the stage holds one block of it)."""
        return any(bound != int(bound) for bound in self.layers)

    @property
    def block_counts(self) -> tuple[int, int]:
        """How many attention blocks and MLP blocks the stage holds."""
        return block_counts(self.layers)

    def layer_parts(self, index: int) -> tuple[str, ...]:
        """The blocks (ATTENTION_BLOCK, MLP_BLOCK) of layer ``index`` that the stage holds."""
        return layer_parts(self.layers, index)

    @property
    def recomputed_layers(self) -> LayerBound:
        """How many of the stage's decoder layers recompute their activations in backward:
        the first ``recompute_num_layers`` (all where None) when ``recompute``, else 0."""
        if not self.recompute:
            return 0
        if self.recompute_num_layers is None:
            return self.num_layers
        return min(self.recompute_num_layers, self.num_layers)

    @property
    def recompute_label(self) -> str:
        """How descriptions name the stage's recompute: ``recompute``, ``recompute 2 of 4
        layers`` (block method) or empty (none)."""
        if not self.recompute:
            return ""
        if self.recompute_num_layers is None:
            return "recompute"
        return f"recompute {self.recomputed_layers} of {self.num_layers} layers"

    @property
    def layer_indices(self) -> range:
        """The global indices of the decoder layers of which this stage holds a block or both."""
        return range(math.floor(self.layers[0]), math.ceil(self.layers[1]))

    @property
    def layers_label(self) -> str:
        """``[3, 5.5)``: the stage's range as logs and reports print it."""
        return f"[{format_bound(self.layers[0])}, {format_bound(self.layers[1])})"


@dataclass(frozen=True)
class PipelinePlan:
    """One DP replica: ``micro_batches`` micro-batches per iteration through ``stages`` in order.

    Construction sets ``has_embedding`` on the first stage and ``has_head`` on the last (and
    clears them elsewhere), so the flags always match the positions.
    """

    micro_batches: int
    stages: tuple[StagePlan, ...]

    def __post_init__(self) -> None:
        last = len(self.stages) - 1
        stages = tuple(
            stage
            if (stage.has_embedding, stage.has_head) == (i == 0, i == last)
            else dataclasses.replace(stage, has_embedding=i == 0, has_head=i == last)
            for i, stage in enumerate(self.stages)
        )
        object.__setattr__(self, "stages", stages)

    @classmethod
    def trusted(cls, micro_batches: int, stages: tuple[StagePlan, ...]) -> PipelinePlan:
        """The same pipeline as the constructor's for ``stages`` whose first stage alone has
        ``has_embedding`` and last alone ``has_head`` (not checked): a planner's fast path."""
        pipeline = object.__new__(cls)
        pipeline.__dict__.update(micro_batches=micro_batches, stages=stages)
        return pipeline

    @functools.cached_property
    def device_groups(self) -> tuple[tuple[int, ...], ...]:
        """The distinct stage rank lists, in order of first appearance (pipeline rank order)."""
        return tuple(dict.fromkeys(stage.ranks for stage in self.stages))

    @property
    def pp_size(self) -> int:
        """The number of device groups (Megatron's pipeline-parallel size)."""
        return len(self.device_groups)

    @property
    def num_stages(self) -> int:
        """The number of model chunks (``pp_size * num_chunks`` in a valid plan)."""
        return len(self.stages)

    @property
    def num_chunks(self) -> int:
        """Model chunks per device group (1: not interleaved)."""
        return len(self.stages) // max(1, self.pp_size)

    @property
    def interleaved(self) -> bool:
        return len(self.stages) > self.pp_size

    def group_stages(self, group: int) -> tuple[int, ...]:
        """The stage indices device group ``group`` runs, in pipeline order."""
        ranks = self.device_groups[group]
        return tuple(s for s, stage in enumerate(self.stages) if stage.ranks == ranks)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank of this pipeline, device group by group, each in tp_rank order."""
        return tuple(rank for group in self.device_groups for rank in group)


@dataclass(frozen=True)
class RankRole:
    """What one rank does: its pipeline (DP replica), stage, tp_rank and the stage's plan.

    ``stage`` is the rank's device group (its pipeline rank), which is also the index of the
    first stage it runs; ``chunks`` lists every stage index it runs (one unless interleaved),
    ``chunk_plans`` their plans. ``stage_plan`` is the first one's (kind, tp and ranks are the
    same for all of them).
    """

    pipeline: int
    stage: int
    tp_rank: int
    stage_plan: StagePlan
    chunks: tuple[int, ...] = ()
    chunk_plans: tuple[StagePlan, ...] = ()

    def __post_init__(self) -> None:
        if not self.chunks:
            object.__setattr__(self, "chunks", (self.stage,))
            object.__setattr__(self, "chunk_plans", (self.stage_plan,))

    @property
    def is_first_stage(self) -> bool:
        """Runs the pipeline's first stage (holds the embedding)."""
        return self.chunk_plans[0].has_embedding

    @property
    def is_last_stage(self) -> bool:
        """Runs the pipeline's last stage (holds the head)."""
        return self.chunk_plans[-1].has_head
