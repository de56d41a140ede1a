"""A Megatron-LM save directory as the checkpoint a run loads (``--load``).

:func:`find_megatron_checkpoint` tells a Megatron-LM directory from one of ours: ``--ckpt-format
torch`` (a tracker and ``iter_XXXXXXX/mp_rank_*`` folders, no metadata.json of ours) or
``torch_dist`` (``iter_XXXXXXX/metadata.json`` naming that sharded backend, ``common.pt``).
:func:`read_megatron_header` reads what a run needs before it builds anything (the model config
from the ``args``, the iteration, the data position, whether its optimizer state can be carried)
from ONE file, memory-mapped (the first rank file, or torch_dist's ``common.pt`` and index), so
no weight is read. :func:`check_megatron_model`
compares that model with the one the flags describe, naming each differing flag.
:func:`load_megatron_slices` fills a stage of any plan with the TP slices of the parameters it
holds, the same boxes a load of a full-tensor checkpoint of ours cuts
(:func:`~megatron_het.checkpoint.reshard.target_slice`), with Adam's state of those boxes when the
run continues the checkpoint's optimizer (:mod:`~megatron_het.checkpoint.megatron_lm_optim`).
Every rank reads the files itself; nothing is broadcast. From a torch_dist save a rank reads only
its boxes (:mod:`~megatron_het.checkpoint.megatron_lm_boxes`); a legacy save is read whole
(:func:`~megatron_het.checkpoint.megatron_lm.read_megatron_checkpoint`), so each rank holds the
full model's tensors while it cuts its slices.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_het.checkpoint.io import PathLike
from megatron_het.checkpoint.megatron_lm import (
    RANK_FILE,
    RELEASE,
    load_rank_file,
    rank_dir_name,
    read_megatron_checkpoint,
)
from megatron_het.checkpoint.megatron_lm_args import model_config_from_args
from megatron_het.checkpoint.megatron_lm_boxes import read_boxes
from megatron_het.checkpoint.megatron_lm_dist import COMMON_FILE
from megatron_het.checkpoint.megatron_lm_files import (
    checkpoint_args,
    load_pickled,
    read_dcp_metadata,
    sharded_backend,
)
from megatron_het.checkpoint.megatron_lm_names import padded_vocab_size
from megatron_het.checkpoint.megatron_lm_optim import (
    LEGACY_OPTIMIZER,
    MegatronOptimizerState,
    optimizer_problem,
    read_optimizer_boxes,
)
from megatron_het.checkpoint.names import METADATA_FILE, TRACKER_FILE, iteration_dir_name
from megatron_het.checkpoint.reader import ReadStats
from megatron_het.checkpoint.reshard import Box, assemble_slice, target_slice
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError

TORCH_DIST = "torch_dist"

# ModelConfig field -> the pretrain_llama.py flag that sets it, for mismatch messages.
SHAPE_FIELD_FLAGS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups",
    "vocab_size": "--vocab-size",
    "tie_embeddings": "--untie-embeddings-and-output-weights",
    "max_position_embeddings": "--max-position-embeddings",
    "rope_theta": "--rotary-base",
    "norm_eps": "--norm-epsilon",
}
# Taken from the checkpoint whatever the flags say: no flag sets it.
_FIELDS_FROM_CHECKPOINT = ("rope_scaling",)
# The run's own whatever the checkpoint says: they do not change what the weights mean.
_FIELDS_FREE = ("init_method_std", "name")


@dataclass(frozen=True)
class MegatronHeader:
    """What a run needs of a Megatron-LM checkpoint before building its model.

    ``directory`` is the iteration directory; ``config`` the model its ``args`` describe (the
    vocabulary: ``args.vocab_size``, else the run's, see :func:`read_megatron_header`);
    ``iteration`` the file's (0 for a ``release`` directory, as Megatron-LM loads one);
    ``consumed_samples`` ``args.consumed_train_samples`` (0 when absent); ``ckpt_format``
    ``torch`` or ``torch_dist``; ``optimizer_problem`` why its optimizer state cannot be
    carried (None: it can, a torch_dist save that keeps it by parameter)."""

    directory: pathlib.Path
    config: ModelConfig
    iteration: int
    release: bool
    consumed_samples: int
    ckpt_format: str
    optimizer_problem: str | None

    @property
    def source_format(self) -> str:
        """How the start-up log names the checkpoint's format."""
        return f"Megatron-LM, --ckpt-format {self.ckpt_format}"


def _holds_rank_folders(directory: pathlib.Path) -> bool:
    return directory.is_dir() and any(directory.glob("mp_rank_*"))


def _is_dist_iteration(directory: pathlib.Path) -> bool:
    return directory.is_dir() and sharded_backend(directory) == TORCH_DIST


def _is_megatron_iteration(directory: pathlib.Path) -> bool:
    legacy = _holds_rank_folders(directory) and not (directory / METADATA_FILE).is_file()
    return legacy or _is_dist_iteration(directory)


def find_megatron_checkpoint(path: PathLike) -> pathlib.Path | None:
    """The Megatron-LM iteration directory (either format) ``path`` names, or None when it is
    not one.

    ``path`` is a Megatron-LM ``--save`` directory (the tracker's iteration, which may be
    ``release``) or one of its iteration directories. Reads only the tracker, directory
    listings and a torch_dist save's metadata.json; a directory of ours, whose metadata.json
    names no sharded backend, is never taken for one."""
    root = pathlib.Path(path)
    if not root.is_dir():
        return None
    if _is_megatron_iteration(root):
        return root
    if (root / METADATA_FILE).is_file():
        return None
    tracker = root / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text(encoding="utf-8").strip()
    if text == RELEASE:
        directory = root / RELEASE
    elif text.isdigit():
        directory = root / iteration_dir_name(int(text))
    else:
        return None
    return directory if _is_megatron_iteration(directory) else None


def _first_rank_file(directory: pathlib.Path) -> pathlib.Path:
    path = directory / rank_dir_name(0, 0, 1) / RANK_FILE
    return path if path.is_file() else directory / rank_dir_name(0, 0, 2) / RANK_FILE


def read_megatron_header(directory: pathlib.Path, run_vocab_size: int) -> MegatronHeader:
    """The header of the Megatron-LM iteration ``directory``, from its first rank file (or a
    torch_dist save's common.pt).

    The model's vocabulary is ``args.vocab_size`` when the file records it, else
    ``run_vocab_size`` (the run's model vocabulary), which must then pad to the file's
    ``padded_vocab_size`` as Megatron-LM pads (UserError naming --vocab-size otherwise).
    Raises UserError for a file that is not a megatron-core Llama checkpoint."""
    ckpt_format = TORCH_DIST if _is_dist_iteration(directory) else "torch"
    if ckpt_format == TORCH_DIST:
        path = directory / COMMON_FILE
        payload = load_pickled(path, "copy the whole iteration directory")
        problem = optimizer_problem(read_dcp_metadata(directory), payload, str(directory))
    else:
        path = _first_rank_file(directory)
        payload = load_rank_file(path)
        problem = LEGACY_OPTIMIZER.format(source=directory)
    args = checkpoint_args(payload, path)
    tp_size = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    recorded_vocab = getattr(args, "vocab_size", None)
    config, padded = model_config_from_args(
        args, str(path), tp_size, None if recorded_vocab else run_vocab_size
    )
    divisible_by = int(getattr(args, "make_vocab_size_divisible_by", 128) or 128)
    if not recorded_vocab and padded_vocab_size(config.vocab_size, divisible_by, tp_size) != padded:
        raise UserError(
            f"--load {directory}: its padded vocabulary of {padded} rows does not come from "
            f"the run's {config.vocab_size}-token vocabulary; pass the --vocab-size the "
            "checkpoint was trained with"
        )
    release = directory.name == RELEASE
    return MegatronHeader(
        directory=directory,
        config=config,
        iteration=0 if release else int(payload.get("iteration", 0) or 0),
        release=release,
        consumed_samples=int(getattr(args, "consumed_train_samples", 0) or 0),
        ckpt_format=ckpt_format,
        optimizer_problem=problem,
    )


def _shown(field: str, value: Any) -> str:
    if field == "tie_embeddings":
        return "tied" if value else "untied"
    return str(value)


def check_megatron_model(
    load_dir: PathLike, saved: ModelConfig, configured: ModelConfig
) -> ModelConfig:
    """``configured`` completed from ``saved`` (the checkpoint's model) where no flag applies.

    Raises one UserError line naming, for every differing field, its flag, the checkpoint's
    value and the flags' (e.g. ``--hidden-size 64 in the checkpoint, 128 from the flags``)."""
    model = configured.replace(**{key: getattr(saved, key) for key in _FIELDS_FROM_CHECKPOINT})
    differing = [
        f"{flag} {_shown(key, getattr(saved, key))} in the checkpoint, "
        f"{_shown(key, getattr(model, key))} from the flags"
        for key, flag in SHAPE_FIELD_FLAGS.items()
        if getattr(saved, key) != getattr(model, key)
    ]
    leftover = [
        key
        for key in saved.to_dict()
        if key not in SHAPE_FIELD_FLAGS and getattr(saved, key) != getattr(model, key)
    ]
    assert set(leftover) <= set(_FIELDS_FREE), f"ModelConfig fields without a rule: {leftover}"
    if differing:
        raise UserError(
            f"--load {load_dir}: the checkpoint's model differs: {'; '.join(differing)}; "
            "pass the checkpoint's values (or --use-checkpoint-args)"
        )
    return model


def _dist_boxes(
    directory: pathlib.Path,
    model_config: ModelConfig,
    boxes: dict[str, Box],
    with_optimizer: bool,
    stats: ReadStats | None,
) -> tuple[dict[str, torch.Tensor], MegatronOptimizerState | None]:
    """This rank's ``boxes`` of a torch_dist save (the float32 main weights when carrying its
    optimizer and it keeps them) and its Adam state of those boxes; reads nothing else."""
    metadata = read_dcp_metadata(directory)
    saved, nbytes = None, 0
    if with_optimizer:
        common = load_pickled(directory / COMMON_FILE, "copy the whole iteration directory")
        iteration = int(common.get("iteration", 0) or 0)
        saved, nbytes = read_optimizer_boxes(
            directory, model_config, boxes, common, metadata, iteration
        )
    if saved is not None and saved.main_params is not None:
        values = saved.main_params
    else:
        values, more = read_boxes(directory, model_config, boxes, metadata)
        nbytes += more
    if stats is not None:
        stats.files += len(list(directory.glob("*.distcp")))
        stats.bytes += nbytes
    return values, saved


def _legacy_boxes(
    directory: pathlib.Path,
    model_config: ModelConfig,
    boxes: dict[str, Box],
    stats: ReadStats | None,
) -> dict[str, torch.Tensor]:
    """``boxes`` cut from the whole legacy checkpoint, read into full tensors (dropped on
    return)."""
    loaded = read_megatron_checkpoint(directory, vocab_size=model_config.vocab_size)
    if loaded.config.replace(**{k: getattr(model_config, k) for k in _FIELDS_FREE}) != (
        model_config
    ):
        raise UserError(
            f"--load {directory}: its rank files describe another model than its first one; "
            "copy the whole iteration directory again"
        )
    if stats is not None:
        files = sorted(directory.glob(f"mp_rank_*/{RANK_FILE}"))
        stats.files += len(files)
        stats.bytes += sum(os.stat(path).st_size for path in files)
    out = {}
    for name, (offsets, shape) in boxes.items():
        full = loaded.state[name]
        out[name] = assemble_slice(
            name, tuple(full.shape), offsets, shape, [(full, (0,) * full.dim())]
        )
    return out


@torch.no_grad()
def load_megatron_slices(
    directory: pathlib.Path,
    model_config: ModelConfig,
    stage: nn.Module,
    tp: int,
    tp_rank: int,
    weights: dict[str, torch.Tensor] | None = None,
    stats: ReadStats | None = None,
    optimizer: dict[str, dict[str, Any]] | None = None,
) -> MegatronOptimizerState | None:
    """Overwrite every parameter of ``stage`` with its box (TP rank ``tp_rank`` of ``tp``) of
    the Megatron-LM checkpoint in ``directory``; no communication.

    A torch_dist save is read box by box: this rank reads and holds only its slices
    (:mod:`~megatron_het.checkpoint.megatron_lm_boxes`). A legacy one is read whole (every rank
    file, memory-mapped) into full tensors, dropped on return. ``weights``, when given,
    receives each box by name at the file's precision (for the optimizer's master weights);
    ``stats`` counts the files and bytes read. ``optimizer``, when given (torch_dist only),
    receives Adam's state of each box by name (``step``, ``exp_avg``, ``exp_avg_sq``), and
    the weights come from the optimizer's float32 main weights where it keeps them; the
    optimizer state read is returned (None without). Raises UserError for a damaged or
    incomplete checkpoint or one of another model."""
    boxes = {
        name: target_slice(name, model_config, tp, tp_rank) for name, _ in stage.named_parameters()
    }
    saved = None
    if sharded_backend(directory) is not None:
        values, saved = _dist_boxes(directory, model_config, boxes, optimizer is not None, stats)
    elif optimizer is not None:
        raise UserError(LEGACY_OPTIMIZER.format(source=directory))
    else:
        values = _legacy_boxes(directory, model_config, boxes, stats)
    for name, param in stage.named_parameters():
        param.copy_(values[name])
        if weights is not None:
            weights[name] = values[name]
        if optimizer is not None and saved is not None:
            optimizer[name] = {"step": saved.step, **saved.moments[name]}
    return saved
