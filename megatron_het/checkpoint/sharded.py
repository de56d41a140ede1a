"""Checkpoints of a parallel plan: every rank saves its slices, loading reshards to any plan.

Saving (:func:`save_sharded`, collective over ``groups.world``): rank r writes into one shared
staging directory ``model_shard_r.pt`` (its TP slice of every parameter it owns, under the
GLOBAL name with the global shape and offsets), ``optim_shard_r.pt`` (``exp_avg``, ``exp_avg_sq``
and ``step`` of those slices, sliced like the parameter) and ``train_state_r.pt`` (counters,
schedule, this rank's RNG). Duplicates are not written: only DP replica 0 writes the model, a
TP-replicated tensor (norms) is written by tp_rank 0, the last stage's copy of a tied embedding
is skipped, and a parameter's optimizer state is written by the first DP rank that holds it (so a
ZeRO-1 partition saves every state exactly once). After a barrier ONE rank (world rank 0) merges
the per-rank indexes into metadata.json, which also records the plan that wrote the checkpoint,
and commits (rename + tracker, :func:`~megatron_het.checkpoint.io.commit_checkpoint`); a crash
before the commit leaves the previous checkpoint the latest. The save directory must be visible
to every rank (a shared filesystem on multi-node clusters). metadata.json also lists every
rank's files with their sizes and sha256 checksums and, per file, the sha256 of each tensor
piece it holds; loading checks each opened file's size and each piece it reads.

A save can also be split for a background write: :func:`snapshot_sharded` (collective) takes CPU
copies of this rank's pieces, :meth:`~megatron_het.checkpoint.rank_files.RankFiles.write` writes
them without communication, and :func:`commit_sharded` (collective) commits once every rank's
files are complete (:mod:`megatron_het.checkpoint.async_save`).

Loading (:func:`load_sharded`) works from a checkpoint of ANY plan or of a single process: each
parameter's box for this rank (its TP slice under the new plan) is assembled from the saved
pieces that overlap it (:mod:`megatron_het.checkpoint.reshard`); files are memory-mapped, so a
rank reads, and hashes to verify, only the pieces it needs
(:class:`~megatron_het.checkpoint.reader.CheckpointReader`, the one reader of the on-disk
format).
"""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megatron_het.checkpoint.io import (
    OptimizerPiece,
    PathLike,
    TensorPiece,
    begin_checkpoint,
    commit_checkpoint,
    iteration_dir_name,
    resolve_checkpoint_dir,
    staging_dir,
)
from megatron_het.checkpoint.rank_files import (
    OptimizerState,
    RankFiles,
    first_holders,
    model_pieces,
    optimizer_pieces,
    sharded_metadata,
    write_rank_files,
)
from megatron_het.checkpoint.reader import CheckpointReader, ReadStats
from megatron_het.checkpoint.reshard import is_written_by, rank_writes, target_slice
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_validation import validate
from megatron_het.tensor_parallel.sharding import parameter_shape

SHARED_STAGING_TAG = "sharded"


# ---- saving ---------------------------------------------------------------------------------
def _agree(
    world: Any, error: BaseException | None, iteration: int, step: str, device: torch.device
) -> None:
    """Collective: raise on every rank if any rank failed ``step`` (acts as a barrier)."""
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    world.all_reduce(failed, "sum")
    if error is not None:
        raise error
    if int(failed.item()):
        raise RuntimeError(
            f"saving checkpoint iteration {iteration} failed on {int(failed)} "
            f"other rank(s) while {step}; the previous checkpoint stays the latest"
        )


