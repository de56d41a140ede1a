"""Megatron-LM checkpoints in the ``--ckpt-format torch_dist`` layout (megatron-core's
dist_checkpointing over torch.distributed.checkpoint, Megatron-LM's default), read and written.

Layout of an iteration directory (the save directory's tracker is the legacy one)::

    iter_0000500/metadata.json    {"sharded_backend": "torch_dist", ...}, written last
    iter_0000500/common.pt        torch.save'd: args, iteration, checkpoint_version, ...
    iter_0000500/.metadata        torch.distributed.checkpoint's index (a pickle)
    iter_0000500/__R_T.distcp     the tensors and objects each rank R (thread T) wrote

The tensors are global and sharding-free: each key names one tensor of its GLOBAL shape, whatever
TP/PP/VPP wrote it, and a loader reads the boxes its own plan needs. Layers of one kind are
stacked on a leading layer axis under a key without the layer number (``L`` layers, ``Vp`` the
padded vocabulary, ``F`` the FFN width; local and Transformer Engine specs use the same keys)::

    megatron-core key                                          global shape   ours
    embedding.word_embeddings.weight                           [Vp, H]        embedding.weight
    decoder.layers.self_attention.linear_qkv.layer_norm_weight [L, H]         input_norm
    decoder.layers.self_attention.linear_qkv.weight            [L, qkv, H]    attention.qkv
    decoder.layers.self_attention.linear_proj.weight           [L, H, H]      attention.proj
    decoder.layers.mlp.linear_fc1.layer_norm_weight            [L, H]         post_attention_norm
    decoder.layers.mlp.linear_fc1.weight                       [L, 2F, H]     [gate; up]
    decoder.layers.mlp.linear_fc2.weight                       [L, H, F]      mlp.down
    decoder.final_layernorm.weight                             [H]            final_norm.weight
    output_layer.weight (untied only)                          [Vp, H]        output.weight

``qkv`` rows are group-major as ours. fc1's global rows are the whole gate then the whole up
(megatron-core's factory cuts each TP rank's ``[gate_k; up_k]`` into those two halves). Reading
also takes per-layer keys (``decoder.layers.5.…``, saved for non-homogeneous layers), fc1 as
``weight_w``/``weight_v`` halves and the older local-spec norm names. ``_extra_state`` entries
are pickled objects (``<key>/shard_<layer>_<L>``): reading skips them, as it skips the optimizer
(``optimizer.…``, read by :mod:`~megatron_het.checkpoint.megatron_lm_optim` when asked) and RNG
state; writing writes None for each, as megatron-core would.

Reading never runs code: ``common.pt`` is read as the legacy rank files are, ``.metadata`` by
:func:`~megatron_het.checkpoint.megatron_lm_files.read_dcp_metadata` (torch's own reader would
``pickle.load`` it), and the tensor files by torch's reader (``torch.load(weights_only=True)``
per tensor). Only the model's tensors are read; no process group is used either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import pathlib
import re
import shutil
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException

from megatron_het.checkpoint.io import PathLike, fsync_dir, remove_stale_staging, staging_dir
from megatron_het.checkpoint.megatron_lm_args import model_config_from_args, rebuild_args
from megatron_het.checkpoint.megatron_lm_files import (
    CHECKPOINT_VERSION,
    DIST_CONFIG_FILE,
    CheckedReader,
    MegatronCheckpoint,
    check_complete,
    checkpoint_args,
    commit_iteration,
    load_pickled,
    read_dcp_metadata,
    trim_vocab,
)
from megatron_het.checkpoint.megatron_lm_names import (
    EMBEDDING,
    EXTRA_STATE,
    EXTRA_STATE_MODULES,
    FC1,
    FINAL_NORM,
    LAYER_TENSORS,
    LOCAL,
    NORMS,
    OUTPUT,
    TE,
    check_tp_size,
    pad_rows,
    padded_vocab_size,
    stage_slices,
    unsupported_key,
)
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError

TORCH_DIST = "torch_dist"
COMMON_FILE = "common.pt"
_LAYER_KEY = re.compile(r"decoder\.layers\.(?:(\d+)\.)?(.+)")
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
# Stacked-layer key suffix -> our per-layer suffix (fc1 is split apart separately).
_WRITTEN = {**NORMS[TE], **{theirs: ours for theirs, (ours, _) in LAYER_TENSORS.items()}}
_READ = {**_WRITTEN, **NORMS[LOCAL]}
_FC1_HALVES = {f"{FC1}_w": "mlp.gate.weight", f"{FC1}_v": "mlp.up.weight"}
# What megatron-core writes as ``content_metadata`` for a model saved without optimizer.
_CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


# ---- reading ---------------------------------------------------------------------------------
def model_key(key: str, source: str) -> bool:
    """Whether ``key`` is a model tensor to read; UserError for a model tensor we cannot hold."""
    if not key.startswith(_MODEL_PREFIXES):
        return False  # optimizer state, RNG state, ...
    what = unsupported_key(key)
    if what is not None:
        raise UserError(
            f"{source} holds {key}: {what} are not supported (megatron_het is a Llama "
            "model: RMSNorm, RoPE, SwiGLU, no biases)"
        )
    match = _LAYER_KEY.fullmatch(key)
    known = key in (EMBEDDING, FINAL_NORM, OUTPUT) or (
        match is not None and (match.group(2) in _READ or match.group(2) in (FC1, *_FC1_HALVES))
    )
    if not known:
        raise UserError(
            f"{source} holds {key}, which a megatron-core Llama GPTModel (local or "
            "Transformer Engine spec) does not have; only those can be converted"
        )
    return True


def check_files(directory: pathlib.Path, metadata: dcp_metadata.Metadata, keys: set[str]) -> None:
    """UserError naming the first data file that ``keys`` need and that is missing or short."""
    needed: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn in keys:
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        path = directory / name
        size = path.stat().st_size if path.is_file() else -1
        if size < end:
            state = "is missing" if size < 0 else f"is truncated ({size} of {end}+ bytes)"
            raise UserError(f"{path} {state}; copy the whole iteration directory again")


def load_tensors(
    directory: pathlib.Path,
    source: str,
    prefix: str = "",
    metadata: dcp_metadata.Metadata | None = None,
) -> dict[str, torch.Tensor]:
    """The model tensors of ``directory`` at their global shapes and saved dtypes, by
    megatron-core key; with ``prefix`` (e.g. ``optimizer.state.exp_avg.``) the tensors stored
    under ``prefix`` + a model key, by that model key."""
    metadata = read_dcp_metadata(directory) if metadata is None else metadata
    targets = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, dcp_metadata.TensorStorageMetadata)
        and key.startswith(prefix)
        and model_key(key[len(prefix) :], source)
    }
    check_files(directory, metadata, set(targets))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=CheckedReader(directory, metadata), no_dist=True)
    except (CheckpointException, OSError, RuntimeError, ValueError, EOFError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise UserError(
            f"cannot read the tensors of {source} ({first_line}); it is damaged, copy it again"
        ) from None
    return {key[len(prefix) :]: tensor for key, tensor in targets.items()}


def our_state(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str
) -> dict[str, torch.Tensor]:
    """Our per-layer names (new tensors) for the global Megatron ``tensors``, which are taken
    out of ``tensors`` one by one (so a stacked tensor is freed once its layers are copied)."""
    state: dict[str, torch.Tensor] = {}

    def put(layer: int, suffix: str, tensor: torch.Tensor) -> None:
        if suffix == FC1:
            gate, up = tensor.chunk(2)
            state[f"layers.{layer}.mlp.gate.weight"] = gate.clone()
            state[f"layers.{layer}.mlp.up.weight"] = up.clone()
        else:
            ours = _FC1_HALVES.get(suffix) or _READ[suffix]
            state[f"layers.{layer}.{ours}"] = tensor.clone()

    for key in list(tensors):
        tensor = tensors.pop(key)
        if key in (EMBEDDING, OUTPUT, FINAL_NORM):
            ours = {EMBEDDING: "embedding.weight", OUTPUT: "output.weight"}.get(key)
            state[ours or "final_norm.weight"] = tensor
            continue
        match = _LAYER_KEY.fullmatch(key)
        assert match is not None, key  # model_key let only layer keys through
        if match.group(1) is not None:
            put(int(match.group(1)), match.group(2), tensor)
            continue
        if tensor.shape[0] != cfg.num_layers:
            raise UserError(
                f"{source}: {key} stacks {tensor.shape[0]} layers but its args say "
                f"num_layers={cfg.num_layers}; the checkpoint does not match its args"
            )
        for layer in range(cfg.num_layers):
            put(layer, match.group(2), tensor[layer])
    if cfg.tie_embeddings:
        state.pop("output.weight", None)
    return state


def read_dist_checkpoint(
    directory: pathlib.Path, backend: str = TORCH_DIST, vocab_size: int | None = None
) -> MegatronCheckpoint:
    """Read the ``torch_dist`` iteration ``directory`` (``backend``: what its metadata.json
    names) into FULL tensors by our names; ``vocab_size`` as for the legacy reader.

    Reads common.pt (args, iteration) and only the model's tensors; no process group is used.
    Raises UserError (one line) for another backend, a missing, torn or damaged file, a model
    family we cannot hold, or tensors that do not fit the args."""
    if backend != TORCH_DIST:
        raise UserError(
            f"{directory} is a dist checkpoint with sharded_backend {backend!r}; only "
            f"{TORCH_DIST} is supported (save it with --ckpt-format torch_dist)"
        )
    common_path = directory / COMMON_FILE
    common = load_pickled(common_path, "copy the whole iteration directory")
    args = checkpoint_args(common, common_path)
    # The tensors are global, so the degrees that wrote them (virtual pipeline too) do not matter.
    readable = argparse.Namespace(**{**vars(args), "virtual_pipeline_model_parallel_size": None})
    cfg, padded = model_config_from_args(readable, str(common_path), 1, vocab_size)
    state = our_state(load_tensors(directory, str(directory)), cfg, str(directory))
    state = trim_vocab(state, cfg, padded, str(directory))
    check_complete(state, cfg, str(directory))
    return MegatronCheckpoint(cfg, state, int(common.get("iteration", 0) or 0), directory, args)


# ---- writing ---------------------------------------------------------------------------------
def _none_object() -> io.BytesIO:
    """An ``_extra_state`` object as megatron-core stores one: ``torch.save([None])``."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    buffer.seek(0)
    return buffer


