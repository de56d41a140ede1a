"""Checkpoint files on disk: their layout, writing them, atomic commit, and metadata.

Layout of a ``--save`` directory::

    SAVE/latest_checkpointed_iteration.txt      the committed iteration (written last)
    SAVE/iter_0000012/metadata.json             model config, shard counts, run metadata
    SAVE/iter_0000012/model_shard_00000.pt      tensors under GLOBAL names + their placement
    SAVE/iter_0000012/train_state_00000.pt      optimizer (by name), schedule, RNG, counters
    SAVE/iter_0000012/optim_shard_00000.pt      (parallel saves) optimizer state pieces by name

A model shard holds, per tensor, the piece it stores, the tensor's global shape and the offset of
the piece along every dimension. A single process writes one shard of full tensors; a parallel run
writes one shard per rank. A parallel save (:mod:`megatron_het.checkpoint.sharded`) also writes
per rank an optimizer shard (Adam moments sliced like their parameter) and a training-state file
without the optimizer. Reading pieces back is :mod:`megatron_het.checkpoint.reader`'s job.

Every file's byte size and sha256, computed while it is written, and for model and optimizer
shards the sha256 of every tensor piece's raw bytes (:mod:`megatron_het.checkpoint.integrity`)
are recorded in metadata.json's ``files`` map, so a reader can check a file's size before it
opens it and each piece's bytes when it reads them.

An iteration is written into a hidden staging directory in SAVE, fsync'ed, renamed into place and
only then recorded in the tracker file, so a crash mid-save leaves the previous checkpoint the
one that loads; stale staging directories are removed by the next save.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import torch

from megatron_het.checkpoint.integrity import (
    FILES_KEY,
    FileRecord,
    HashingWriter,
    optimizer_key,
    tensor_paths,
    tensor_sha256,
)
from megatron_het.checkpoint.names import (
    METADATA_FILE,
    TRACKER_FILE,
    iteration_dir_name,
    parse_iteration_dir,
)
from megatron_het.checkpoint.verify import damaged_file_message
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError

PathLike = str | os.PathLike
FORMAT_VERSION = 1
STAGING_PREFIX = ".staging_iter_"
_TRASH_PREFIX = ".trash_iter_"


def model_shard_name(shard_index: int) -> str:
    """``model_shard_00003.pt`` for shard 3 (one shard per saving rank)."""
    return f"model_shard_{shard_index:05d}.pt"


def train_state_name(shard_index: int) -> str:
    """``train_state_00003.pt`` for shard 3."""
    return f"train_state_{shard_index:05d}.pt"


def optimizer_shard_name(shard_index: int) -> str:
    """``optim_shard_00003.pt`` for shard 3 (parallel saves: one per rank)."""
    return f"optim_shard_{shard_index:05d}.pt"


@dataclass(frozen=True)
class TensorPiece:
    """A piece of a global tensor: ``tensor`` sits at ``offsets`` inside ``global_shape``."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def full(cls, tensor: torch.Tensor) -> TensorPiece:
        """The whole tensor as its own single piece."""
        return cls(tensor, tuple(tensor.shape), (0,) * tensor.dim())


@dataclass(frozen=True)
class OptimizerPiece:
    """Adam state of a piece of one parameter, sliced exactly like the parameter's piece."""

    step: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


