"""Verifying checkpoint directories against their recorded file sizes and checksums.

A checkpoint's metadata.json lists every file it holds with its size and sha256, and for shards
of tensors each tensor's sha256 (:mod:`megatron_het.checkpoint.integrity`). :func:`verify_files`
checks a whole directory by whole-file checksums (the info tool). A reader checks a file when it
opens it (:func:`check_opened_file`: its size, then its archive structure when it lists its
tensors, else its whole checksum) and each tensor when it first reads it
(:func:`check_tensor`). Any of them, when something is damaged, raises ONE UserError line that
names the file (and the tensor) and the newest older checkpoint of the same save directory that
is intact (:func:`newest_intact_before` verifies them, newest first).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any

import torch

from megatron_het.checkpoint.integrity import (
    FILES_KEY,
    TENSORS_KEY,
    archive_problem,
    file_problem,
    size_problem,
    tensor_sha256,
)
from megatron_het.checkpoint.names import METADATA_FILE, parse_iteration_dir
from megatron_het.errors import UserError


def read_metadata_file(directory: pathlib.Path) -> dict[str, Any] | None:
    """metadata.json of ``directory`` as a dict, or None when it is missing or unreadable."""
    try:
        with open(directory / METADATA_FILE, encoding="utf-8") as handle:
            metadata = json.load(handle)
    except (OSError, ValueError):
        return None
    return metadata if isinstance(metadata, dict) else None


def verify_files(
    directory: pathlib.Path, metadata: Mapping[str, Any]
) -> dict[str, str | None] | None:
    """``{file name: problem or None}`` for every file recorded in ``metadata`` (sizes and
    checksums, reading every file once); None for a checkpoint written without records."""
    files = metadata.get(FILES_KEY)
    if files is None:
        return None
    return {name: file_problem(directory / name, entry) for name, entry in sorted(files.items())}


def newest_intact_before(
    save_dir: pathlib.Path, iteration: int | None
) -> tuple[pathlib.Path, bool] | None:
    """The newest committed checkpoint of ``save_dir`` older than ``iteration`` (any, for None)
    whose files all verify, and whether it was verified (False: written without checksums, so
    only its metadata was readable). None when there is none."""
    candidates = []
    if save_dir.is_dir():
        for entry in save_dir.iterdir():
            number = parse_iteration_dir(entry.name)
            if number is not None and entry.is_dir() and (iteration is None or number < iteration):
                candidates.append((number, entry))
    for _, directory in sorted(candidates, reverse=True):
        metadata = read_metadata_file(directory)
        if metadata is None:
            continue
        problems = verify_files(directory, metadata)
        if problems is None:
            return directory, False
        if not any(problems.values()):
            return directory, True
    return None


def damaged_file_message(path: pathlib.Path, problem: str, iteration: int | None) -> str:
    """One line: ``path`` is damaged (``problem``) and which older checkpoint to load instead."""
    save_dir = path.parent.parent
    older = newest_intact_before(save_dir, iteration)
    if older is None:
        hint = f"no older checkpoint in {save_dir} is intact"
    else:
        directory, verified = older
        note = "" if verified else " (written without checksums, so not verified)"
        hint = (
            f"the newest intact older checkpoint is {directory}{note}; resume from it with "
            f"--load {directory}"
        )
    what = "is missing" if problem == "missing" else f"is damaged ({problem})"
    return f"checkpoint file {path} {what}; {hint}"


def _raise_damaged(path: pathlib.Path, metadata: Mapping[str, Any], problem: str) -> None:
    iteration = metadata.get("iteration")
    raise UserError(
        damaged_file_message(path, problem, None if iteration is None else int(iteration))
    )


def check_file(
    directory: pathlib.Path, metadata: Mapping[str, Any], name: str, checksum: bool = True
) -> None:
    """Raise one UserError line unless file ``name`` of ``directory`` matches its record (size,
    and with ``checksum`` its whole sha256). No-op for checkpoints written without records."""
    files = metadata.get(FILES_KEY)
    if files is None:
        return
    entry = files.get(name)
    path = directory / name
    problem = (
        "not listed in metadata.json" if entry is None else file_problem(path, entry, checksum)
    )
    if problem is not None:
        _raise_damaged(path, metadata, problem)


def check_opened_file(
    directory: pathlib.Path, metadata: Mapping[str, Any], name: str
) -> Mapping[str, str] | None:
    """Check file ``name`` before a reader opens it; returns its tensors' digests by key, or
    None when none are recorded.

    A file whose record lists its tensors is checked by size (one ``stat``) and archive
    structure (its small non-tensor records, :func:`~megatron_het.checkpoint.integrity.
    archive_problem`); its tensors are left to :func:`check_tensor`. Any other recorded file
    is checked by size and whole sha256 (read once). No-op (None) for checkpoints written
    without records. Raises one UserError line (see module doc) when the file is damaged.
    """
    files = metadata.get(FILES_KEY)
    if files is None:
        return None
    entry = files.get(name)
    digests = None if entry is None else entry.get(TENSORS_KEY)
    if digests is None:
        check_file(directory, metadata, name)
        return None
    path = directory / name
    problem = size_problem(path, entry) or archive_problem(path)
    if problem is not None:
        _raise_damaged(path, metadata, problem)
    return digests


def check_tensor(
    path: pathlib.Path,
    metadata: Mapping[str, Any],
    digests: Mapping[str, str],
    key: str,
    tensor: torch.Tensor,
    shape: tuple[int, ...] | None = None,
) -> None:
    """Raise one UserError line naming ``path`` and tensor ``key`` unless ``tensor`` (as read
    from that file; reads its bytes) has the recorded digest and, when given, ``shape``."""
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        _raise_damaged(
            path,
            metadata,
            f"tensor {key} has shape {tuple(tensor.shape)}, metadata.json says {tuple(shape)}",
        )
    want = digests.get(key)
    if want is None:
        _raise_damaged(path, metadata, f"tensor {key} has no digest in metadata.json")
    if tensor_sha256(tensor) != want:
        _raise_damaged(
            path,
            metadata,
            f"tensor {key} does not match its sha256: its bytes changed after it was written",
        )


def unreadable_file(path: pathlib.Path, metadata: Mapping[str, Any]) -> None:
    """Raise the one-line damaged-file error for a recorded file that passed its checks but
    that ``torch.load`` cannot read."""
    _raise_damaged(path, metadata, "torch.load cannot read it")