def dist_state(
    state: dict[str, torch.Tensor], cfg: ModelConfig, padded_vocab: int, naming: str = LOCAL
) -> dict[str, torch.Tensor | io.BytesIO]:
    """Our FULL ``state`` as the global tensors (new, stacked per layer kind) and
    ``_extra_state`` objects (for the modules of ``naming``'s spec) of a torch_dist save."""
    layers = range(cfg.num_layers)

    def stacked(ours: str) -> torch.Tensor:
        return torch.stack([state[f"layers.{i}.{ours}"] for i in layers])

    out: dict[str, torch.Tensor | io.BytesIO] = {
        EMBEDDING: pad_rows(state["embedding.weight"], padded_vocab).clone()
    }
    for theirs, ours in _WRITTEN.items():
        out[f"decoder.layers.{theirs}"] = stacked(ours)
    out[f"decoder.layers.{FC1}"] = torch.cat(
        (stacked("mlp.gate.weight"), stacked("mlp.up.weight")), 1
    )
    out[FINAL_NORM] = state["final_norm.weight"].clone()
    if not cfg.tie_embeddings:
        out[OUTPUT] = pad_rows(state["output.weight"], padded_vocab).clone()
    for module in EXTRA_STATE_MODULES[naming]:
        for i in layers:
            out[f"decoder.layers.{module}.{EXTRA_STATE}/shard_{i}_{cfg.num_layers}"] = (
                _none_object()
            )
    return out


