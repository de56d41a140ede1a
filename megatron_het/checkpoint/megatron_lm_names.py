"""Megatron-LM (megatron-core ``GPTModel``) parameter names and tensor-parallel layouts, mapped to
ours: pure functions on state dicts. The files around them are
:mod:`megatron_het.checkpoint.megatron_lm`'s business.

Names of one pipeline rank's ``model`` state dict (layers numbered from 0 on every rank; the
global index is the rank's offset plus that number). ``t`` is the tensor-parallel size; a
column-parallel weight is split into ``t`` row blocks (dim 0), a row-parallel one into ``t``
column blocks (dim 1); norms are replicated on every TP rank::

    megatron-core (local spec)                        ours                        split
    embedding.word_embeddings.weight  [Vp, H]         embedding.weight            dim 0
    decoder.layers.i.input_layernorm.weight           layers.j.input_norm.weight  -
    decoder.layers.i.self_attention.linear_qkv.weight layers.j.attention.qkv      dim 0
    decoder.layers.i.self_attention.linear_proj.weight layers.j.attention.proj    dim 1
    decoder.layers.i.pre_mlp_layernorm.weight         layers.j.post_attention_norm -
    decoder.layers.i.mlp.linear_fc1.weight [2F, H]    layers.j.mlp.gate and up    dim 0, halves
    decoder.layers.i.mlp.linear_fc2.weight            layers.j.mlp.down           dim 1
    decoder.final_layernorm.weight                    final_norm.weight           -
    output_layer.weight               [Vp, H]         output.weight               dim 0

The Transformer Engine spec (``--megatron-naming te``) folds the input norm into
``self_attention.linear_qkv.layer_norm_weight`` and the pre-MLP norm into
``mlp.linear_fc1.layer_norm_weight``. Both specs add ``<module>._extra_state`` entries (None when
no FP8 state is kept); TE's core attention has one too. Reading ignores them; writing writes None,
which every megatron-core and Transformer Engine version accepts on load.

Layouts. ``linear_qkv`` rows are grouped by query group exactly like our ``qkv`` (for each of
the ng groups: its r query heads, its key head, its value head, d rows each), so a TP rank holds
ng/t whole groups, a contiguous block of rows. ``linear_fc1`` holds, on each TP rank, that rank's
block of gate rows followed by its block of up rows (``[gate_k; up_k]``), so merging takes each
rank's halves apart. The vocabulary is padded to ``Vp``, a multiple of
``make_vocab_size_divisible_by * t``; padding rows are dropped on import and written as zeros on
export (they are never looked up; in the head they give logit 0).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_het.config import ModelConfig
from megatron_het.errors import UserError

LOCAL, TE = "local", "te"
NAMINGS = (LOCAL, TE)
EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
EXTRA_STATE = "_extra_state"
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")

# Per layer: Megatron suffix -> (our suffix, split dim or None for replicated).
LAYER_TENSORS = {
    "self_attention.linear_qkv.weight": ("attention.qkv.weight", 0),
    "self_attention.linear_proj.weight": ("attention.proj.weight", 1),
    "mlp.linear_fc2.weight": ("mlp.down.weight", 1),
}
NORMS = {
    LOCAL: {
        "input_layernorm.weight": "input_norm.weight",
        "pre_mlp_layernorm.weight": "post_attention_norm.weight",
    },
    TE: {
        "self_attention.linear_qkv.layer_norm_weight": "input_norm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_norm.weight",
    },
}
FC1 = "mlp.linear_fc1.weight"
# Modules that carry an _extra_state entry, as megatron-core's state_dict() lists them.
EXTRA_STATE_MODULES = {
    LOCAL: (
        "self_attention.linear_proj",
        "self_attention.linear_qkv",
        "mlp.linear_fc1",
        "mlp.linear_fc2",
    ),
    TE: (
        "self_attention.core_attention",
        "self_attention.linear_proj",
        "self_attention.linear_qkv",
        "mlp.linear_fc1",
        "mlp.linear_fc2",
    ),
}
# Keys that mark a model family we cannot hold, with what to say about them.
_UNSUPPORTED_KEYS = (
    (re.compile(r"(^|\.)bias$|layer_norm_bias$"), "bias terms (add_bias_linear / LayerNorm)"),
    (re.compile(r"position_embeddings\.weight$"), "learned absolute position embeddings"),
    (re.compile(r"\.mlp\.(router|experts|shared_experts)\."), "mixture-of-experts layers"),
    (re.compile(r"[qk]_layernorm"), "QK layernorm"),
)


@dataclass(frozen=True)
class StageSlice:
    """What one Megatron pipeline rank holds: global layers ``[layer_start, layer_stop)``, and
    whether it is the first (embedding) and last (final norm, head) stage."""

    layer_start: int
    layer_stop: int
    first: bool
    last: bool


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padded vocabulary: ``vocab_size`` rounded up to a multiple of
    ``divisible_by * tp_size``."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


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


def unsupported_key(name: str) -> str | None:
    """What model feature tensor ``name`` belongs to that ours lacks, or None."""
    for pattern, what in _UNSUPPORTED_KEYS:
        if pattern.search(name):
            return what
    return None


# ---- export ----------------------------------------------------------------------------------
def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (itself when it has them)."""
    if tensor.shape[0] == rows:
        return tensor
    return torch.cat((tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])))


