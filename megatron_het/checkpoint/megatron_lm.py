"""Megatron-LM checkpoints in the legacy ``--ckpt-format torch`` layout, read and written.

Layout of a Megatron-LM save directory::

    SAVE/latest_checkpointed_iteration.txt       an iteration number, or "release"
    SAVE/iter_0000500/mp_rank_TT/model_optim_rng.pt        pipeline size 1
    SAVE/iter_0000500/mp_rank_TT_PPP/model_optim_rng.pt    pipeline size > 1
    SAVE/release/...                              for the tracker's "release"

Each file is a ``torch.save``'d dict: ``model`` (that TP/PP rank's megatron-core state dict, see
:mod:`megatron_het.checkpoint.megatron_lm_names`), ``args`` (the run's ``argparse.Namespace``),
``iteration``, ``checkpoint_version`` (3.0) and, from training runs, ``optimizer``,
``opt_param_scheduler`` and ``rng_state``. Only the model is converted: the optimizer state of
this format is indexed by position, not by parameter (a torch_dist save's is read, see
:mod:`megatron_het.checkpoint.megatron_lm_optim`). Files are read without running code
(:func:`~megatron_het.checkpoint.megatron_lm_files.load_pickled`).

:func:`read_megatron_checkpoint` reads either format: an iteration directory whose metadata.json
names a ``sharded_backend`` goes to :mod:`megatron_het.checkpoint.megatron_lm_dist`.

Writing lays our weights out for a given TP and PP degree with an ``args`` Namespace holding
what megatron-core needs to rebuild the model, fsync'ed in a staging directory renamed into
place, then the tracker file (no metadata.json: Megatron-LM would take the directory for a
``torch_dist`` checkpoint).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
from typing import Any

import torch

from megatron_het.checkpoint.io import PathLike, fsync_dir, remove_stale_staging, staging_dir
from megatron_het.checkpoint.megatron_lm_args import model_config_from_args, rebuild_args
from megatron_het.checkpoint.megatron_lm_dist import read_dist_checkpoint
from megatron_het.checkpoint.megatron_lm_files import (
    CHECKPOINT_VERSION,
    RELEASE,
    MegatronCheckpoint,
    MegatronEnum,
    check_complete,
    checkpoint_args,
    commit_iteration,
    iteration_dir,
    load_pickled,
    sharded_backend,
    trim_vocab,
)
from megatron_het.checkpoint.megatron_lm_names import (
    EMBEDDING,
    LOCAL,
    OUTPUT,
    check_tp_size,
    megatron_rank_state,
    merge_stage,
    padded_vocab_size,
    stage_slices,
)
from megatron_het.checkpoint.megatron_lm_optim import LEGACY_OPTIMIZER, read_dist_optimizer
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError

__all__ = [
    "CHECKPOINT_VERSION",
    "RANK_FILE",
    "RELEASE",
    "MegatronCheckpoint",
    "MegatronEnum",
    "load_rank_file",
    "rank_dir_name",
    "read_megatron_checkpoint",
    "write_megatron_checkpoint",
]

RANK_FILE = "model_optim_rng.pt"


def load_rank_file(path: pathlib.Path) -> dict[str, Any]:
    """One ``model_optim_rng.pt``, unpickled without running code. Raises UserError, one line,
    for a missing, damaged or truncated file, one that needs a global that is not allowed, or
    one without a ``model``."""
    payload = load_pickled(path, "copy the whole iteration directory (every mp_rank_* folder)")
    if not isinstance(payload, dict) or "model" not in payload:
        raise UserError(
            f"{path} holds no 'model' state dict; it is not a Megatron-LM checkpoint "
            "(virtual pipeline saves, with model0, model1, ..., are not supported yet)"
        )
    return payload


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """``mp_rank_01`` (pipeline size 1) or ``mp_rank_01_003``, as Megatron-LM names them."""
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _check_legacy_format(directory: pathlib.Path) -> None:
    if not any(directory.glob("mp_rank_*")):
        if (directory / ".metadata").is_file() or any(directory.glob("*.distcp")):
            raise UserError(
                f"{directory} is an unfinished torch_dist save (no metadata.json, which "
                "Megatron-LM writes last); use an earlier iteration or save it again"
            )
        raise UserError(
            f"{directory} holds no mp_rank_* folders; it is not a Megatron-LM checkpoint"
        )


def read_megatron_checkpoint(
    load_dir: PathLike,
    iteration: int | None = None,
    vocab_size: int | None = None,
    with_optimizer: bool = False,
) -> MegatronCheckpoint:
    """Read a Megatron-LM checkpoint, legacy (any TP/PP degree) or ``torch_dist`` (told by
    its metadata.json), into FULL tensors by our names.

    ``iteration`` picks ``iter_XXXXXXX`` (default: the tracker's, which may be ``release``).
    The true vocabulary is ``vocab_size``, else ``args.vocab_size``, else the padded one (rows
    kept). A legacy save: reads every rank file, merges TP blocks and numbers each pipeline
    rank's layers after the previous rank's. Raises UserError (one line, nothing written) for a
    missing or damaged file, a model family we cannot hold, or shards that do not fit ``args``.

    ``with_optimizer`` also reads Adam's state (a torch_dist save that keeps it by parameter,
    :mod:`~megatron_het.checkpoint.megatron_lm_optim`); UserError for any other save."""
    directory = iteration_dir(pathlib.Path(load_dir), iteration)
    backend = sharded_backend(directory)
    if backend is not None:
        loaded = read_dist_checkpoint(directory, backend, vocab_size)
        if with_optimizer:
            loaded = dataclasses.replace(loaded, optimizer=read_dist_optimizer(loaded))
        return loaded
    if with_optimizer:
        raise UserError(LEGACY_OPTIMIZER.format(source=directory))
    _check_legacy_format(directory)
    first_path = directory / rank_dir_name(0, 0, 1) / RANK_FILE
    if not first_path.is_file():
        first_path = directory / rank_dir_name(0, 0, 2) / RANK_FILE
    first = load_rank_file(first_path)
    args = checkpoint_args(first, first_path)
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
    state = trim_vocab(state, cfg, padded, str(directory))
    check_complete(state, cfg, str(directory))
    return MegatronCheckpoint(cfg, state, int(first.get("iteration", 0) or 0), directory, args)


# ---- writing ----------------------------------------------------------------------------------
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
        return commit_iteration(staging, root, iteration)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