@dataclasses.dataclass(frozen=True)
class DistExtras:
    """What a torch_dist save holds besides the model: global ``tensors`` by megatron-core key,
    ``common`` values for common.pt (merged over the model's), ``args`` fields to set and
    ``content_metadata`` entries (e.g. the distributed optimizer's sharding type)."""

    tensors: dict[str, torch.Tensor]
    common: dict[str, Any]
    args: dict[str, Any]
    content_metadata: dict[str, Any]


class _StoredBytesPlanner(dcp.DefaultSavePlanner):
    """Stores the objects' bytes as given (megatron-core's loader unpickles them once),
    instead of pickling the BytesIO again."""

    def transform_object(self, write_item: Any, object: Any) -> Any:
        return object


def _fsync_file(path: pathlib.Path, data: bytes | None = None, obj: Any = None) -> None:
    with open(path, "wb") as handle:
        if data is not None:
            handle.write(data)
        else:
            torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def write_dist_checkpoint(
    save_dir: PathLike,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    iteration: int,
    tp_size: int = 1,
    pp_size: int = 1,
    naming: str = LOCAL,
    divisible_by: int = 128,
    extras: DistExtras | None = None,
) -> pathlib.Path:
    """Write our FULL ``state`` as a Megatron-LM torch_dist checkpoint of ``iteration`` from
    this one process (no process group used); returns the iteration directory. ``extras``
    adds the optimizer's part (:mod:`~megatron_het.checkpoint.megatron_lm_optim`).

    The tensors are global, so megatron-core loads them at any TP/PP; ``tp_size`` and
    ``pp_size`` are the degrees the ``args`` record (validated against the model) and ``tp_size``
    sets the vocabulary padding, as a Megatron-LM run of those degrees would have saved. The
    args say that no optimizer or RNG state was saved. Writes common.pt, the tensors, then
    metadata.json into a staging directory, fsync'ed and renamed into place (replacing one of
    the same iteration), then the tracker file."""
    check_tp_size(cfg, tp_size)
    stage_slices(cfg.num_layers, pp_size)
    padded = padded_vocab_size(cfg.vocab_size, divisible_by, tp_size)
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    args = rebuild_args(cfg, tp_size, pp_size, padded, divisible_by, dtype, iteration)
    args.ckpt_format, args.no_save_optim, args.no_save_rng = TORCH_DIST, True, True
    tensors = dist_state(state, cfg, padded, naming)
    content_metadata = dict(_CONTENT_METADATA)
    if extras is not None:
        tensors.update(extras.tensors)
        vars(args).update(extras.args)
        content_metadata.update(extras.content_metadata)
    root = pathlib.Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(root)
    staging = staging_dir(root, iteration)
    staging.mkdir()
    try:
        common = {
            "args": args,
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": int(iteration),
            "content_metadata": content_metadata,
            **(extras.common if extras is not None else {}),
        }
        _fsync_file(staging / COMMON_FILE, obj=common)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                tensors,
                storage_writer=dcp.FileSystemWriter(staging, sync_files=True),
                planner=_StoredBytesPlanner(flatten_state_dict=False),
                no_dist=True,
            )
        config = {"sharded_backend": TORCH_DIST, "sharded_backend_version": 1}
        config |= {"common_backend": "torch", "common_backend_version": 1}
        _fsync_file(staging / DIST_CONFIG_FILE, data=json.dumps(config).encode())
        fsync_dir(staging)
        return commit_iteration(staging, root, iteration)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
