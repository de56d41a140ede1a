"""The model-shape flags of the tools that take a model without training it (``tools/plan.py``,
``tools/profile_device.py``): ``--model PRESET`` and the shape flags overriding its fields.

The flags are the common ones of :data:`megatron_het.cli_args.SHAPE_FLAGS` (``pretrain_llama.py``
takes all of them, its vocabulary coming from the tokenizer); here a model without a preset gets
:data:`DEFAULT_VOCAB`.
"""

from __future__ import annotations

import argparse

from megatron_het.arguments import ModelSpec, resolve_model_config
from megatron_het.cli_args import add_shape_flags, shape_overrides
from megatron_het.config import MODEL_PRESETS, ModelConfig

DEFAULT_VOCAB = 32000


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


__all__ = ["DEFAULT_VOCAB", "add_model_shape_args", "model_config_from_args"]
