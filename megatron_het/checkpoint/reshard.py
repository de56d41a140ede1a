"""Resharding between parallel plans, as pure functions over slices of global tensors.

Every tensor a checkpoint stores is a *piece* of a global (single-process shaped) tensor: a
box given by its ``offsets`` and ``shape`` inside ``global_shape``. A rank of any plan needs
one box per parameter (its TP slice, from :func:`target_slice`). Loading under another plan is
then: find the saved pieces whose boxes intersect the needed box (:func:`covering_pieces`),
copy each intersection into place (:func:`assemble_slice`), and check that nothing of the box
was left uncovered. No full tensor is materialised unless the needed box is the whole tensor.

Which parameters a rank of a plan holds and which of them it writes (:func:`stage_parameter_names`,
:func:`written_names`) are also computed here from the plan alone, so an offline tool can lay a
checkpoint out exactly as a running plan would save it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import StagePlan, held_parameters
from megatron_het.tensor_parallel.sharding import parameter_shape, shard_spec

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) inside a global tensor


@dataclass(frozen=True)
class SavedPiece:
    """Where one saved piece sits: its box in the global tensor and an opaque ``source`` (e.g.
    the index of the file that holds it)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    source: Any = None


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes of the same tensor, or None when they do not overlap."""
    (a_off, a_shape), (b_off, b_shape) = a, b
    if len(a_off) != len(b_off):
        raise ValueError(f"boxes of different rank: {a} and {b}")
    offsets, shape = [], []
    for ao, asz, bo, bsz in zip(a_off, a_shape, b_off, b_shape):
        start, stop = max(ao, bo), min(ao + asz, bo + bsz)
        if stop <= start:
            return None
        offsets.append(start)
        shape.append(stop - start)
    return tuple(offsets), tuple(shape)


def covering_pieces(
    pieces: Sequence[SavedPiece], offsets: Sequence[int], shape: Sequence[int]
) -> list[SavedPiece]:
    """The saved pieces that overlap the box ``(offsets, shape)``, in their given order.

    A zero-dimensional tensor (empty box) is covered by every piece.
    """
    box = (tuple(offsets), tuple(shape))
    return [p for p in pieces if intersect((p.offsets, p.shape), box) is not None]


def _index(offsets: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, shape))


def assemble_slice(
    name: str,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    shape: Sequence[int],
    pieces: Sequence[tuple[torch.Tensor, Sequence[int]]],
) -> torch.Tensor:
    """The box ``(offsets, shape)`` of global tensor ``name`` built from saved pieces.

    Args:
        name: global parameter name (for error messages).
        global_shape: the full tensor's shape.
        offsets, shape: the box wanted (e.g. a rank's TP slice).
        pieces: ``(tensor, tensor's offsets)`` for saved pieces; pieces not overlapping the box
            are ignored, overlapping duplicates (DP or TP replicas) are harmless.

    Returns a new contiguous tensor with the first overlapping piece's dtype and device. Raises
    UserError when the pieces leave part of the box uncovered or one lies outside the tensor.
    """
    global_shape, offsets, shape = tuple(global_shape), tuple(offsets), tuple(shape)
    box = (offsets, shape)
    out: torch.Tensor | None = None
    covered = torch.zeros(shape, dtype=torch.bool)
    for tensor, piece_offsets in pieces:
        piece_box = (tuple(piece_offsets), tuple(tensor.shape))
        if len(piece_box[0]) != len(global_shape) or any(
            o < 0 or o + s > g for o, s, g in zip(*piece_box, global_shape)
        ):
            raise UserError(
                f"checkpoint tensor {name}: a piece of shape {piece_box[1]} at "
                f"{piece_box[0]} lies outside {global_shape}; the checkpoint is "
                "damaged"
            )
        common = intersect(piece_box, box)
        if common is None:
            continue
        if out is None:
            out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        source = tuple(o - p for o, p in zip(common[0], piece_box[0]))
        target = tuple(o - b for o, b in zip(common[0], offsets))
        out[_index(target, common[1])] = tensor[_index(source, common[1])].to(out.device)
        covered[_index(target, common[1])] = True
    if out is None or not bool(covered.all()):
        raise UserError(
            f"checkpoint tensor {name} is only partly covered by its saved pieces "
            f"(needed offsets {offsets} shape {shape}); the checkpoint is "
            "incomplete, load another one"
        )
    return out


def take_slice(full: torch.Tensor, offsets: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """A contiguous copy of the box ``(offsets, shape)`` of ``full``."""
    return full[_index(offsets, shape)].clone(memory_format=torch.contiguous_format)


def target_slice(name: str, config: ModelConfig, tp: int, tp_rank: int) -> Box:
    """The box of parameter ``name`` held by rank ``tp_rank`` of a stage with ``tp`` ranks."""
    full_shape = parameter_shape(name, config)
    spec = shard_spec(name, config, tp)
    return (spec.offsets(tp_rank, len(full_shape)), tuple(spec.shard_shape(full_shape, tp_rank)))


def stage_parameter_names(config: ModelConfig, stage: StagePlan) -> list[str]:
    """Global names of the parameters a rank of ``stage`` holds.

    With tied embeddings a last stage without the embedding holds its own copy of
    ``embedding.weight`` (see :mod:`megatron_het.model.llama`).
    """
    names = []
    if stage.has_embedding or (stage.has_head and config.tie_embeddings):
        names.append("embedding.weight")
    for index in stage.layer_indices:
        names.extend(f"layers.{index}.{local}" for local in held_parameters(stage.layers, index))
    if stage.has_head:
        names.append("final_norm.weight")
        if not config.tie_embeddings:
            names.append("output.weight")
    return names


def is_written_by(name: str, config: ModelConfig, stage: StagePlan, tp_rank: int) -> bool:
    """Whether a rank of ``stage`` with ``tp_rank`` saves ``name`` (before DP deduplication).

    TP-replicated tensors (norms) are saved by tp_rank 0 only; the last stage's copy of a tied
    embedding is not saved (the first stage's is the same tensor).
    """
    if name == "embedding.weight" and not stage.has_embedding:
        return False
    if shard_spec(name, config, stage.tp).replicated:
        return tp_rank == 0
    return True


def written_names(config: ModelConfig, stage: StagePlan, tp_rank: int) -> list[str]:
    """The names a rank of ``stage`` saves, in :func:`stage_parameter_names` order."""
    return [
        n for n in stage_parameter_names(config, stage) if is_written_by(n, config, stage, tp_rank)
    ]


def rank_writes(config: ModelConfig, plan: ParallelPlan, rank: int) -> dict[str, Box]:
    """``{name: box}`` that ``rank`` of ``plan`` saves when every rank of pipeline 0 writes the
    model and the optimizer state (no ZeRO partition); empty for ranks of other pipelines."""
    role = plan.rank_role(rank)
    if role.pipeline != 0:
        return {}
    return {
        name: target_slice(name, config, stage.tp, role.tp_rank)
        for stage in role.chunk_plans  # every chunk of an interleaved device group
        for name in written_names(config, stage, role.tp_rank)
    }
