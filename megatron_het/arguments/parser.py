"""The command-line parser of every entry point, and the model-shape flags in one table.

``pretrain_llama.py`` and every tool parse argv once with :class:`ArgParser` (whose errors are
one UserError line) into raw arguments, which each entry point resolves once into frozen
configs. The model's shape flags are listed once, in :data:`SHAPE_FLAGS`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, NoReturn

from megatron_het.errors import UserError


class ArgParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as a UserError: one line naming the problem
    and ``PROG --help`` (entry points print it and exit 2 through ``run_cli``)."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; see {self.prog} --help")


@dataclass(frozen=True)
class ShapeFlag:
    """One model-shape flag: the ModelConfig ``field`` it sets. ``common`` flags are taken by
    every tool that builds a model; the others by ``pretrain_llama.py`` only."""

    flag: str
    field: str
    type: type
    help: str | None = None
    common: bool = True

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


SHAPE_FLAGS = (
    ShapeFlag("--num-layers", "num_layers", int),
    ShapeFlag("--hidden-size", "hidden_size", int),
    ShapeFlag("--ffn-hidden-size", "ffn_hidden_size", int, "default without a preset: 4 * hidden"),
    ShapeFlag("--num-attention-heads", "num_attention_heads", int),
    ShapeFlag(
        "--num-query-groups",
        "num_query_groups",
        int,
        "key/value heads (GQA); default without a preset: attention heads",
    ),
    ShapeFlag(
        "--max-position-embeddings",
        "max_position_embeddings",
        int,
        "default without a preset: --seq-length",
        common=False,
    ),
    ShapeFlag("--rotary-base", "rope_theta", float, "RoPE theta (default 10000)", common=False),
    ShapeFlag("--norm-epsilon", "norm_eps", float, "RMSNorm epsilon (default 1e-5)", common=False),
    ShapeFlag(
        "--init-method-std",
        "init_method_std",
        float,
        "weight init std (default 0.02)",
        common=False,
    ),
)


def add_shape_flags(parser: Any, common_only: bool) -> None:
    """Add the shape flags (all, or only the common ones) to ``parser`` (or a group)."""
    for shape in SHAPE_FLAGS:
        if shape.common or not common_only:
            parser.add_argument(shape.flag, type=shape.type, help=shape.help)


def shape_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """ModelConfig field -> value for every shape flag given on the command line."""
    return {
        shape.field: getattr(args, shape.dest)
        for shape in SHAPE_FLAGS
        if getattr(args, shape.dest, None) is not None
    }


def integer_shape_dests(common_only: bool = False) -> tuple[str, ...]:
    """The argparse names of the integer shape flags (they must be positive)."""
    return tuple(s.dest for s in SHAPE_FLAGS if s.type is int and (s.common or not common_only))
