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
to every rank (a shared filesystem on multi-node clusters).

Loading (:func:`load_sharded`) works from a checkpoint of ANY plan or of a single process: each
parameter's box for this rank (its TP slice under the new plan) is assembled from the saved
pieces that overlap it (:mod:`megatron_het.checkpoint.reshard`); files are memory-mapped, so a
rank reads only the pieces it needs (:class:`~megatron_het.checkpoint.reader.CheckpointReader`,
the one reader of the on-disk format).
"""
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any, Callable, Optional

import torch
from torch import nn

from megatron_het.checkpoint.io import (FORMAT_VERSION, OptimizerPiece, PathLike, TensorPiece,
                                        begin_checkpoint, commit_checkpoint, iteration_dir_name,
                                        resolve_checkpoint_dir, staging_dir, write_json_file,
                                        write_model_shard, write_optimizer_shard,
                                        write_train_state)
from megatron_het.checkpoint.reader import CheckpointReader
from megatron_het.checkpoint.reshard import is_written_by, rank_writes, target_slice
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan, RankRole
from megatron_het.parallel.plan_validation import validate
from megatron_het.tensor_parallel.sharding import parameter_shape

SHARED_STAGING_TAG = "sharded"
_INDEX_PREFIX = "index_"
OptimizerState = dict[str, dict[str, Any]]  # global name -> {"step", "exp_avg", "exp_avg_sq"}


# ---- what a rank writes -----------------------------------------------------------------------
def model_pieces(stage: nn.Module, config: ModelConfig, role: RankRole,
                 weights: Optional[dict[str, torch.Tensor]] = None) -> dict[str, TensorPiece]:
    """This rank's model pieces: its TP slice of each parameter it writes (see module doc),
    taken from ``weights`` by name where given (the float32 masters of low-precision
    parameters), else from the parameter."""
    pieces = {}
    for name, param in stage.named_parameters():
        if weights is not None and name in weights:
            param = weights[name]
        if not is_written_by(name, config, role.stage_plan, role.tp_rank):
            continue
        offsets, shape = target_slice(name, config, role.stage_plan.tp, role.tp_rank)
        if tuple(param.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(param.shape)} but tp_rank {role.tp_rank} "
                             f"of tp={role.stage_plan.tp} should hold {shape}")
        pieces[name] = TensorPiece(param.detach(), parameter_shape(name, config), offsets)
    return pieces


def optimizer_pieces(names: list[str], optimizer_state: OptimizerState, config: ModelConfig,
                     tp: int, tp_rank: int) -> dict[str, OptimizerPiece]:
    """Adam state of ``names`` as pieces sliced like their parameters' TP slices."""
    pieces = {}
    for name in names:
        entry = optimizer_state[name]
        offsets, shape = target_slice(name, config, tp, tp_rank)
        for key in ("exp_avg", "exp_avg_sq"):
            if tuple(entry[key].shape) != shape:
                raise ValueError(f"optimizer {key} of {name} has shape "
                                 f"{tuple(entry[key].shape)}, expected the TP slice {shape}")
        pieces[name] = OptimizerPiece(int(entry["step"]), entry["exp_avg"].detach(),
                                      entry["exp_avg_sq"].detach(),
                                      parameter_shape(name, config), offsets)
    return pieces


def _first_holders(dp_group: Any, candidates: list[str], held: set[str],
                   device: torch.device) -> list[str]:
    """The candidates this rank writes: those it holds and no earlier DP rank holds."""
    mine = [n for n in candidates if n in held]
    if dp_group.size == 1 or not candidates:
        return mine
    flags = torch.tensor([n in held for n in candidates], dtype=torch.int32, device=device)
    table = torch.empty(dp_group.size * len(candidates), dtype=torch.int32, device=device)
    dp_group.all_gather_into_tensor(table, flags)
    table = table.view(dp_group.size, len(candidates)).cpu()
    earlier = table[:dp_group.rank].sum(dim=0) if dp_group.rank else torch.zeros(len(candidates))
    return [n for i, n in enumerate(candidates) if n in held and int(earlier[i]) == 0]


def _index_of(pieces: dict[str, Any]) -> dict[str, list]:
    return {n: [list(p.global_shape), list(p.offsets), list(_shape_of(p))]
            for n, p in pieces.items()}


def _shape_of(piece: Any) -> tuple[int, ...]:
    tensor = piece.tensor if isinstance(piece, TensorPiece) else piece.exp_avg
    return tuple(tensor.shape)


