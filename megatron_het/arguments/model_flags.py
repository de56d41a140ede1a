"""The model's shape from the command line: ``--model PRESET`` and the shape flags overriding its
fields, resolved into a :class:`~megatron_het.config.ModelConfig` once the vocabulary is known.

``pretrain_llama.py`` takes every shape flag and learns its vocabulary from the tokenizer, so
parsing yields a :class:`ModelSpec` and :func:`resolve_model_config` completes it. The tools that
take a model without training it (``tools/plan.py``, ``tools/profile_device.py``) add the common
shape flags with :func:`add_model_shape_args`; a model without a preset gets
:data:`DEFAULT_VOCAB` there.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

from megatron_het.arguments.parser import add_shape_flags, shape_overrides
from megatron_het.config import MODEL_PRESETS, ModelConfig, model_preset
from megatron_het.errors import UserError

DEFAULT_VOCAB = 32000


@dataclass(frozen=True)
class ModelSpec:
    """The model as the command line describes it, before the vocabulary is known.

    ``overrides`` maps ModelConfig fields to values given explicitly by shape flags.
    ``vocab_size`` is the exact model vocabulary (``--vocab-size`` with a tokenizer other than
    NullTokenizer), else None: the preset's, or the tokenizer's padded to a multiple of
    ``make_vocab_size_divisible_by``.
    """

    preset: str | None
    overrides: dict[str, Any] = field(default_factory=dict)
    make_vocab_size_divisible_by: int = 128
    vocab_size: int | None = None


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (Megatron's vocab padding)."""
    return int(math.ceil(vocab_size / multiple) * multiple)


def _base_fields(spec: ModelSpec) -> dict[str, Any]:
    if spec.preset is not None:
        return model_preset(spec.preset).to_dict()
    missing = [
        flag
        for flag, name in (
            ("--num-layers", "num_layers"),
            ("--hidden-size", "hidden_size"),
            ("--num-attention-heads", "num_attention_heads"),
        )
        if name not in spec.overrides
    ]
    if missing:
        raise UserError(f"no model shape: pass --model PRESET or {', '.join(missing)}")
    hidden = spec.overrides["hidden_size"]
    return {
        "name": "custom",
        "ffn_hidden_size": 4 * hidden,
        "tie_embeddings": True,
        "num_query_groups": spec.overrides["num_attention_heads"],
    }


def resolve_model_config(
    spec: ModelSpec, tokenizer_vocab_size: int, seq_length: int
) -> ModelConfig:
    """The ModelConfig for ``spec`` once the tokenizer's vocabulary size is known.

    Vocabulary: ``spec.vocab_size`` if set, else the preset's, else the tokenizer's padded to
    ``spec.make_vocab_size_divisible_by``; it must hold every tokenizer id. Without a preset,
    ``max_position_embeddings`` defaults to ``seq_length``. Raises UserError for a shape that
    does not work or a ``seq_length`` beyond the model's positions.
    """
    fields = _base_fields(spec)
    fields.update(spec.overrides)
    fields.setdefault("max_position_embeddings", seq_length)
    if spec.vocab_size is not None:
        vocab, source = spec.vocab_size, f"--vocab-size {spec.vocab_size}"
    elif spec.preset is not None:
        vocab, source = fields["vocab_size"], f"--model {spec.preset}"
    else:
        vocab = padded_vocab_size(tokenizer_vocab_size, spec.make_vocab_size_divisible_by)
        source = "padded tokenizer vocabulary"
    if vocab < tokenizer_vocab_size:
        hint = (
            "pass --vocab-size of at least that"
            if spec.preset is not None and spec.vocab_size is None
            else "raise --vocab-size"
        )
        raise UserError(
            f"{source} gives a {vocab}-token model vocabulary but the tokenizer has "
            f"{tokenizer_vocab_size} tokens; {hint}, or use a model whose "
            "vocabulary holds the tokenizer's"
        )
    fields["vocab_size"] = vocab
    config = ModelConfig.from_dict(fields)
    if seq_length > config.max_position_embeddings:
        raise UserError(
            f"--seq-length {seq_length} exceeds the model's "
            f"--max-position-embeddings {config.max_position_embeddings}; lower "
            "--seq-length or raise --max-position-embeddings"
        )
    return config


def add_model_shape_args(parser: argparse.ArgumentParser, vocab_help: str | None = None) -> None:
    """Add ``--model``, ``--num-layers``, ``--hidden-size``, ``--ffn-hidden-size``,
    ``--num-attention-heads``, ``--num-query-groups`` and ``--vocab-size`` (help text
    ``vocab_help``) to ``parser``, in that order; read them with :func:`model_config_from_args`."""
    parser.add_argument(
        "--model",
        metavar="PRESET",
        help=f"model preset ({', '.join(sorted(MODEL_PRESETS))}); shape flags override its fields",
    )
    add_shape_flags(parser, common_only=True)
    parser.add_argument("--vocab-size", type=int, help=vocab_help)


def model_config_from_args(args: argparse.Namespace, seq_length: int) -> ModelConfig:
    """The preset and/or the shape flags of :func:`add_model_shape_args` -> a validated
    ModelConfig (vocabulary: ``--vocab-size``, else the preset's, else :data:`DEFAULT_VOCAB`;
    without a preset, ``seq_length`` positions). Raises UserError for a shape that does not
    make a model."""
    overrides = shape_overrides(args)
    vocab = (
        args.vocab_size if args.vocab_size is not None else (None if args.model else DEFAULT_VOCAB)
    )
    spec = ModelSpec(preset=args.model, overrides=overrides, vocab_size=vocab)
    return resolve_model_config(spec, tokenizer_vocab_size=1, seq_length=seq_length)
