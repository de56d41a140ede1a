"""Megatron-LM checkpoints in the legacy ``--ckpt-format torch`` layout, read and written.

Layout of a Megatron-LM save directory::

    SAVE/latest_checkpointed_iteration.txt       an iteration number, or "release"
    SAVE/iter_0000500/mp_rank_TT/model_optim_rng.pt        pipeline size 1
    SAVE/iter_0000500/mp_rank_TT_PPP/model_optim_rng.pt    pipeline size > 1
    SAVE/release/...                              for the tracker's "release"

Each file is a ``torch.save``'d dict: ``model`` (that TP/PP rank's megatron-core state dict, see
:mod:`megatron_het.checkpoint.megatron_lm_names`), ``args`` (the run's ``argparse.Namespace``),
``iteration``, ``checkpoint_version`` (3.0) and, from training runs, ``optimizer``,
``opt_param_scheduler`` and ``rng_state``. Only the model is converted; optimizer state is not
(yet).

Reading never runs code from a file: it is unpickled with ``weights_only=True`` allowing exactly
the types real Megatron-LM files hold besides tensors (listed in :func:`_safe_globals`); a file
that needs any other global is refused with one line naming it, before it is unpickled.
Megatron's own enums are read as :class:`MegatronEnum` values, without importing Megatron.

Writing lays our weights out for a given TP and PP degree with an ``args`` Namespace holding
what megatron-core needs to rebuild the model, fsync'ed in a staging directory renamed into
place, then the tracker file (no metadata.json: Megatron-LM would take the directory for a
``torch_dist`` checkpoint).
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import pickle
import shutil
import signal
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_het.checkpoint.io import PathLike, fsync_dir, remove_stale_staging, staging_dir
from megatron_het.checkpoint.megatron_lm_args import model_config_from_args, rebuild_args
from megatron_het.checkpoint.megatron_lm_names import (
    EMBEDDING,
    LOCAL,
    OUTPUT,
    StageSlice,
    megatron_rank_state,
    merge_stage,
    padded_vocab_size,
)
from megatron_het.checkpoint.names import TRACKER_FILE, iteration_dir_name
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError

RANK_FILE = "model_optim_rng.pt"
RELEASE = "release"
CHECKPOINT_VERSION = 3.0
# Written by torch_dist saves (megatron.core.dist_checkpointing) into the iteration directory.
_DIST_MARKER = "metadata.json"
_MEGATRON_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
)


@dataclass(frozen=True)
class MegatronEnum:
    """A Megatron enum member read from ``args`` (``enum``: its class's full name)."""

    enum: str
    value: Any


@dataclass(frozen=True)
class MegatronCheckpoint:
    """A Megatron-LM checkpoint read into our single-process form: ``state`` holds FULL tensors
    by our names, vocabulary padding removed; ``args`` is the run's Namespace (rank 0's)."""

    config: ModelConfig
    state: dict[str, torch.Tensor]
    iteration: int
    directory: pathlib.Path
    args: argparse.Namespace


class _EnumReader:
    """Rebuilds members of one Megatron enum as :class:`MegatronEnum` during unpickling."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, value: Any) -> MegatronEnum:
        return MegatronEnum(self.name, value)


def _safe_globals() -> list[Any]:
    """What a real Megatron-LM file holds besides tensors, dicts, lists and numbers:
    ``args`` is an argparse.Namespace whose values include ``exit_signal`` (signal.Signals),
    ``attention_backend`` and the CUDA-graph options (Megatron enums) and dtypes (allowed by
    torch already); ``rng_state`` holds numpy's RNG state (a uint32 ndarray); Transformer Engine
    before 2.0 saved its ``_extra_state`` as io.BytesIO."""
    reconstruct = np._core.multiarray._reconstruct  # type: ignore[attr-defined]
    return [
        argparse.Namespace,
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
    for entry in _safe_globals():
        if isinstance(entry, tuple):
            names.add(entry[1])
        else:
            names.add(f"{entry.__module__}.{entry.__qualname__}")
    return names


def load_rank_file(path: pathlib.Path) -> dict[str, Any]:
    """One ``model_optim_rng.pt``, unpickled without running code (see the module docstring).
    Raises UserError, one line, for a missing, damaged or truncated file, or one that needs a
    global that is not allowed."""
    if not path.is_file():
        raise UserError(
            f"Megatron checkpoint file {path} is missing; copy the whole iteration "
            "directory (every mp_rank_* folder)"
        )
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        refused = sorted(set(needed) - _allowed_names())
        if refused:
            raise UserError(
                f"{path} needs {refused[0]} to load, which Megatron-LM checkpoints do not hold; "
                "it is refused, since loading it could run code (re-save the checkpoint "
                "without it)"
            )
        with torch.serialization.safe_globals(_safe_globals()):
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise UserError(
            f"cannot read Megatron checkpoint file {path} ({first_line}); it is damaged or "
            "truncated, copy it again"
        ) from None
    if not isinstance(payload, dict) or "model" not in payload:
        raise UserError(
            f"{path} holds no 'model' state dict; it is not a Megatron-LM checkpoint "
            "(virtual pipeline saves, with model0, model1, ..., are not supported yet)"
        )
    return payload


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """``mp_rank_01`` (pipeline size 1) or ``mp_rank_01_003``, as Megatron-LM names them."""
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _iteration_dir(load_dir: pathlib.Path, iteration: int | None) -> pathlib.Path:
    if not load_dir.is_dir():
        raise UserError(f"--load-dir {load_dir} is not a directory; pass a Megatron-LM --save dir")
    if iteration is not None:
        directory = load_dir / iteration_dir_name(iteration)
    else:
        tracker = load_dir / TRACKER_FILE
        if not tracker.is_file():
            if any(load_dir.glob("mp_rank_*")):
                return load_dir  # an iteration directory itself
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


def _check_legacy_format(directory: pathlib.Path) -> None:
    if (directory / _DIST_MARKER).is_file():
        raise UserError(
            f"{directory} is a torch_dist checkpoint, which is not supported yet; save it "
            "with --ckpt-format torch (Megatron-LM's tools/checkpoint can convert it)"
        )
    if not any(directory.glob("mp_rank_*")):
        raise UserError(
            f"{directory} holds no mp_rank_* folders; it is not a Megatron-LM checkpoint"
        )


def read_megatron_checkpoint(
    load_dir: PathLike, iteration: int | None = None, vocab_size: int | None = None
) -> MegatronCheckpoint:
    """Read a Megatron-LM legacy checkpoint of any TP/PP degree into FULL tensors by our names.

    ``iteration`` picks ``iter_XXXXXXX`` (default: the tracker's, which may be ``release``).
    The true vocabulary is ``vocab_size``, else ``args.vocab_size``, else the padded one (rows
    kept). Reads every rank file, merges TP blocks and numbers each pipeline rank's layers after
    the previous rank's. Raises UserError (one line, nothing written) for a missing or damaged
    file, a model family we cannot hold, or shards that do not fit ``args``."""
    directory = _iteration_dir(pathlib.Path(load_dir), iteration)
    _check_legacy_format(directory)
    first_path = directory / rank_dir_name(0, 0, 1) / RANK_FILE
    if not first_path.is_file():
        first_path = directory / rank_dir_name(0, 0, 2) / RANK_FILE
    first = load_rank_file(first_path)
    args = first.get("args")
    if not isinstance(args, argparse.Namespace):
        raise UserError(f"{first_path} holds no args Namespace; re-save it with Megatron-LM")
    version = first.get("checkpoint_version", 0)
    if not isinstance(version, (int, float)) or version < CHECKPOINT_VERSION:
        raise UserError(
            f"{first_path} has checkpoint_version {version}; only 3.0 (megatron-core) "
            "checkpoints are supported, re-save it with a recent Megatron-LM"
        )
    tp_size = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp_size = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    cfg, padded = model_config_from_args(args, str(first_path), tp_size, vocab_size)
    state: dict[str, torch.Tensor] = {}
    offset = 0
    output: torch.Tensor | None = None
    for pp_rank in range(pp_size):
        paths = [directory / rank_dir_name(t, pp_rank, pp_size) / RANK_FILE for t in range(tp_size)]
        payloads = [first if p == first_path else load_rank_file(p) for p in paths]
        merged, count = merge_stage([p["model"] for p in payloads], offset, str(paths[0]))
        offset += count
        output = merged.pop(OUTPUT, output)
        state.update(merged)
    if EMBEDDING in state:
        state["embedding.weight"] = state.pop(EMBEDDING)
    if output is not None and not cfg.tie_embeddings:
        state["output.weight"] = output
    if offset != cfg.num_layers:
        raise UserError(
            f"{directory} holds {offset} layers over its {pp_size} pipeline ranks but its "
            f"args say num_layers={cfg.num_layers}; copy every mp_rank_* folder"
        )
    state = _trim_vocab(state, cfg, padded, str(directory))
    _check_complete(state, cfg, str(directory))
    return MegatronCheckpoint(cfg, state, int(first.get("iteration", 0) or 0), directory, args)


def _trim_vocab(
    state: dict[str, torch.Tensor], cfg: ModelConfig, padded: int, source: str
) -> dict[str, torch.Tensor]:
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


def _check_complete(state: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> None:
    from megatron_het.model.llama import LlamaModel

    with torch.device("meta"):
        expected = LlamaModel(cfg).state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise UserError(f"{source} lacks {missing[0]} (ours); copy every mp_rank_* folder")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise UserError(
                f"{source}: {name} has shape {tuple(state[name].shape)} but its args imply "
                f"{tuple(tensor.shape)}; the checkpoint does not match its args"
            )


# ---- writing ---------------------------------------------------------------------------------
def stage_slices(num_layers: int, pp_size: int) -> list[StageSlice]:
    """Even pipeline split of ``num_layers`` over ``pp_size`` ranks (UserError unless it
    divides), as Megatron-LM splits without uneven-stage options."""
    if pp_size < 1 or num_layers % pp_size:
        raise UserError(
            f"--target-pipeline-parallel-size {pp_size} does not divide the model's "
            f"{num_layers} layers; use a divisor of {num_layers}"
        )
    per = num_layers // pp_size
    return [StageSlice(p * per, (p + 1) * per, p == 0, p == pp_size - 1) for p in range(pp_size)]


def check_tp_size(cfg: ModelConfig, tp_size: int) -> None:
    """UserError unless ``tp_size`` divides the heads, the query groups and the FFN width."""
    for what, count in (
        ("attention heads", cfg.num_attention_heads),
        ("query groups", cfg.num_query_groups),
        ("FFN hidden size", cfg.ffn_hidden_size),
    ):
        if tp_size < 1 or count % tp_size:
            raise UserError(
                f"--target-tensor-parallel-size {tp_size} does not divide the model's "
                f"{count} {what}; use a divisor of {count}"
            )


def write_megatron_checkpoint(
    save_dir: PathLike,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    iteration: int,
    tp_size: int = 1,
    pp_size: int = 1,
    naming: str = LOCAL,
    divisible_by: int = 128,
) -> pathlib.Path:
    """Write our FULL ``state`` as a Megatron-LM legacy checkpoint of ``iteration`` for
    ``tp_size`` x ``pp_size`` ranks (``naming``: local or te spec names); returns the iteration
    directory. Validates the degrees before writing anything; writes into a staging directory
    renamed into place (replacing one of the same iteration), then the tracker file."""
    check_tp_size(cfg, tp_size)
    stages = stage_slices(cfg.num_layers, pp_size)
    padded = padded_vocab_size(cfg.vocab_size, divisible_by, tp_size)
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    args = rebuild_args(cfg, tp_size, pp_size, padded, divisible_by, dtype, iteration)
    root = pathlib.Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(root)
    staging = staging_dir(root, iteration)
    staging.mkdir()
    try:
        for pp_rank, stage in enumerate(stages):
            for tp_rank in range(tp_size):
                model = megatron_rank_state(state, cfg, stage, tp_rank, tp_size, padded, naming)
                rank_dir = staging / rank_dir_name(tp_rank, pp_rank, pp_size)
                rank_dir.mkdir()
                payload = {
                    "args": args,
                    "checkpoint_version": CHECKPOINT_VERSION,
                    "iteration": int(iteration),
                    "model": model,
                }
                with open(rank_dir / RANK_FILE, "wb") as handle:
                    torch.save(payload, handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                fsync_dir(rank_dir)
        return _commit(staging, root, iteration)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _commit(staging: pathlib.Path, root: pathlib.Path, iteration: int) -> pathlib.Path:
    final = root / iteration_dir_name(iteration)
    old = None
    if final.exists():
        old = staging.with_name(staging.name + ".old")
        os.replace(final, old)
    os.replace(staging, final)
    fsync_dir(root)
    tracker_tmp = root / f".{TRACKER_FILE}.tmp"
    with open(tracker_tmp, "w", encoding="utf-8") as handle:
        handle.write(f"{iteration}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tracker_tmp, root / TRACKER_FILE)
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final
