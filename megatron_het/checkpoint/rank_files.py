"""What one rank writes in a parallel save, and the metadata that indexes every rank's pieces.

A rank's files (:class:`RankFiles`): ``model_shard_r.pt`` with its TP slice of each parameter it
writes, ``optim_shard_r.pt`` with the Adam state of the parameters it is the first DP holder of,
``train_state_r.pt``, and last ``index_r.json`` listing its pieces and its files' sizes and
checksums with the sha256 of every tensor piece in them
(:class:`~megatron_het.checkpoint.integrity.FileRecord`). Writing them needs no communication,
so a background thread can do it (:mod:`megatron_het.checkpoint.async_save`).
:func:`sharded_metadata` merges the indexes into metadata.json when the save is committed. The
save itself is :mod:`megatron_het.checkpoint.sharded`.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_het.checkpoint.integrity import FILES_KEY, FileRecord
from megatron_het.checkpoint.io import (
    FORMAT_VERSION,
    OptimizerPiece,
    TensorPiece,
    model_shard_name,
    optimizer_shard_name,
    train_state_name,
    write_json_file,
    write_model_shard,
    write_optimizer_shard,
    write_train_state,
)
from megatron_het.checkpoint.reshard import is_written_by, target_slice
from megatron_het.config import ModelConfig
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import RankRole
from megatron_het.tensor_parallel.sharding import parameter_shape

INDEX_PREFIX = "index_"
OptimizerState = dict[str, dict[str, Any]]  # global name -> {"step", "exp_avg", "exp_avg_sq"}


# ---- what a rank writes -----------------------------------------------------------------------
def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that later in-place updates of ``tensor`` do not reach."""
    out = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="cpu")
    out.copy_(tensor.detach())
    return out


def model_pieces(
    stage: nn.Module,
    config: ModelConfig,
    role: RankRole,
    weights: dict[str, torch.Tensor] | None = None,
    copy: bool = False,
) -> dict[str, TensorPiece]:
    """This rank's model pieces: its TP slice of each parameter it writes (see module doc),
    taken from ``weights`` by name where given (the float32 masters of low-precision
    parameters), else from the parameter (a CPU copy of it with ``copy``)."""
    pieces = {}
    for name, param in stage.named_parameters():
        if not is_written_by(name, config, role.stage_plan, role.tp_rank):
            continue
        if weights is not None and name in weights:
            value = weights[name]
        else:
            value = _cpu_copy(param) if copy else param.detach()
        offsets, shape = target_slice(name, config, role.stage_plan.tp, role.tp_rank)
        if tuple(value.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)} but tp_rank {role.tp_rank} "
                f"of tp={role.stage_plan.tp} should hold {shape}"
            )
        pieces[name] = TensorPiece(value, parameter_shape(name, config), offsets)
    return pieces


def optimizer_pieces(
    names: list[str], optimizer_state: OptimizerState, config: ModelConfig, tp: int, tp_rank: int
) -> dict[str, OptimizerPiece]:
    """Adam state of ``names`` as pieces sliced like their parameters' TP slices."""
    pieces = {}
    for name in names:
        entry = optimizer_state[name]
        offsets, shape = target_slice(name, config, tp, tp_rank)
        for key in ("exp_avg", "exp_avg_sq"):
            if tuple(entry[key].shape) != shape:
                raise ValueError(
                    f"optimizer {key} of {name} has shape "
                    f"{tuple(entry[key].shape)}, expected the TP slice {shape}"
                )
        pieces[name] = OptimizerPiece(
            int(entry["step"]),
            entry["exp_avg"].detach(),
            entry["exp_avg_sq"].detach(),
            parameter_shape(name, config),
            offsets,
        )
    return pieces


def first_holders(
    dp_group: Any, candidates: list[str], held: set[str], device: torch.device
) -> list[str]:
    """The candidates this rank writes: those it holds and no earlier DP rank holds.
    Collective over ``dp_group`` (one all-gather of held flags) when it has several ranks."""
    mine = [n for n in candidates if n in held]
    if dp_group.size == 1 or not candidates:
        return mine
    flags = torch.tensor([n in held for n in candidates], dtype=torch.int32, device=device)
    table = torch.empty(dp_group.size * len(candidates), dtype=torch.int32, device=device)
    dp_group.all_gather_into_tensor(table, flags)
    table = table.view(dp_group.size, len(candidates)).cpu()
    earlier = table[: dp_group.rank].sum(dim=0) if dp_group.rank else torch.zeros(len(candidates))
    return [n for i, n in enumerate(candidates) if n in held and int(earlier[i]) == 0]


