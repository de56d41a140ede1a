"""Reading a checkpoint, whatever wrote it: the one reader of the on-disk format.

:class:`CheckpointReader` gives random access to the saved pieces of one iteration directory,
written by a parallel plan (per-rank shards indexed in metadata.json, see
:mod:`megatron_het.checkpoint.sharded`) or by a single process in the earlier format (one shard
of full tensors, the optimizer state by name inside the training state). Files are memory-mapped,
so a reader reads only the pieces asked for, and only the files holding them. Verification
follows what is read (:mod:`megatron_het.checkpoint.verify`): a file's size is checked when it is
first opened; a shard that records its tensors' digests (every shard written since pieces were
recorded) then has each piece hashed the first time one of its boxes is read, so a rank hashes
the pieces it uses and no others; any other recorded file (training state, shards of older
checkpoints) is hashed whole when opened; checkpoints written without records are not verified.
:func:`load_model_state` and :func:`load_train_state` assemble FULL tensors and the full
optimizer state from it, for tools and for loading weights outside a run.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from megatron_het.checkpoint.integrity import (
    FILES_KEY,
    TRAIN_STATE_MOMENTS,
    is_train_state_moment,
    optimizer_key,
    tensor_nbytes,
    tensor_paths,
)
from megatron_het.checkpoint.io import (
    PathLike,
    load_checkpoint_metadata,
    model_shard_name,
    optimizer_shard_name,
    read_checkpoint_file,
    resolve_checkpoint_dir,
    train_state_name,
)
from megatron_het.checkpoint.reshard import Box, SavedPiece, assemble_slice, covering_pieces
from megatron_het.checkpoint.verify import check_opened_file, check_tensor, unreadable_file
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError

_FILE_NAMES = {
    "model": model_shard_name,
    "optim": optimizer_shard_name,
    "train_state": train_state_name,
}


@dataclass
class ReadStats:
    """What readers read. ``files``: files opened. ``bytes``: bytes read, counting a file read
    whole (training state; a shard without piece digests, hashed whole) at its size and a
    memory-mapped shard by the pieces used (each once, whole). ``verified_bytes``: of those,
    the bytes checked against a sha256 (whole files and pieces); 0 for unrecorded
    checkpoints."""

    files: int = 0
    bytes: int = 0
    verified_bytes: int = 0


class CheckpointReader:
    """Random access to the pieces of one checkpoint directory, whatever plan wrote it.

    Files are opened lazily (shards memory-mapped) and kept open for the reader's lifetime.
    Before a file is opened its size is checked against metadata.json's record, and each piece
    is checked against its digest when first read (a file without piece digests: its whole
    sha256 when opened); a mismatch raises one UserError line naming the file (and the tensor)
    and an intact older checkpoint.
    """

    def __init__(self, directory: PathLike, stats: ReadStats | None = None) -> None:
        self.directory = pathlib.Path(directory)
        self.stats = ReadStats() if stats is None else stats  # shared with the caller if given
        self.metadata = load_checkpoint_metadata(self.directory)
        self.config = ModelConfig.from_dict(self.metadata["model_config"])
        self._files: dict[tuple[str, int], Any] = {}
        self._digests: dict[tuple[str, int], Any] = {}  # per file: tensor digests, or None
        self._read_whole: set[tuple[str, int]] = set()
        self._used: set[tuple[tuple[str, int], str]] = set()  # (file, tensor key) read so far
        sharded = self.metadata.get("sharded")
        self.saved_plan: dict | None = sharded["plan"] if sharded else None
        if sharded:
            self.model_index = _parse_index(sharded.get("model", {}), "model")
            self.optimizer_index = _parse_index(sharded.get("optimizer", {}), "optim")
        else:
            self.model_index = self._scan_model_shards()
            self.optimizer_index = self._single_process_optimizer_index()
        self.has_optimizer = int(self.metadata.get("num_optimizer_shards", 0)) > 0 or bool(
            self.optimizer_index
        )

    @property
    def opened_files(self) -> list[tuple[str, int]]:
        """``(kind, shard index)`` of every file read so far (kind: model | optim |
        train_state)."""
        return sorted(self._files)

    def _file(self, kind: str, index: int) -> Any:
        key = (kind, index)
        if key not in self._files:
            path = self._path(key)
            recorded = self.metadata.get(FILES_KEY) is not None
            digests = check_opened_file(self.directory, self.metadata, path.name)
            # Older training states are read whole; everything with digests is mapped.
            mmap = kind != "train_state" or digests is not None
            try:
                payload = read_checkpoint_file(path, mmap=mmap)
            except UserError:
                if not recorded:
                    raise
                unreadable_file(path, self.metadata)
            self._digests[key] = digests
            self.stats.files += 1
            if not mmap or (recorded and digests is None):  # read (and hashed) whole
                size = os.stat(path).st_size
                self._read_whole.add(key)
                self.stats.bytes += size
                self.stats.verified_bytes += size if recorded else 0
            if kind == "train_state" and digests is not None:  # small tensors now, moments later
                for name, tensor in tensor_paths(payload).items():
                    if not is_train_state_moment(name):
                        self._checked(key, name, tensor)
            self._files[key] = payload  # only once its checks passed
        return self._files[key]

    def _checked(
        self,
        source: tuple[str, int],
        key: str,
        tensor: torch.Tensor,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """``tensor`` (tensor ``key`` of file ``source``), verified the first time it is used:
        its shape against ``shape`` (the index's) and, where recorded, its digest (reads it)."""
        used = (source, key)
        if used in self._used:
            return tensor
        digests = self._digests.get(source)
        if digests is not None:
            check_tensor(self._path(source), self.metadata, digests, key, tensor, shape)
            self.stats.verified_bytes += tensor_nbytes(tensor)
        if source not in self._read_whole:
            self.stats.bytes += tensor_nbytes(tensor)
        self._used.add(used)
        return tensor

    def _path(self, source: tuple[str, int]) -> pathlib.Path:
        kind, index = source
        return self.directory / _FILE_NAMES[kind](index)

    def _scan_model_shards(self) -> dict[str, tuple[tuple[int, ...], list[SavedPiece]]]:
        index: dict[str, tuple[tuple[int, ...], list[SavedPiece]]] = {}
        for shard in range(int(self.metadata["num_model_shards"])):
            payload = self._file("model", shard)
            for name, tensor in payload["tensors"].items():
                shape = tuple(payload["global_shapes"][name])
                piece = SavedPiece(
                    tuple(payload["offsets"][name]), tuple(tensor.shape), ("model", shard)
                )
                index.setdefault(name, (shape, []))[1].append(piece)
        return index

    def _single_process_optimizer_index(self) -> dict[str, tuple[tuple[int, ...], list]]:
        if int(self.metadata.get("num_train_state_shards", 0)) == 0:
            return {}
        state = self._file("train_state", 0).get("optimizer", {}).get("state", {})
        return {
            name: (
                tuple(entry["exp_avg"].shape),
                [
                    SavedPiece(
                        (0,) * entry["exp_avg"].dim(),
                        tuple(entry["exp_avg"].shape),
                        ("train_state", 0),
                    )
                ],
            )
            for name, entry in state.items()
        }

    def _model_tensor(self, piece: SavedPiece, name: str) -> torch.Tensor:
        tensor = self._file(*piece.source)["tensors"][name]
        return self._checked(piece.source, name, tensor, piece.shape)

    def _optimizer_entry(self, piece: SavedPiece, name: str) -> dict[str, Any]:
        payload = self._file(*piece.source)
        in_shard = piece.source[0] == "optim"
        entry = (payload["state"] if in_shard else payload["optimizer"]["state"])[name]
        for moment in ("exp_avg", "exp_avg_sq"):
            key = optimizer_key(name, moment, "" if in_shard else TRAIN_STATE_MOMENTS)
            self._checked(piece.source, key, entry[moment], piece.shape)
        return entry

    def _pieces(
        self, index: dict, name: str, box: Box, what: str
    ) -> tuple[tuple[int, ...], list[SavedPiece]]:
        if name not in index:
            raise UserError(
                f"checkpoint {self.directory} has no {what} for {name}; load a "
                "checkpoint of this model"
            )
        global_shape, pieces = index[name]
        return global_shape, covering_pieces(pieces, *box)

    def model_slice(self, name: str, box: Box) -> torch.Tensor:
        """The box ``(offsets, shape)`` of parameter ``name`` (a new CPU tensor). Reads (and
        verifies, once each) only the saved pieces overlapping the box."""
        global_shape, pieces = self._pieces(self.model_index, name, box, "weights")
        tensors = [(self._model_tensor(p, name), p.offsets) for p in pieces]
        return assemble_slice(name, global_shape, *box, tensors)

    def optimizer_slice(self, name: str, box: Box) -> dict[str, Any]:
        """``{"step": int, "exp_avg", "exp_avg_sq"}`` of the box of parameter ``name``; reads
        as :meth:`model_slice` does."""
        global_shape, pieces = self._pieces(self.optimizer_index, name, box, "optimizer state")
        entries = [(self._optimizer_entry(p, name), p.offsets) for p in pieces]
        out: dict[str, Any] = {"step": int(entries[0][0]["step"]) if entries else 0}
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = assemble_slice(
                f"{name} {key}", global_shape, *box, [(e[key], o) for e, o in entries]
            )
        return out

    def train_state(self, rank: int) -> dict | None:
        """The saved training state of ``rank`` (rank 0's when that rank was not saved), without
        the optimizer; None for a model-only checkpoint."""
        shards = int(self.metadata.get("num_train_state_shards", 0))
        if shards == 0:
            return None
        state = dict(self._file("train_state", rank if rank < shards else 0))
        state.pop("optimizer", None)
        return state


def _parse_index(entries: dict, kind: str) -> dict[str, tuple[tuple[int, ...], list]]:
    return {
        name: (
            tuple(e["global_shape"]),
            [SavedPiece(tuple(o), tuple(s), (kind, int(r))) for r, o, s in e["pieces"]],
        )
        for name, e in entries.items()
    }


def full_box(global_shape: tuple[int, ...]) -> Box:
    return ((0,) * len(global_shape), global_shape)


def load_model_state(
    path: PathLike, iteration: int | None = None, map_location: Any = "cpu"
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model config and FULL tensors (by global name) of the checkpoint at ``path``.

    Assembles each tensor from its pieces, whatever the parallel layout that wrote them;
    raises UserError if a piece is missing or a file is damaged.
    """
    reader = CheckpointReader(resolve_checkpoint_dir(path, iteration))
    state = {
        name: reader.model_slice(name, full_box(shape)).to(map_location)
        for name, (shape, _) in reader.model_index.items()
    }
    return reader.config, state


def load_train_state(path: PathLike, iteration: int | None = None) -> dict | None:
    """The training state saved with the checkpoint (rank 0's: counters, schedule, RNG), None
    for a model-only checkpoint; ``optimizer`` holds the FULL per-parameter state in the
    single-process form ``{"state": {name: {"step", "exp_avg", "exp_avg_sq"}},
    "param_groups": []}`` when the checkpoint has one."""
    reader = CheckpointReader(resolve_checkpoint_dir(path, iteration))
    state = reader.train_state(0)
    if state is not None and reader.has_optimizer:
        state["optimizer"] = full_optimizer_state(reader)
    return state


def full_optimizer_state(reader: CheckpointReader | PathLike) -> dict[str, Any]:
    """The FULL optimizer state of a checkpoint, in single-process form:
    ``{"state": {name: {"step": tensor, "exp_avg", "exp_avg_sq"}}, "param_groups": []}``."""
    if not isinstance(reader, CheckpointReader):
        reader = CheckpointReader(reader)
    state = {}
    for name, (global_shape, _) in reader.optimizer_index.items():
        entry = reader.optimizer_slice(name, full_box(global_shape))
        entry["step"] = torch.tensor(float(entry["step"]))  # torch.optim.AdamW's own form
        state[name] = entry
    return {"state": state, "param_groups": []}
