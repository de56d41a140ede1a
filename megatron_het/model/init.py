"""Weight initialisation that does not depend on the parallel layout.

Each parameter draws its values from its own ``torch.Generator`` seeded from the run seed and the
parameter's GLOBAL name (``layers.7.mlp.down.weight``), so a pipeline stage holding only layers
[2, 4) gets exactly the values the full model has there, whatever the split. Tensor-parallel code
draws the full tensor with :func:`initial_value` and keeps its slice.

Values are drawn on the CPU in float32 and then copied to the parameter's device and dtype, so
they also do not depend on the device kind.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from megatron_het.config import ModelConfig

# Megatron scales the projections that write into the residual stream by 1/sqrt(2 * layers).
_OUTPUT_PROJECTION_SUFFIXES = ("attention.proj.weight", "mlp.down.weight")


def parameter_seed(seed: int, name: str) -> int:
    """A generator seed from the run seed and a global parameter name, stable across runs.

    32 bits, because the CPU generator (mt19937) keeps only the low 32 bits of its seed.
    """
    return zlib.crc32(f"{seed}/{name}".encode())


def initial_value(
    name: str, shape: tuple[int, ...] | torch.Size, config: ModelConfig, seed: int
) -> torch.Tensor:
    """The initial float32 CPU tensor of the parameter called ``name`` (full, unsharded shape).

    Norm weights are ones; other weights are ``normal(0, init_method_std)``, with the output
    projections (``attention.proj``, ``mlp.down``) scaled by ``1 / sqrt(2 * num_layers)``.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.float32)
    std = config.init_method_std
    if name.endswith(_OUTPUT_PROJECTION_SUFFIXES):
        std = std / math.sqrt(2.0 * config.num_layers)
    generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    value = torch.empty(shape, dtype=torch.float32)
    return value.normal_(mean=0.0, std=std, generator=generator)


class ConfiguredModel(Protocol):
    """A module with a ``config`` and globally named parameters, as
    :class:`~megatron_het.model.llama.LlamaModel` is."""

    config: ModelConfig

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


@torch.no_grad()
def init_weights(model: ConfiguredModel, seed: int) -> None:
    """Initialise every parameter of ``model`` in place from ``(seed, global name)``.

    ``model`` must expose ``config`` (a :class:`ModelConfig`) and name its parameters globally,
    as :class:`~megatron_het.model.llama.LlamaModel` does.
    """
    config = model.config
    for name, param in model.named_parameters():
        param.copy_(initial_value(name, param.shape, config, seed))