# ---- writing ---------------------------------------------------------------------------------
def fsync_dir(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_torch(
    obj: Any, path: pathlib.Path, tensors: dict[str, torch.Tensor] | None = None
) -> FileRecord:
    """``torch.save`` ``obj`` to ``path`` (fsync'ed); the record holds the digest of each of
    ``tensors`` (the storage-exact CPU tensors inside ``obj``, by tensor key), hashed on a
    second thread while the file is written (hashlib releases the GIL)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        digests = pool.submit(lambda: {key: tensor_sha256(t) for key, t in (tensors or {}).items()})
        with open(path, "wb") as handle:
            writer = HashingWriter(handle)
            # torch.save needs only write and flush of a file object, which the writer has.
            torch.save(obj, cast(BinaryIO, writer))
            handle.flush()
            os.fsync(handle.fileno())
        return FileRecord(path, writer.bytes, writer.hexdigest(), digests.result())


def _write_json(obj: Any, path: pathlib.Path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(obj, handle, indent=2, sort_keys=True, default=str)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its elements (torch.save writes a view's whole storage)."""
    tensor = tensor.detach().cpu()
    if (
        not tensor.is_contiguous()
        or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
    ):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def write_model_shard(
    directory: PathLike, shard_index: int, pieces: dict[str, TensorPiece]
) -> FileRecord:
    """Write one model shard (CPU copies of the pieces) into ``directory``; returns its record
    (path, size, checksum, each piece's digest under its global name)."""
    path = pathlib.Path(directory) / model_shard_name(shard_index)
    tensors = {n: _compact(p.tensor) for n, p in pieces.items()}
    payload = {
        "format_version": FORMAT_VERSION,
        "tensors": tensors,
        "global_shapes": {n: list(p.global_shape) for n, p in pieces.items()},
        "offsets": {n: list(p.offsets) for n, p in pieces.items()},
    }
    return _save_torch(payload, path, tensors)


def write_optimizer_shard(
    directory: PathLike, shard_index: int, pieces: dict[str, OptimizerPiece]
) -> FileRecord:
    """Write one optimizer shard (CPU copies of the moments) into ``directory``; returns its
    record (path, size, checksum, each moment's digest under ``name/exp_avg`` and
    ``name/exp_avg_sq``).

    Payload: ``state[name] = {"step", "exp_avg", "exp_avg_sq"}`` plus ``global_shapes`` and
    ``offsets`` by name, as in a model shard.
    """
    path = pathlib.Path(directory) / optimizer_shard_name(shard_index)
    moments = {
        n: {"exp_avg": _compact(p.exp_avg), "exp_avg_sq": _compact(p.exp_avg_sq)}
        for n, p in pieces.items()
    }
    state = {n: {"step": int(p.step), **moments[n]} for n, p in pieces.items()}
    payload = {
        "format_version": FORMAT_VERSION,
        "state": state,
        "global_shapes": {n: list(p.global_shape) for n, p in pieces.items()},
        "offsets": {n: list(p.offsets) for n, p in pieces.items()},
    }
    tensors = {
        optimizer_key(n, moment): tensor
        for n, entry in moments.items()
        for moment, tensor in entry.items()
    }
    return _save_torch(payload, path, tensors)


def write_json_file(obj: Any, path: PathLike) -> None:
    """Write ``obj`` as JSON to ``path`` and fsync it."""
    _write_json(obj, pathlib.Path(path))


def write_train_state(directory: PathLike, shard_index: int, train_state: dict) -> FileRecord:
    """Write one training-state file into ``directory``; returns its record, with every
    tensor's digest under its path (:func:`~megatron_het.checkpoint.integrity.tensor_paths`)."""
    return _save_torch(
        train_state,
        pathlib.Path(directory) / train_state_name(shard_index),
        tensor_paths(train_state),
    )


def remove_stale_staging(save_dir: PathLike) -> None:
    """Delete staging/trash directories left behind by an interrupted save."""
    root = pathlib.Path(save_dir)
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.startswith((STAGING_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)


def staging_dir(save_dir: PathLike, iteration: int, tag: str | None = None) -> pathlib.Path:
    """The staging directory path of ``iteration``; ``tag`` (default: this process id) names
    it, so ranks of a parallel save agree on one directory by passing the same tag."""
    tag = str(os.getpid()) if tag is None else tag
    return pathlib.Path(save_dir) / f"{STAGING_PREFIX}{iteration:07d}_{tag}"


def begin_checkpoint(save_dir: PathLike, iteration: int, tag: str | None = None) -> pathlib.Path:
    """Create (empty) and return the staging directory for ``iteration`` inside ``save_dir``.

    Side effect: removes staging directories left by interrupted saves. See :func:`staging_dir`
    for ``tag``.
    """
    root = pathlib.Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(root)
    staging = staging_dir(root, iteration, tag)
    staging.mkdir()
    return staging


def commit_checkpoint(
    staging: pathlib.Path, save_dir: PathLike, iteration: int, metadata: dict[str, Any]
) -> pathlib.Path:
    """Write metadata.json, move ``staging`` to ``iter_XXXXXXX`` and point the tracker at it.

    Side effects: replaces an existing directory of the same iteration; the tracker file is
    replaced atomically last.
    """
    _write_json(metadata, staging / METADATA_FILE)
    fsync_dir(staging)
    return publish_iteration(staging, save_dir, iteration)


def publish_iteration(staging: pathlib.Path, save_dir: PathLike, iteration: int) -> pathlib.Path:
    """Move the complete, fsync'ed ``staging`` directory to ``iter_XXXXXXX`` and point the
    tracker at it; returns the directory.

    Side effects: replaces an existing directory of the same iteration; the tracker file is
    replaced atomically last.
    """
    root = pathlib.Path(save_dir)
    final = root / iteration_dir_name(iteration)
    trash = None
    if final.exists():
        trash = root / f"{_TRASH_PREFIX}{iteration:07d}_{os.getpid()}"
        os.replace(final, trash)
    os.replace(staging, final)
    fsync_dir(root)
    tracker_tmp = root / f".{TRACKER_FILE}.tmp"
    with open(tracker_tmp, "w", encoding="utf-8") as handle:
        handle.write(f"{iteration}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tracker_tmp, root / TRACKER_FILE)
    fsync_dir(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def save_checkpoint(
    save_dir: PathLike,
    iteration: int,
    model_config: ModelConfig,
    model_state: dict[str, torch.Tensor],
    train_state: dict | None = None,
    metadata: dict | None = None,
) -> pathlib.Path:
    """Save full (unsharded) model tensors and optional training state as ``iteration``.

    ``model_state`` maps global parameter names to full tensors (any device; CPU copies are
    written). ``train_state`` is any ``torch.save``-able dict of tensors and plain values (None
    for a model-only checkpoint, e.g. converted weights). ``metadata`` (JSON-able; other values
    are written with ``str``) is merged into metadata.json, with every file's size and checksum
    (and the model tensors' digests) under ``files``. Returns the iteration directory.
    """
    staging = begin_checkpoint(save_dir, iteration)
    try:
        records = [
            write_model_shard(staging, 0, {n: TensorPiece.full(t) for n, t in model_state.items()})
        ]
        if train_state is not None:
            records.append(write_train_state(staging, 0, train_state))
        info = dict(metadata or {})
        info.update(
            {
                "format_version": FORMAT_VERSION,
                "iteration": int(iteration),
                "model_config": model_config.to_dict(),
                "num_model_shards": 1,
                "num_train_state_shards": 0 if train_state is None else 1,
                FILES_KEY: {r.name: r.to_json() for r in records},
            }
        )
        return commit_checkpoint(staging, save_dir, iteration, info)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ---- reading ---------------------------------------------------------------------------------
def read_latest_iteration(save_dir: PathLike) -> int | None:
    """The iteration recorded in ``save_dir``'s tracker file, or None when there is none."""
    tracker = pathlib.Path(save_dir) / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text(encoding="utf-8").strip()
    try:
        return int(text)
    except ValueError:
        raise UserError(
            f"{tracker} holds {text[:40]!r} instead of an iteration number; fix or delete that file"
        ) from None


def resolve_checkpoint_dir(path: PathLike, iteration: int | None = None) -> pathlib.Path:
    """The ``iter_XXXXXXX`` directory meant by ``path``.

    ``path`` is either an iteration directory (holding metadata.json) or a save directory; in the
    latter, ``iteration`` picks one, else the tracker's latest. Raises UserError when nothing
    loadable is there.
    """
    root = pathlib.Path(path)
    if not root.exists():
        raise UserError(
            f"checkpoint path {root} does not exist; pass a --save directory or "
            "one of its iter_XXXXXXX directories"
        )
    if (root / METADATA_FILE).is_file():
        return root
    if iteration is None:
        iteration = read_latest_iteration(root)
        if iteration is None:
            raise UserError(
                f"no checkpoint in {root}: it has neither {TRACKER_FILE} nor "
                f"{METADATA_FILE}; pass a --save directory or an iter_XXXXXXX "
                "directory"
            )
    directory = root / iteration_dir_name(iteration)
    if not (directory / METADATA_FILE).is_file():
        raise UserError(_damaged_metadata_line(directory, "missing"))
    return directory


def _damaged_metadata_line(directory: pathlib.Path, problem: str) -> str:
    """One line: ``directory``'s metadata.json is missing or unreadable, and which older
    checkpoint of its save directory is intact."""
    return damaged_file_message(
        directory / METADATA_FILE, problem, parse_iteration_dir(directory.name)
    )


def load_checkpoint_metadata(path: PathLike, iteration: int | None = None) -> dict[str, Any]:
    """metadata.json of the checkpoint at ``path`` (see :func:`resolve_checkpoint_dir`).

    Always holds ``iteration``, ``model_config`` (a ModelConfig dict), ``num_model_shards`` and
    ``num_train_state_shards``, plus whatever the saver added.
    """
    directory = resolve_checkpoint_dir(path, iteration)
    try:
        with open(directory / METADATA_FILE, encoding="utf-8") as handle:
            metadata = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(_damaged_metadata_line(directory, f"unreadable: {exc}")) from None
    if not isinstance(metadata, dict):
        raise UserError(_damaged_metadata_line(directory, "not a JSON object"))
    if metadata.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{directory} has checkpoint format {metadata.get('format_version')!r}, "
            f"this version reads format {FORMAT_VERSION}"
        )
    return metadata


def read_checkpoint_file(path: PathLike, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load`` of one checkpoint file (tensors and plain values only).

    With ``mmap`` the file is memory-mapped, so only the tensors used are read from disk.
    Raises UserError when the file is missing or damaged.
    """
    return _load_file(pathlib.Path(path), map_location, mmap)


def _load_file(path: pathlib.Path, map_location: Any, mmap: bool = False) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise UserError(
            f"checkpoint file {path} is missing; the checkpoint is incomplete, load another one"
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError, KeyError, pickle.UnpicklingError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(
            f"cannot read checkpoint file {path} ({first_line}); "
            "the checkpoint is damaged, load another one"
        ) from None
