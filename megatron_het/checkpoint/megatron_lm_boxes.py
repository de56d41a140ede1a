"""One rank's boxes of a Megatron-LM ``torch_dist`` checkpoint, read without the rest.

A run that loads a Megatron-LM save (``pretrain_llama.py --load``) needs, on each rank, only the
TP slices of the parameters its stage holds (and of Adam's state and main weights when it
carries the optimizer). torch_dist stores every tensor at its global shape in chunks that
torch.distributed.checkpoint indexes, so each such box maps to a box of one megatron-core
tensor (see the key table in :mod:`~megatron_het.checkpoint.megatron_lm_dist`):

* ``embedding.weight``, ``output.weight``, ``final_norm.weight``: the same box of
  ``embedding.word_embeddings.weight`` / ``output_layer.weight`` / ``decoder.final_layernorm``
  (the vocabulary rows a run keeps come before the padding rows);
* ``layers.i.<x>``: the box at layer ``i`` of the stacked key (``[L, ...]``) or the box of the
  per-layer key ``decoder.layers.i.…``, whichever the save holds;
* ``layers.i.mlp.gate`` / ``up``: rows ``r`` / ``F + r`` of ``linear_fc1`` (its global rows are
  the whole gate, then the whole up), or the box of the ``weight_w`` / ``weight_v`` halves.

:func:`read_boxes` plans those reads (:class:`_BoxPlanner`, torch's resharding reads for a
chunk at given offsets; a stage's layers of a stacked key as one box, since torch's reader
deserialises a saved chunk whole for every read inside it) and reads them through the checked
reader, so a rank holds its own slices, not the model. What it reads from disk is the saved
chunks its boxes overlap: megatron-core's multi-rank saves chunk each tensor by the writing
ranks' shards; a single-process save (ours) has one chunk per tensor.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_het.checkpoint.megatron_lm_dist import check_files, model_key
from megatron_het.checkpoint.megatron_lm_files import CheckedReader
from megatron_het.checkpoint.megatron_lm_names import (
    EMBEDDING,
    FC1,
    FINAL_NORM,
    LAYER_TENSORS,
    NORMS,
    OUTPUT,
)
from megatron_het.checkpoint.reshard import Box
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError

_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
_GLOBALS = {"embedding.weight": EMBEDDING, "output.weight": OUTPUT, "final_norm.weight": FINAL_NORM}
# Our per-layer suffix -> the megatron-core suffixes that hold it (either naming).
_SOURCES: dict[str, list[str]] = {}
for _naming in NORMS.values():
    for _theirs, _ours in _naming.items():
        _SOURCES.setdefault(_ours, []).append(_theirs)
for _theirs, (_ours, _) in LAYER_TENSORS.items():
    _SOURCES.setdefault(_ours, []).append(_theirs)
_HALVES = {"mlp.gate.weight": (f"{FC1}_w", 0), "mlp.up.weight": (f"{FC1}_v", 1)}


@dataclasses.dataclass(frozen=True)
class _Read:
    """Box ``(offsets, shape)`` of megatron-core tensor ``key``, read into a tensor of that
    shape; ``squeeze`` drops the stacked layer axis after."""

    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    squeeze: bool


def _source(name: str, box: Box, cfg: ModelConfig, keys: set[str], prefix: str) -> _Read:
    """Where the box of our parameter ``name`` lives in the save (``keys``: its tensor keys)."""
    offsets, shape = tuple(box[0]), tuple(box[1])
    if name in _GLOBALS:
        return _Read(prefix + _GLOBALS[name], offsets, shape, False)
    match = _LAYER_NAME.fullmatch(name)
    if match is None:
        raise UserError(f"{name} has no place in a megatron-core Llama checkpoint")
    layer, ours = int(match.group(1)), match.group(2)
    candidates: list[tuple[str, int]] = [(s, 0) for s in _SOURCES.get(ours, [])]
    if ours in _HALVES:
        half, index = _HALVES[ours]
        candidates = [(FC1, index * cfg.ffn_hidden_size), (half, 0)]
    for suffix, row in candidates:
        shifted = (offsets[0] + row, *offsets[1:])
        stacked = f"{prefix}decoder.layers.{suffix}"
        if stacked in keys:
            return _Read(stacked, (layer, *shifted), (1, *shape), True)
        single = f"{prefix}decoder.layers.{layer}.{suffix}"
        if single in keys:
            return _Read(single, shifted, shape, False)
    raise UserError(
        f"the checkpoint has no tensor for {name} (looked for "
        f"{', '.join(f'{prefix}decoder.layers.[{layer}.]{s}' for s, _ in candidates)}); "
        "copy the whole iteration directory again"
    )


def _bounding(reads: list[_Read]) -> _Read:
    """The smallest box of their key holding every one of ``reads`` (boxes of one key)."""
    starts = [min(r.offsets[d] for r in reads) for d in range(len(reads[0].offsets))]
    stops = [max(r.offsets[d] + r.shape[d] for r in reads) for d in range(len(starts))]
    shape = tuple(b - a for a, b in zip(starts, stops, strict=True))
    return _Read(reads[0].key, tuple(starts), shape, False)


class _BoxPlanner(dcp.DefaultLoadPlanner):
    """Reads each target tensor from its box of a saved global tensor: ``reads`` maps each
    target's name to its :class:`_Read` (several targets may read boxes of one key)."""

    def __init__(self, reads: dict[str, _Read]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.reads = reads

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        requests = []
        for target, read in self.reads.items():
            saved = self.metadata.state_dict_metadata[read.key]
            assert isinstance(saved, dcp_metadata.TensorStorageMetadata)
            chunk = dcp_metadata.ChunkStorageMetadata(
                offsets=torch.Size(read.offsets), sizes=torch.Size(read.shape)
            )
            # The target is a plain tensor of the box's shape: its reads land at offsets
            # within it (dest_offsets), so it is looked up by name alone.
            for item in create_read_items_for_chunk_list(read.key, saved, [chunk]):
                requests.append(dataclasses.replace(item, dest_index=MetadataIndex(target)))
        return LoadPlan(requests)


def _check_box(read: _Read, saved: dcp_metadata.TensorStorageMetadata, source: str) -> None:
    size = tuple(saved.size)
    inside = len(size) == len(read.offsets) and all(
        0 <= o and o + s <= n for o, s, n in zip(read.offsets, read.shape, size, strict=True)
    )
    if not inside:
        raise UserError(
            f"{source}: {read.key} has shape {size}, which does not hold the box at "
            f"{read.offsets} of shape {read.shape} this run needs; the checkpoint does not "
            "match its args"
        )


def read_boxes(
    directory: pathlib.Path,
    cfg: ModelConfig,
    boxes: dict[str, Box],
    metadata: dcp_metadata.Metadata,
    prefix: str = "",
) -> tuple[dict[str, torch.Tensor], int]:
    """The box of each of our parameters in ``boxes`` (name -> ``(offsets, shape)`` in our
    global tensor) from the torch_dist iteration ``directory``, at the saved dtype; with
    ``prefix`` (e.g. ``optimizer.state.exp_avg.``) from the tensors stored under it. Returns
    the tensors by our names and the bytes they hold. Reads nothing else; no process group is
    used. Raises UserError (one line) for a key the save lacks, a box outside its tensor or a
    damaged file."""
    source = str(directory)
    tensor_keys = {
        key
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, dcp_metadata.TensorStorageMetadata)
    }
    for key in tensor_keys:
        if key.startswith(prefix):
            model_key(key[len(prefix) :], source)  # refuses a model we cannot hold
    reads = {name: _source(name, box, cfg, tensor_keys, prefix) for name, box in boxes.items()}
    # torch's reader deserialises a saved chunk whole for every read of a box inside it, so
    # the layers a stage needs of a stacked key (the same box in each layer) are read as one
    # box spanning them, then cut apart.
    groups: dict[tuple, list[str]] = {}
    for name, read in reads.items():
        same = (read.key, read.offsets[1:], read.shape[1:]) if read.squeeze else (name,)
        groups.setdefault(same, []).append(name)
    bounds: dict[str, _Read] = {}  # target -> the box it reads
    target_of: dict[str, str] = {}  # our name -> its target
    for index, names in enumerate(groups.values()):
        bound = _bounding([reads[n] for n in names])
        target = f"{bound.key}#{index}"
        bounds[target] = bound
        target_of.update((n, target) for n in names)
    for read in reads.values():
        saved = metadata.state_dict_metadata[read.key]
        assert isinstance(saved, dcp_metadata.TensorStorageMetadata)
        _check_box(read, saved, source)
    targets = {}
    for target, bound in bounds.items():
        saved = metadata.state_dict_metadata[bound.key]
        assert isinstance(saved, dcp_metadata.TensorStorageMetadata)
        targets[target] = torch.empty(bound.shape, dtype=saved.properties.dtype)
    check_files(directory, metadata, {bound.key for bound in bounds.values()})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                targets,
                storage_reader=CheckedReader(directory, metadata),
                planner=_BoxPlanner(bounds),
                no_dist=True,
            )
    except (CheckpointException, OSError, RuntimeError, ValueError, EOFError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise UserError(
            f"cannot read the tensors of {source} ({first_line}); it is damaged, copy it again"
        ) from None
    out: dict[str, torch.Tensor] = {}
    for name, read in reads.items():
        target = target_of[name]
        start = bounds[target].offsets
        cut = tuple(
            slice(o - a, o - a + n) for o, a, n in zip(read.offsets, start, read.shape, strict=True)
        )
        box = targets[target][cut]
        out[name] = (box[0] if read.squeeze else box).clone()
    return out, sum(t.numel() * t.element_size() for t in targets.values())