def _index_of(pieces: dict[str, Any]) -> dict[str, list]:
    return {
        n: [list(p.global_shape), list(p.offsets), list(_shape_of(p))] for n, p in pieces.items()
    }


def _shape_of(piece: Any) -> tuple[int, ...]:
    tensor = piece.tensor if isinstance(piece, TensorPiece) else piece.exp_avg
    return tuple(tensor.shape)


def write_rank_files(
    staging: pathlib.Path,
    rank: int,
    model: dict[str, TensorPiece],
    optimizer: dict[str, OptimizerPiece] | None,
    train_state: dict | None,
    before_file: Callable[[str], None] | None = None,
) -> list[FileRecord]:
    """Write rank ``rank``'s model shard, optimizer shard (unless None), training state (unless
    None) and, last, its piece index with the files' sizes, checksums and piece digests (merged
    into metadata by :func:`sharded_metadata`). ``before_file(name)`` is called before each file
    (a test's way to slow or break a save). No communication. Returns the records of the files
    written."""
    before = before_file or (lambda name: None)
    before(model_shard_name(rank))
    records = [write_model_shard(staging, rank, model)]
    index: dict[str, Any] = {"model": _index_of(model)}
    if optimizer is not None:
        before(optimizer_shard_name(rank))
        records.append(write_optimizer_shard(staging, rank, optimizer))
        index["optimizer"] = _index_of(optimizer)
    if train_state is not None:
        before(train_state_name(rank))
        records.append(write_train_state(staging, rank, train_state))
    index[FILES_KEY] = {r.name: r.to_json() for r in records}
    write_json_file(index, staging / f"{INDEX_PREFIX}{rank:05d}.json")
    return records


def sharded_metadata(
    staging: pathlib.Path,
    iteration: int,
    model_config: ModelConfig,
    plan: ParallelPlan,
    has_optimizer: bool,
    has_train_state: bool,
    extra: dict | None = None,
) -> dict[str, Any]:
    """metadata.json content for a parallel save: merges (and deletes) the per-rank indexes.

    ``sharded`` holds ``plan`` (JSON form), ``world_size`` and, for ``model`` and
    ``optimizer``, ``{name: {"global_shape", "pieces": [[rank, offsets, shape], ...]}}``;
    ``files`` maps every rank's file names to ``{"bytes", "sha256", "tensors"}``, ``tensors``
    holding the sha256 of each piece's raw bytes by key (``name`` in a model shard,
    ``name/exp_avg`` and ``name/exp_avg_sq`` in an optimizer shard, tensor paths in a training
    state; see :mod:`megatron_het.checkpoint.integrity`).
    """
    world = plan.world_size
    merged: dict[str, dict[str, dict]] = {"model": {}, "optimizer": {}}
    files: dict[str, dict] = {}
    for rank in range(world):
        path = staging / f"{INDEX_PREFIX}{rank:05d}.json"
        index = json.loads(path.read_text(encoding="utf-8"))
        files.update(index.pop(FILES_KEY, {}))
        for kind, entries in index.items():
            for name, (global_shape, offsets, shape) in entries.items():
                slot = merged[kind].setdefault(name, {"global_shape": global_shape, "pieces": []})
                slot["pieces"].append([rank, offsets, shape])
        path.unlink()
    info = dict(extra or {})
    info.update(
        {
            "format_version": FORMAT_VERSION,
            "iteration": int(iteration),
            "model_config": model_config.to_dict(),
            "num_model_shards": world,
            "num_optimizer_shards": world if has_optimizer else 0,
            "num_train_state_shards": world if has_train_state else 0,
            FILES_KEY: dict(sorted(files.items())),
            "sharded": {"plan": plan.to_dict(), "world_size": world, **merged},
        }
    )
    return info


@dataclass
class RankFiles:
    """One rank's share of a save, ready to write without communication: where, its model and
    optimizer pieces and its training state."""

    staging: pathlib.Path
    rank: int
    model: dict[str, TensorPiece]
    optimizer: dict[str, OptimizerPiece] | None
    train_state: dict | None

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the tensors this rank writes (model pieces and Adam moments)."""
        total = sum(p.tensor.numel() * p.tensor.element_size() for p in self.model.values())
        for piece in (self.optimizer or {}).values():
            total += sum(t.numel() * t.element_size() for t in (piece.exp_avg, piece.exp_avg_sq))
        return total

    def write(self, before_file: Callable[[str], None] | None = None) -> list[FileRecord]:
        """Write the files (:func:`write_rank_files`); no communication."""
        return write_rank_files(
            self.staging, self.rank, self.model, self.optimizer, self.train_state, before_file
        )