def _attempt(action: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return action(), None
    except Exception as exc:
        return None, exc


def _prepare(
    save_dir: PathLike,
    iteration: int,
    model_config: ModelConfig,
    groups: Any,
    stage: nn.Module,
    optimizer_state: OptimizerState | None,
    train_state,
    weights: dict[str, torch.Tensor] | None,
    copy: bool,
) -> tuple[Callable[[], RankFiles], torch.device]:
    """Collective: rank 0 creates the shared staging directory (all agree), then the DP ranks
    settle who writes which optimizer state. Returns a no-communication builder of this rank's
    :class:`RankFiles` and the device of the agreement tensors."""
    role, world, rank = groups.role, groups.world, groups.world.rank
    device = next(stage.parameters()).device
    staging = staging_dir(save_dir, iteration, SHARED_STAGING_TAG)
    _, error = _attempt(
        lambda: begin_checkpoint(save_dir, iteration, SHARED_STAGING_TAG) if rank == 0 else None
    )
    _agree(world, error, iteration, "creating the staging directory", device)
    stage_plan = role.stage_plan
    names = None  # the parameters whose optimizer state this rank writes
    if optimizer_state is not None:
        candidates = [
            n
            for n, _ in stage.named_parameters()
            if is_written_by(n, model_config, stage_plan, role.tp_rank)
        ]
        if getattr(groups, "uniform_dp", True):
            names = first_holders(groups.dp, candidates, set(optimizer_state), device)
        else:  # replicas of different layouts: pipeline 0 holds (and writes) everything
            names = [n for n in candidates if n in optimizer_state] if role.pipeline == 0 else []

    def build() -> RankFiles:
        model = model_pieces(stage, model_config, role, weights, copy) if role.pipeline == 0 else {}
        optimizer = (
            None
            if names is None or optimizer_state is None  # names is set only with a state
            else optimizer_pieces(names, optimizer_state, model_config, stage_plan.tp, role.tp_rank)
        )
        return RankFiles(staging, rank, model, optimizer, train_state)

    return build, device


def commit_sharded(
    save_dir: PathLike,
    iteration: int,
    model_config: ModelConfig,
    plan: ParallelPlan,
    world: Any,
    has_optimizer: bool,
    has_train_state: bool,
    metadata: dict | None,
    device: torch.device,
) -> pathlib.Path:
    """Collective over ``world``, once every rank's files are complete: world rank 0 merges the
    indexes into metadata.json and commits (rename + tracker); every rank raises if it failed.
    Returns the committed iteration directory."""
    staging = staging_dir(save_dir, iteration, SHARED_STAGING_TAG)

    def commit() -> None:
        info = sharded_metadata(
            staging, iteration, model_config, plan, has_optimizer, has_train_state, metadata
        )
        commit_checkpoint(staging, save_dir, iteration, info)

    _, error = _attempt(commit if world.rank == 0 else lambda: None)
    _agree(world, error, iteration, "committing", device)
    return pathlib.Path(save_dir) / iteration_dir_name(iteration)


def save_sharded(
    save_dir: PathLike,
    iteration: int,
    model_config: ModelConfig,
    plan: ParallelPlan,
    groups: Any,
    stage: nn.Module,
    optimizer_state: OptimizerState | None,
    train_state: dict | None,
    metadata: dict | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> pathlib.Path:
    """Save this rank's share of the model, optimizer state and training state; collective.

    Args:
        groups: ``ProcessGroups`` (uses ``role``, ``world``, ``dp``).
        stage: this rank's model (TP applied; parameters under global names).
        optimizer_state: ``ParallelOptimizer.state_dict()`` - by global name, this rank's TP
            slices, possibly only the parameters it owns under ZeRO-1; None on every rank for a
            model-only checkpoint.
        train_state: this rank's ``{"iteration", "consumed_samples", "lr_schedule", "rng", ...}``
            (single-process runs resume from rank 0's); None for none.
        metadata: JSON-able extras merged into metadata.json (rank 0's are used).
        weights: the full-precision values to write instead of the parameters', by global
            name (``ParallelOptimizer.master_weights()`` under mixed precision), so the
            checkpoint holds the float32 weights training continues from.

    Communication: an all-gather over ``groups.dp`` (who writes which optimizer state) and three
    all-reduces over ``groups.world`` used as barriers (after creating the staging directory,
    after writing, after the commit). Returns the committed iteration directory. If any rank
    fails, every rank raises and the previous checkpoint stays the latest.
    """
    build, device = _prepare(
        save_dir,
        iteration,
        model_config,
        groups,
        stage,
        optimizer_state,
        train_state,
        weights,
        copy=False,
    )
    _, error = _attempt(lambda: build().write())
    _agree(groups.world, error, iteration, "writing its shards", device)
    return commit_sharded(
        save_dir,
        iteration,
        model_config,
        plan,
        groups.world,
        optimizer_state is not None,
        train_state is not None,
        metadata,
        device,
    )


def snapshot_sharded(
    save_dir: PathLike,
    iteration: int,
    model_config: ModelConfig,
    groups: Any,
    stage: nn.Module,
    optimizer_state: OptimizerState | None,
    train_state: dict | None,
    weights: dict[str, torch.Tensor] | None = None,
) -> RankFiles:
    """This rank's files of a save, with CPU copies of the parameters, for a background write.

    Arguments as for :func:`save_sharded`; ``optimizer_state``, ``weights`` and
    ``train_state`` must be copies the caller leaves alone (``ParallelOptimizer.state_dict()``
    and ``master_weights()`` return fresh CPU copies). Communication: as :func:`save_sharded`
    up to its files (staging barrier, the DP all-gather) plus one all-reduce over
    ``groups.world`` agreeing that every rank took its copies. Write the result with
    :meth:`RankFiles.write` (no communication) and commit with :func:`commit_sharded` once
    every rank's files are complete.
    """
    build, device = _prepare(
        save_dir,
        iteration,
        model_config,
        groups,
        stage,
        optimizer_state,
        train_state,
        weights,
        copy=True,
    )
    files, error = _attempt(build)
    _agree(groups.world, error, iteration, "copying its state", device)
    return files


# ---- reading --------------------------------------------------------------------------------
@torch.no_grad()
def load_sharded(
    load_dir: PathLike,
    model_config: ModelConfig,
    plan: ParallelPlan,
    groups: Any,
    stage: nn.Module,
    iteration: int | None = None,
    map_location: Any = "cpu",
    weights: dict[str, torch.Tensor] | None = None,
    stats: ReadStats | None = None,
    with_optimizer: bool = True,
) -> tuple[OptimizerState | None, dict | None]:
    """Load this rank's slices from a checkpoint of any plan (or a single process) into ``stage``.

    Every parameter of ``stage`` is overwritten with its box under ``plan`` (this rank's TP
    slice, from ``groups.role``). Collective-free; reads only the files holding needed pieces.
    ``weights``, when given, also receives every parameter's saved slice by name at the saved
    precision (float32 checkpoints stay exact for master weights of low-precision parameters).
    Every file opened has its size checked and every piece read its sha256 (a checkpoint
    without piece digests: each opened file's sha256); ``stats``, when given, counts the files
    opened, the bytes read and the bytes verified.

    Returns ``(optimizer_state, train_state)``: the optimizer state by global name for EVERY
    parameter of ``stage`` (TP-slice shaped, tensors on ``map_location``; a ZeRO-1 optimizer
    keeps what it owns), or None for a checkpoint without one (and, unread, with
    ``with_optimizer`` False); and the training state this rank saved when the checkpoint was
    written by the same plan, else rank 0's (None if absent).
    Raises UserError when the checkpoint lacks a parameter or does not cover it.
    """
    reader = CheckpointReader(resolve_checkpoint_dir(load_dir, iteration), stats)
    role = groups.role
    optimizer: OptimizerState | None = {} if reader.has_optimizer and with_optimizer else None
    for name, param in stage.named_parameters():
        box = target_slice(name, model_config, role.stage_plan.tp, role.tp_rank)
        saved_shape = reader.model_index.get(name, (None,))[0]
        if saved_shape is not None and saved_shape != parameter_shape(name, model_config):
            raise UserError(
                f"checkpoint tensor {name} has shape {saved_shape} but the model "
                f"needs {parameter_shape(name, model_config)}; load a checkpoint "
                "of this model"
            )
        value = reader.model_slice(name, box)
        param.copy_(value)
        if weights is not None:
            weights[name] = value
        if optimizer is not None:
            entry = reader.optimizer_slice(name, box)
            optimizer[name] = {
                "step": entry["step"],
                "exp_avg": entry["exp_avg"].to(map_location),
                "exp_avg_sq": entry["exp_avg_sq"].to(map_location),
            }
    same_plan = reader.saved_plan == plan.to_dict()
    train_state = reader.train_state(groups.world.rank if same_plan else 0)
    return optimizer, train_state


# ---- offline resharding ---------------------------------------------------------------------
def reshard_checkpoint(
    load_dir: PathLike, save_dir: PathLike, target_plan: ParallelPlan, iteration: int | None = None
) -> pathlib.Path:
    """Write the checkpoint at ``load_dir`` into ``save_dir`` as ``target_plan`` would save it.

    One process, no communication: for every rank of the plan its model and optimizer pieces
    are cut from the source (any plan or a single process); pipeline 0 writes them (no ZeRO-1
    partition); every rank gets the source's rank-0 training state. The plan is validated
    against the checkpoint's model first. Returns the committed iteration directory.
    """
    reader = CheckpointReader(resolve_checkpoint_dir(load_dir, iteration))
    config = reader.config
    validate(target_plan, config)
    saved_iteration = int(reader.metadata["iteration"])
    train_state = reader.train_state(0)
    staging = begin_checkpoint(save_dir, saved_iteration)
    try:
        for rank in range(target_plan.world_size):
            writes = rank_writes(config, target_plan, rank)
            model = {
                n: TensorPiece(reader.model_slice(n, box), parameter_shape(n, config), box[0])
                for n, box in writes.items()
            }
            optimizer = None
            if reader.has_optimizer:
                optimizer = {}
                for name, box in writes.items():
                    entry = reader.optimizer_slice(name, box)
                    optimizer[name] = OptimizerPiece(
                        entry["step"],
                        entry["exp_avg"],
                        entry["exp_avg_sq"],
                        parameter_shape(name, config),
                        box[0],
                    )
            write_rank_files(staging, rank, model, optimizer, train_state)
        extra = {k: v for k, v in reader.metadata.items() if k not in ("sharded",)}
        extra["resharded_from"] = str(reader.directory)
        info = sharded_metadata(
            staging,
            saved_iteration,
            config,
            target_plan,
            reader.has_optimizer,
            train_state is not None,
            extra,
        )
        return commit_checkpoint(staging, save_dir, saved_iteration, info)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
