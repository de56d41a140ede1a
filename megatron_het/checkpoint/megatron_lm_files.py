"""What Megatron-LM's two checkpoint formats share: the save directory's tracker and iteration
directories, pickled files read without running code, the result of a read, and the atomic
commit of a written iteration.

A Megatron-LM save directory holds ``latest_checkpointed_iteration.txt`` (an iteration number,
or ``release``) and ``iter_NNNNNNN`` (or ``release``) directories; what is inside an iteration
directory is the format's business (:mod:`megatron_het.checkpoint.megatron_lm` for the legacy
``torch`` format, :mod:`megatron_het.checkpoint.megatron_lm_dist` for ``torch_dist``).

Pickled files (legacy rank files, ``torch_dist``'s ``common.pt``) are unpickled with
``weights_only=True`` allowing exactly the types real Megatron-LM files hold besides tensors
(:func:`safe_globals`); a file that needs any other global is refused with one line naming it,
before it is unpickled. Megatron's own enums are read as :class:`MegatronEnum` values, without
importing Megatron. torch reads a torch.distributed.checkpoint index (``.metadata``) with a
plain ``pickle.load``, which could run code; :func:`read_dcp_metadata` unpickles it with an
unpickler that builds only the index's own types, and :class:`CheckedReader` hands that to
torch's reader.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import pathlib
import pickle
import signal
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from megatron_het.checkpoint.io import fsync_dir, publish_iteration
from megatron_het.checkpoint.names import TRACKER_FILE, iteration_dir_name
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError

RELEASE = "release"
CHECKPOINT_VERSION = 3.0
# megatron.core.dist_checkpointing writes it last into a torch_dist iteration directory (ours
# has a file of the same name, without ``sharded_backend``).
DIST_CONFIG_FILE = "metadata.json"
DCP_METADATA_FILE = ".metadata"
_MEGATRON_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
)


@dataclass(frozen=True)
class MegatronEnum:
    """A Megatron enum member read from a file (``enum``: its class's full name)."""

    enum: str
    value: Any


@dataclass(frozen=True)
class MegatronCheckpoint:
    """A Megatron-LM checkpoint read into our single-process form: ``state`` holds FULL tensors
    by our names, vocabulary padding removed; ``args`` is the run's Namespace (rank 0's);
    ``optimizer`` its Adam state when read
    (:class:`~megatron_het.checkpoint.megatron_lm_optim.MegatronOptimizerState`)."""

    config: ModelConfig
    state: dict[str, torch.Tensor]
    iteration: int
    directory: pathlib.Path
    args: argparse.Namespace
    optimizer: Any = None


class _EnumReader:
    """Rebuilds members of one Megatron enum as :class:`MegatronEnum` during unpickling."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, value: Any) -> MegatronEnum:
        return MegatronEnum(self.name, value)


def safe_globals() -> list[Any]:
    """What real Megatron-LM files hold besides tensors, dicts, lists and numbers: ``args`` is
    an argparse.Namespace whose values include ``exit_signal`` (signal.Signals), paths,
    ``attention_backend`` and the CUDA-graph options (Megatron enums) and dtypes (allowed by
    torch already); ``rng_state`` holds numpy's RNG state (a uint32 ndarray); ``common.pt`` may
    hold the rerun state machine's enums; Transformer Engine before 2.0 saved its
    ``_extra_state`` as io.BytesIO. None of these runs code when rebuilt."""
    reconstruct = np._core.multiarray._reconstruct  # type: ignore[attr-defined]
    return [
        argparse.Namespace,
        types.SimpleNamespace,
        pathlib.PosixPath,
        signal.Signals,
        *[(_EnumReader(name), name) for name in _MEGATRON_ENUMS],
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        reconstruct,
        (reconstruct, "numpy.core.multiarray._reconstruct"),  # pickled by numpy 1.x
        io.BytesIO,
    ]


def _allowed_names() -> set[str]:
    names = set()
    for entry in safe_globals():
        if isinstance(entry, tuple):
            names.add(entry[1])
        else:
            names.add(f"{entry.__module__}.{entry.__qualname__}")
    return names


def load_pickled(path: pathlib.Path, missing_hint: str) -> Any:
    """``path`` unpickled without running code (see the module docstring), tensors
    memory-mapped. Raises UserError, one line, for a missing file (``missing_hint`` says what
    to copy), a damaged or truncated one, or one that needs a global that is not allowed."""
    if not path.is_file():
        raise UserError(f"Megatron checkpoint file {path} is missing; {missing_hint}")
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        refused = sorted(set(needed) - _allowed_names())
        if refused:
            raise UserError(
                f"{path} needs {refused[0]} to load, which Megatron-LM checkpoints do not hold; "
                "it is refused, since loading it could run code (re-save the checkpoint "
                "without it)"
            )
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise UserError(
            f"cannot read Megatron checkpoint file {path} ({first_line}); it is damaged or "
            "truncated, copy it again"
        ) from None


def checkpoint_args(payload: Any, path: pathlib.Path) -> argparse.Namespace:
    """The ``args`` of a rank file's or ``common.pt``'s ``payload``, after checking that it is
    a megatron-core (checkpoint_version 3.0) save; UserError otherwise."""
    args = payload.get("args") if isinstance(payload, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise UserError(f"{path} holds no args Namespace; re-save it with Megatron-LM")
    version = payload.get("checkpoint_version", 0)
    if not isinstance(version, (int, float)) or version < CHECKPOINT_VERSION:
        raise UserError(
            f"{path} has checkpoint_version {version}; only 3.0 (megatron-core) "
            "checkpoints are supported, re-save it with a recent Megatron-LM"
        )
    return args


def sharded_backend(directory: pathlib.Path) -> str | None:
    """The ``sharded_backend`` a megatron.core.dist_checkpointing save records in the iteration
    ``directory``'s metadata.json (``torch_dist`` by default), or None for a directory without
    one (a legacy save, or one of ours)."""
    path = directory / DIST_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(
            f"{path} is not valid JSON; the checkpoint is damaged, copy it again"
        ) from None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    return str(backend) if backend is not None else None


def _is_iteration_dir(directory: pathlib.Path) -> bool:
    return any(directory.glob("mp_rank_*")) or sharded_backend(directory) is not None


def iteration_dir(load_dir: pathlib.Path, iteration: int | None) -> pathlib.Path:
    """The iteration directory to read: ``load_dir``'s ``iter_XXXXXXX`` for ``iteration``, else
    the tracker's (maybe ``release``), else ``load_dir`` itself when it is an iteration
    directory of either format. UserError, one line, when there is none."""
    if not load_dir.is_dir():
        raise UserError(f"--load-dir {load_dir} is not a directory; pass a Megatron-LM --save dir")
    if iteration is not None:
        directory = load_dir / iteration_dir_name(iteration)
    else:
        tracker = load_dir / TRACKER_FILE
        if not tracker.is_file():
            if _is_iteration_dir(load_dir):
                return load_dir
            raise UserError(
                f"{load_dir} has no {TRACKER_FILE}; pass a Megatron-LM --save directory, "
                "one of its iter_XXXXXXX directories, or --iteration N"
            )
        text = tracker.read_text(encoding="utf-8").strip()
        if text == RELEASE:
            directory = load_dir / RELEASE
        elif text.isdigit():
            directory = load_dir / iteration_dir_name(int(text))
        else:
            raise UserError(
                f"{tracker} holds {text[:40]!r}, neither an iteration nor 'release'; fix it "
                "or pass --iteration N"
            )
    if not directory.is_dir():
        raise UserError(f"{directory} does not exist; pass an --iteration that was saved")
    return directory


def trim_vocab(
    state: dict[str, torch.Tensor], cfg: ModelConfig, padded: int, source: str
) -> dict[str, torch.Tensor]:
    """``state`` with the embedding's and head's ``padded`` rows cut to ``cfg.vocab_size``
    (new tensors); UserError when they do not hold ``padded`` rows."""
    for name in ("embedding.weight", "output.weight"):
        if name in state:
            rows = state[name].shape[0]
            if rows != padded:
                raise UserError(
                    f"{source}: {name} has {rows} rows but args.padded_vocab_size is "
                    f"{padded}; the checkpoint is inconsistent, re-save it"
                )
            state[name] = state[name][: cfg.vocab_size].clone()
    return state


def check_complete(state: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> None:
    """UserError unless ``state`` holds every tensor of our model for ``cfg``, in its shape."""
    from megatron_het.model.llama import LlamaModel

    with torch.device("meta"):
        expected = LlamaModel(cfg).state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise UserError(f"{source} lacks {missing[0]} (ours); copy every file of the checkpoint")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise UserError(
                f"{source}: {name} has shape {tuple(state[name].shape)} but its args imply "
                f"{tuple(tensor.shape)}; the checkpoint does not match its args"
            )


def commit_iteration(staging: pathlib.Path, root: pathlib.Path, iteration: int) -> pathlib.Path:
    """Rename the finished ``staging`` directory to ``root``'s ``iter_XXXXXXX`` (replacing one
    of the same iteration), then write the tracker, as our own saves commit; returns the
    directory."""
    fsync_dir(staging)
    return publish_iteration(staging, root, iteration)


# ---- .metadata without running code ----------------------------------------------------------
class _Inert:
    """Stands in for Megatron's old planner classes in ``.metadata``; holds their state."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """The globals a torch.distributed.checkpoint ``.metadata`` pickle references (this torch's
    and older ones', Megatron's stand-ins), each building data only."""
    module = "torch.distributed.checkpoint.metadata"
    names = (
        *("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata"),
        *("TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"),
    )
    allowed = {(module, name): getattr(dcp_metadata, name) for name in names}
    old = "torch.distributed._shard.sharded_tensor.metadata"  # before torch 2.3
    allowed[(old, "TensorProperties")] = dcp_metadata.TensorProperties
    allowed[(old, "MEM_FORMAT_ENCODING")] = dcp_metadata._MEM_FORMAT_ENCODING
    allowed[(dcp_filesystem.__name__, "_StorageInfo")] = dcp_filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for path_module in ("pathlib", "pathlib._local"):
        for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            allowed[(path_module, name)] = pathlib.PurePosixPath
    mcore = "megatron.core.dist_checkpointing.strategies.torch"
    allowed[(mcore, "MCoreMetadata")] = dcp_metadata.Metadata
    allowed[(mcore, "MCoreSavePlan")] = _Inert
    return allowed


class _RefusedGlobal(pickle.UnpicklingError):
    """A global outside :func:`_metadata_globals` (its full name is the message)."""


class _MetadataUnpickler(pickle.Unpickler):
    allowed = _metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _RefusedGlobal(f"{module}.{name}")


def read_dcp_metadata(directory: pathlib.Path) -> dcp_metadata.Metadata:
    """``directory``'s torch.distributed.checkpoint index, unpickled without running code.
    UserError, one line, when it is missing (an unfinished save), damaged, or references a
    global beyond the metadata types (refused, as loading it could run code)."""
    path = directory / DCP_METADATA_FILE
    if not path.is_file():
        raise UserError(
            f"{path} is missing: the torch_dist save did not finish; use an earlier iteration "
            "or copy the whole iteration directory"
        )
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except _RefusedGlobal as exc:
        raise UserError(
            f"{path} needs {exc} to load, which torch.distributed.checkpoint metadata does not "
            "hold; it is refused, since loading it could run code"
        ) from None
    except (
        pickle.UnpicklingError,
        OSError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
    ) as exc:
        raise UserError(
            f"cannot read {path} ({type(exc).__name__}); it is damaged or truncated, copy it again"
        ) from None
    if not isinstance(metadata, dcp_metadata.Metadata) or metadata.storage_data is None:
        raise UserError(f"{path} is not a torch.distributed.checkpoint index; copy it again")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata


class CheckedReader(dcp.FileSystemReader):
    """torch's file reader, handed the index :func:`read_dcp_metadata` read safely."""

    def __init__(self, directory: pathlib.Path, metadata: dcp_metadata.Metadata) -> None:
        super().__init__(directory)
        self.checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        return self.checked