def write_rank_files(staging: pathlib.Path, rank: int, model: dict[str, TensorPiece],
                     optimizer: Optional[dict[str, OptimizerPiece]],
                     train_state: Optional[dict]) -> None:
    """Write rank ``rank``'s model shard, optimizer shard (unless None), training state (unless
    None) and its piece index (merged into metadata by :func:`sharded_metadata`)."""
    write_model_shard(staging, rank, model)
    index = {"model": _index_of(model)}
    if optimizer is not None:
        write_optimizer_shard(staging, rank, optimizer)
        index["optimizer"] = _index_of(optimizer)
    if train_state is not None:
        write_train_state(staging, rank, train_state)
    write_json_file(index, staging / f"{_INDEX_PREFIX}{rank:05d}.json")


def sharded_metadata(staging: pathlib.Path, iteration: int, model_config: ModelConfig,
                     plan: ParallelPlan, has_optimizer: bool, has_train_state: bool,
                     extra: Optional[dict] = None) -> dict[str, Any]:
    """metadata.json content for a parallel save: merges (and deletes) the per-rank indexes.

    ``sharded`` holds ``plan`` (JSON form), ``world_size`` and, for ``model`` and
    ``optimizer``, ``{name: {"global_shape", "pieces": [[rank, offsets, shape], ...]}}``.
    """
    world = plan.world_size
    merged: dict[str, dict[str, dict]] = {"model": {}, "optimizer": {}}
    for rank in range(world):
        path = staging / f"{_INDEX_PREFIX}{rank:05d}.json"
        index = json.loads(path.read_text(encoding="utf-8"))
        for kind, entries in index.items():
            for name, (global_shape, offsets, shape) in entries.items():
                slot = merged[kind].setdefault(name, {"global_shape": global_shape, "pieces": []})
                slot["pieces"].append([rank, offsets, shape])
        path.unlink()
    info = dict(extra or {})
    info.update({"format_version": FORMAT_VERSION, "iteration": int(iteration),
                 "model_config": model_config.to_dict(), "num_model_shards": world,
                 "num_optimizer_shards": world if has_optimizer else 0,
                 "num_train_state_shards": world if has_train_state else 0,
                 "sharded": {"plan": plan.to_dict(), "world_size": world, **merged}})
    return info


# ---- saving ---------------------------------------------------------------------------------
def _agree(world: Any, error: Optional[BaseException], iteration: int, step: str,
           device: torch.device) -> None:
    """Collective: raise on every rank if any rank failed ``step`` (acts as a barrier)."""
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    world.all_reduce(failed, "sum")
    if error is not None:
        raise error
    if int(failed.item()):
        raise RuntimeError(f"saving checkpoint iteration {iteration} failed on {int(failed)} "
                           f"other rank(s) while {step}; the previous checkpoint stays the latest")


def _attempt(action: Callable[[], Any]) -> tuple[Any, Optional[BaseException]]:
    try:
        return action(), None
    except Exception as exc:  # noqa: BLE001 - re-raised by _agree after the other ranks know
        return None, exc


def save_sharded(save_dir: PathLike, iteration: int, model_config: ModelConfig,
                 plan: ParallelPlan, groups: Any, stage: nn.Module,
                 optimizer_state: Optional[OptimizerState], train_state: Optional[dict],
                 metadata: Optional[dict] = None,
                 weights: Optional[dict[str, torch.Tensor]] = None) -> pathlib.Path:
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
    role, world, rank = groups.role, groups.world, groups.world.rank
    device = next(stage.parameters()).device
    staging = staging_dir(save_dir, iteration, SHARED_STAGING_TAG)
    _, error = _attempt(lambda: begin_checkpoint(save_dir, iteration, SHARED_STAGING_TAG)
                        if rank == 0 else None)
    _agree(world, error, iteration, "creating the staging directory", device)
    stage_plan = role.stage_plan
    names = None  # the parameters whose optimizer state this rank writes
    if optimizer_state is not None:
        candidates = [n for n, _ in stage.named_parameters()
                      if is_written_by(n, model_config, stage_plan, role.tp_rank)]
        if getattr(groups, "uniform_dp", True):
            names = _first_holders(groups.dp, candidates, set(optimizer_state), device)
        else:  # replicas of different layouts: pipeline 0 holds (and writes) everything
            names = [n for n in candidates if n in optimizer_state] if role.pipeline == 0 else []

    def write() -> None:
        model = model_pieces(stage, model_config, role, weights) if role.pipeline == 0 else {}
        optimizer = (None if names is None else optimizer_pieces(
            names, optimizer_state, model_config, stage_plan.tp, role.tp_rank))
        write_rank_files(staging, rank, model, optimizer, train_state)

    _, error = _attempt(write)
    _agree(world, error, iteration, "writing its shards", device)

    def commit() -> None:
        info = sharded_metadata(staging, iteration, model_config, plan,
                                optimizer_state is not None, train_state is not None, metadata)
        commit_checkpoint(staging, save_dir, iteration, info)

    _, error = _attempt(commit if rank == 0 else lambda: None)
    _agree(world, error, iteration, "committing", device)
    return pathlib.Path(save_dir) / iteration_dir_name(iteration)


