"""The model-shape flags of the tools that take a model without training it (``tools/plan.py``,
``tools/profile_device.py``): ``--model PRESET`` and the shape flags overriding its fields.

``pretrain_llama.py`` has its own, larger set (:mod:`megatron_het.arguments`), whose vocabulary
comes from the tokenizer; here a model without a preset gets :data:`DEFAULT_VOCAB`.
"""
from __future__ import annotations

import argparse
from typing import Optional

from megatron_het.arguments import ModelSpec, resolve_model_config
from megatron_het.config import MODEL_PRESETS, ModelConfig

DEFAULT_VOCAB = 32000
# Shape flags (argparse dest) -> ModelConfig field; None means "not given on the command line".
_SHAPE_FLAGS = {"num_layers": "num_layers", "hidden_size": "hidden_size",
                "ffn_hidden_size": "ffn_hidden_size",
                "num_attention_heads": "num_attention_heads",
                "num_query_groups": "num_query_groups"}


def add_model_shape_args(parser: argparse.ArgumentParser,
                         vocab_help: Optional[str] = None) -> None:
    """Add ``--model``, ``--num-layers``, ``--hidden-size``, ``--ffn-hidden-size``,
    ``--num-attention-heads``, ``--num-query-groups`` and ``--vocab-size`` (help text
    ``vocab_help``) to ``parser``, in that order; read them with :func:`model_config_from_args`."""
    parser.add_argument("--model", metavar="PRESET",
                        help=f"model preset ({', '.join(sorted(MODEL_PRESETS))}); shape flags "
                             "override its fields")
    for flag in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                 "--num-query-groups"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--vocab-size", type=int, help=vocab_help)


def model_config_from_args(args: argparse.Namespace, seq_length: int) -> ModelConfig:
    """The preset and/or the shape flags of :func:`add_model_shape_args` -> a validated
    ModelConfig (vocabulary: ``--vocab-size``, else the preset's, else :data:`DEFAULT_VOCAB`;
    without a preset, ``seq_length`` positions). Raises UserError for a shape that does not
    make a model."""
    overrides = {name: getattr(args, dest) for dest, name in _SHAPE_FLAGS.items()
                 if getattr(args, dest) is not None}
    vocab = args.vocab_size if args.vocab_size is not None else (
        None if args.model else DEFAULT_VOCAB)
    spec = ModelSpec(preset=args.model, overrides=overrides, vocab_size=vocab)
    return resolve_model_config(spec, tokenizer_vocab_size=1, seq_length=seq_length)


__all__ = ["DEFAULT_VOCAB", "add_model_shape_args", "model_config_from_args"]