def _block(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Block ``rank`` of ``size`` equal blocks of ``tensor`` along ``dim``, as its own copy (so
    a saved file holds only its block, not the whole storage)."""
    return tensor.chunk(size, dim=dim)[rank].clone()


def megatron_rank_state(
    state: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    stage: StageSlice,
    tp_rank: int,
    tp_size: int,
    padded_vocab: int,
    naming: str = LOCAL,
) -> dict[str, torch.Tensor | None]:
    """The ``model`` state dict of Megatron rank (``tp_rank``, the pipeline rank ``stage``
    describes) for our full ``state``: Megatron names, local layer numbers, this rank's TP
    blocks (new tensors), ``_extra_state`` entries set to None.

    Tied embeddings: the first stage writes ``embedding.word_embeddings.weight``; a last stage
    that is not also the first writes its copy as ``output_layer.weight``, as megatron-core keeps
    one there under pipeline parallelism."""
    out: dict[str, torch.Tensor | None] = {}
    norms = NORMS[naming]

    def vocab_block(tensor: torch.Tensor) -> torch.Tensor:
        return _block(pad_rows(tensor, padded_vocab), 0, tp_rank, tp_size)

    if stage.first:
        out[EMBEDDING] = vocab_block(state["embedding.weight"])
    for index in range(stage.layer_start, stage.layer_stop):
        src, dst = f"layers.{index}.", f"decoder.layers.{index - stage.layer_start}."
        for theirs, ours in norms.items():
            out[dst + theirs] = state[src + ours].clone()
        for theirs, (ours, dim) in LAYER_TENSORS.items():
            out[dst + theirs] = _block(state[src + ours], dim, tp_rank, tp_size)
        gate = _block(state[src + "mlp.gate.weight"], 0, tp_rank, tp_size)
        up = _block(state[src + "mlp.up.weight"], 0, tp_rank, tp_size)
        out[dst + FC1] = torch.cat((gate, up))
        for module in EXTRA_STATE_MODULES[naming]:
            out[f"{dst}{module}.{EXTRA_STATE}"] = None
    if stage.last:
        out[FINAL_NORM] = state["final_norm.weight"].clone()
        if not cfg.tie_embeddings:
            out[OUTPUT] = vocab_block(state["output.weight"])
        elif not stage.first:
            out[OUTPUT] = vocab_block(state["embedding.weight"])
        out[f"output_layer.{EXTRA_STATE}"] = None
    return out


# ---- import ----------------------------------------------------------------------------------
def _naming_of(keys: list[str]) -> str:
    return TE if any(k.endswith("linear_qkv.layer_norm_weight") for k in keys) else LOCAL


def merge_stage(
    tp_states: list[Mapping[str, object]],
    layer_offset: int,
    source: str,
) -> tuple[dict[str, torch.Tensor], int]:
    """Our names and merged tensors of one pipeline rank, from its TP ranks' ``model`` state
    dicts (in TP rank order; either naming). Layers get global indices from ``layer_offset``.
    Returns (tensors, number of layers the rank holds); ``output_layer.weight`` keeps its
    Megatron name and the embedding and head keep their padded rows (the caller decides).
    ``source`` names the rank's first file in errors. Raises UserError for a tensor of a model
    family we cannot hold, an unknown tensor, or TP ranks that disagree on their tensors."""
    first = tp_states[0]
    keys = [k for k in first if not k.endswith(EXTRA_STATE)]
    for key in keys:
        what = unsupported_key(key)
        if what is not None:
            raise UserError(
                f"{source} holds {key}: {what} are not supported (megatron_het is a Llama "
                f"model: RMSNorm, RoPE, SwiGLU, no biases)"
            )
    for rank, other in enumerate(tp_states[1:], start=1):
        if sorted(k for k in other if not k.endswith(EXTRA_STATE)) != sorted(keys):
            raise UserError(
                f"{source}: TP rank {rank} holds other tensors than TP rank 0; the "
                f"checkpoint's shards come from different models, re-save it"
            )
    norms = NORMS[_naming_of(keys)]

    def pieces(key: str) -> list[torch.Tensor]:
        return [state[key] for state in tp_states]  # type: ignore[misc]

    out: dict[str, torch.Tensor] = {}
    layers: set[int] = set()
    for key in keys:
        if key in (EMBEDDING, OUTPUT):
            out[key] = torch.cat(pieces(key))
            continue
        if key == FINAL_NORM:
            out["final_norm.weight"] = pieces(key)[0]
            continue
        match = _LAYER.fullmatch(key)
        if match is None:
            raise UserError(_unknown(source, key))
        local, suffix = int(match.group(1)), match.group(2)
        layers.add(local)
        dst = f"layers.{layer_offset + local}."
        if suffix in norms:
            out[dst + norms[suffix]] = pieces(key)[0]
        elif suffix in LAYER_TENSORS:
            ours, dim = LAYER_TENSORS[suffix]
            out[dst + ours] = torch.cat(pieces(key), dim=dim)
        elif suffix == FC1:
            halves = [piece.chunk(2) for piece in pieces(key)]
            out[dst + "mlp.gate.weight"] = torch.cat([gate for gate, _ in halves])
            out[dst + "mlp.up.weight"] = torch.cat([up for _, up in halves])
        else:
            raise UserError(_unknown(source, key))
    if layers and layers != set(range(len(layers))):
        raise UserError(
            f"{source} numbers its layers {sorted(layers)}, not 0..{len(layers) - 1}; it is "
            "not a megatron-core GPT checkpoint"
        )
    return out, len(layers)


def _unknown(source: str, key: str) -> str:
    return (
        f"{source} holds {key}, which a megatron-core Llama GPTModel (local or Transformer "
        "Engine spec) does not have; only those can be converted"
    )
