"""Byte sizes and sha256 checksums of checkpoint files and of the tensors inside them.

Every file a save writes goes through a :class:`HashingWriter`, which counts and hashes the bytes
``torch.save`` hands it on their way to disk (the file is never read back to hash it). Shards of
tensors (model and optimizer shards) also record the sha256 of every tensor piece they hold: the
raw bytes of the contiguous CPU tensor exactly as ``torch.save`` stores them (row-major, native
byte order; bf16 included, hashed as bytes). The result, a :class:`FileRecord`, ends up in
metadata.json's ``files`` map::

    "files": {"model_shard_00000.pt": {"bytes": 81234, "sha256": "9f0c...",
                                       "tensors": {"layers.0.mlp.up.weight": "4be1...", ...}},
              "optim_shard_00000.pt": {"bytes": ..., "sha256": ...,
                                       "tensors": {"layers.0.mlp.up.weight/exp_avg": "...",
                                                   "layers.0.mlp.up.weight/exp_avg_sq": "..."}},
              "train_state_00000.pt": {"bytes": ..., "sha256": ...,
                               "tensors": {"rng/torch": "...", ...}}}

A model tensor's key is its global name, an Adam moment's ``name/exp_avg`` or
``name/exp_avg_sq`` (:func:`optimizer_key`); in a training state every tensor is keyed by its
path (:func:`tensor_paths`: ``rng/torch``; a single-process state's moments
``optimizer/state/name/exp_avg``). On load a file is checked against its record
(:mod:`megatron_het.checkpoint.verify`): its size with one ``stat``; a file listing its tensors
then has its small non-tensor records checked (:func:`archive_problem`, zip CRC-32) and each
tensor checked against its digest when it is first read (:func:`tensor_sha256`; a training
state's tensors other than moments when it is opened), so a rank that needs some pieces hashes
only those. A recorded file without tensor digests (written before tensors were recorded) is
hashed whole (:func:`file_sha256`); checkpoints written before files were recorded have no
``files`` map and are not verified.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

FILES_KEY = "files"  # metadata.json: {file name: {"bytes": int, "sha256": hex[, "tensors"]}}
TENSORS_KEY = "tensors"  # in a file's record: {tensor key: sha256 hex of its raw bytes}
TRAIN_STATE_MOMENTS = "optimizer/state/"  # a single-process training state's moments' prefix
_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileRecord:
    """A written checkpoint file: its path, byte size, sha256 (hex) and, for a shard of tensors,
    the sha256 of each tensor it holds by key (see module doc)."""

    path: pathlib.Path
    bytes: int
    sha256: str
    tensors: Mapping[str, str] | None = None

    @property
    def name(self) -> str:
        return self.path.name

    def to_json(self) -> dict[str, Any]:
        """The ``files`` map entry of this file."""
        out: dict[str, Any] = {"bytes": self.bytes, "sha256": self.sha256}
        if self.tensors is not None:  # also when empty: nothing to hash whole
            out[TENSORS_KEY] = dict(self.tensors)
        return out


class HashingWriter:
    """A write-only file object that passes bytes to ``handle`` and hashes and counts them.

    ``torch.save`` writes its archive sequentially through ``write``, so the digest is that of
    the file's bytes.
    """

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._hash = hashlib.sha256()
        self.bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)  # releases the GIL for large buffers
        self.bytes += view.nbytes
        return self._handle.write(view)

    def flush(self) -> None:
        self._handle.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def optimizer_key(name: str, moment: str, prefix: str = "") -> str:
    """The tensor key of Adam moment ``moment`` (exp_avg | exp_avg_sq) of parameter ``name``
    (``prefix`` + ``name/moment``; a training state's moments sit under
    :data:`TRAIN_STATE_MOMENTS`)."""
    return f"{prefix}{name}/{moment}"


def is_train_state_moment(key: str) -> bool:
    """Whether training-state tensor ``key`` is an Adam moment of a single-process state (read
    as a piece, checked when used)."""
    return key.startswith(TRAIN_STATE_MOMENTS) and key.endswith(("/exp_avg", "/exp_avg_sq"))


def tensor_paths(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples, by its ``/``-joined path of keys and
    indices (``rng/torch``, ``optimizer/state/<name>/exp_avg``): a training state's tensor
    keys. ValueError if two paths coincide."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        items = [(str(k), v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(obj)]
    else:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        found = tensor_paths(value, f"{prefix}/{key}" if prefix else key)
        if set(found) & set(out):
            raise ValueError(f"tensor path {sorted(set(found) & set(out))[0]!r} is ambiguous")
        out.update(found)
    return out


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 (hex) of a CPU tensor's elements as raw bytes in row-major order: for the
    contiguous, storage-exact tensors a shard writes, the bytes ``torch.save`` stores. Reading a
    memory-mapped tensor through it reads its bytes from the file."""
    flat = tensor.detach().reshape(-1).cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    digest = hashlib.sha256()
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy().data)  # any dtype, bf16 included
    return digest.hexdigest()


def file_sha256(path: pathlib.Path) -> str:
    """sha256 (hex) of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(_READ_CHUNK)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)


def size_problem(path: pathlib.Path, expected: Mapping[str, Any]) -> str | None:
    """ "missing", "truncated: N of M bytes" or "N bytes, M expected" for the file at ``path``
    against its ``files`` entry (one ``stat``); None when the size matches."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "missing"
    want = int(expected["bytes"])
    if size < want:
        return f"truncated: {size} of {want} bytes"
    if size != want:
        return f"{size} bytes, {want} expected"
    return None


def file_problem(
    path: pathlib.Path, expected: Mapping[str, Any], checksum: bool = True
) -> str | None:
    """What is wrong with the file at ``path`` against its ``files`` entry, or None when it is
    intact: a :func:`size_problem` or "checksum mismatch" (the whole file's sha256, read once).
    ``checksum`` False checks the size only."""
    problem = size_problem(path, expected)
    if problem is None and checksum and file_sha256(path) != expected["sha256"]:
        return "checksum mismatch: its bytes changed after it was written"
    return problem


def archive_problem(path: pathlib.Path) -> str | None:
    """What is wrong with the zip structure of the ``torch.save`` archive at ``path`` and its
    small non-tensor records (the pickle naming the tensors, version and byte-order records),
    each checked against its zip CRC-32; None when intact. Tensor data (``*/data/N``) is not
    read: it is checked against the tensors' digests as it is used."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.filename.split("/")[-2:-1] != ["data"]:  # not a tensor's storage
                    archive.read(info)  # raises on a CRC-32 mismatch
    except Exception as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"its archive structure is damaged: {first_line}"
    return None


def files_total_bytes(metadata: Mapping[str, Any]) -> int | None:
    """The summed size of every file recorded in a checkpoint's metadata (None if unrecorded)."""
    files = metadata.get(FILES_KEY)
    if files is None:
        return None
    return sum(int(entry["bytes"]) for entry in files.values())