# ---- reading --------------------------------------------------------------------------------
@torch.no_grad()
def load_sharded(load_dir: PathLike, model_config: ModelConfig, plan: ParallelPlan,
                 groups: Any, stage: nn.Module, iteration: Optional[int] = None,
                 map_location: Any = "cpu",
                 weights: Optional[dict[str, torch.Tensor]] = None
                 ) -> tuple[Optional[OptimizerState], Optional[dict]]:
    """Load this rank's slices from a checkpoint of any plan (or a single process) into ``stage``.

    Every parameter of ``stage`` is overwritten with its box under ``plan`` (this rank's TP
    slice, from ``groups.role``). Collective-free; reads only the files holding needed pieces.
    ``weights``, when given, also receives every parameter's saved slice by name at the saved
    precision (float32 checkpoints stay exact for master weights of low-precision parameters).

    Returns ``(optimizer_state, train_state)``: the optimizer state by global name for EVERY
    parameter of ``stage`` (TP-slice shaped, tensors on ``map_location``; a ZeRO-1 optimizer
    keeps what it owns), or None for a checkpoint without one; and the training state this rank
    saved when the checkpoint was written by the same plan, else rank 0's (None if absent).
    Raises UserError when the checkpoint lacks a parameter or does not cover it.
    """
    reader = CheckpointReader(resolve_checkpoint_dir(load_dir, iteration))
    role = groups.role
    optimizer: Optional[OptimizerState] = {} if reader.has_optimizer else None
    for name, param in stage.named_parameters():
        box = target_slice(name, model_config, role.stage_plan.tp, role.tp_rank)
        saved_shape = reader.model_index.get(name, (None,))[0]
        if saved_shape is not None and saved_shape != parameter_shape(name, model_config):
            raise UserError(f"checkpoint tensor {name} has shape {saved_shape} but the model "
                            f"needs {parameter_shape(name, model_config)}; load a checkpoint "
                            "of this model")
        value = reader.model_slice(name, box)
        param.copy_(value)
        if weights is not None:
            weights[name] = value
        if optimizer is not None:
            entry = reader.optimizer_slice(name, box)
            optimizer[name] = {"step": entry["step"],
                               "exp_avg": entry["exp_avg"].to(map_location),
                               "exp_avg_sq": entry["exp_avg_sq"].to(map_location)}
    same_plan = reader.saved_plan == plan.to_dict()
    train_state = reader.train_state(groups.world.rank if same_plan else 0)
    return optimizer, train_state


# ---- offline resharding ---------------------------------------------------------------------
def reshard_checkpoint(load_dir: PathLike, save_dir: PathLike, target_plan: ParallelPlan,
                       iteration: Optional[int] = None) -> pathlib.Path:
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
            model = {n: TensorPiece(reader.model_slice(n, box), parameter_shape(n, config),
                                    box[0]) for n, box in writes.items()}
            optimizer = None
            if reader.has_optimizer:
                optimizer = {}
                for name, box in writes.items():
                    entry = reader.optimizer_slice(name, box)
                    optimizer[name] = OptimizerPiece(entry["step"], entry["exp_avg"],
                                                     entry["exp_avg_sq"],
                                                     parameter_shape(name, config), box[0])
            write_rank_files(staging, rank, model, optimizer, train_state)
        extra = {k: v for k, v in reader.metadata.items() if k not in ("sharded",)}
        extra["resharded_from"] = str(reader.directory)
        info = sharded_metadata(staging, saved_iteration, config, target_plan,
                                reader.has_optimizer, train_state is not None, extra)
        return commit_checkpoint(staging, save_dir, saved_iteration, info)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
