"""How every GLOBAL parameter name is split over a tensor-parallel group.

    parameter                              split      slice of rank r
    embedding.weight, output.weight        dim 0      vocabulary rows, balanced (see below)
    layers.{i}.attention.qkv.weight        dim 0      rows of kv groups [r*ng/tp, (r+1)*ng/tp)
    layers.{i}.attention.proj.weight       dim 1      columns of query heads [r*nh/tp, ...)
    layers.{i}.mlp.gate.weight, up.weight  dim 0      rows [r*F/tp, (r+1)*F/tp)
    layers.{i}.mlp.down.weight             dim 1      columns [r*F/tp, (r+1)*F/tp)
    *norm.weight                           replicated (every rank holds the whole tensor)

The fused ``qkv`` rows are grouped by kv group (see :mod:`megatron_het.model.llama`), so a split
by kv groups is one contiguous block of rows holding those groups' query, key and value heads.

The vocabulary is NOT padded and need not be divisible by tp: rank r holds a contiguous,
balanced range of rows, the first ``V % tp`` ranks one row more than the others. Parameter
shapes therefore stay the single-process shapes, and a checkpoint stores each shard with the
global shape and its offsets (:meth:`ShardSpec.offsets`). Heads, kv groups and the FFN size must
be divisible by tp (the plan validation demands it; :func:`check_tp_size` says so again).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_het.config import ModelConfig
from megatron_het.errors import UserError

_LAYER_PARAM = re.compile(r"layers\.\d+\.(.+)")


@dataclass(frozen=True)
class ShardSpec:
    """The split of one parameter over ``len(sizes)`` TP ranks.

    ``dim`` is the split tensor dimension, or None when the parameter is replicated (then
    ``sizes`` is empty). ``sizes[r]`` is the extent of rank r's slice along ``dim``; slices are
    contiguous and in rank order.
    """

    dim: int | None
    sizes: tuple[int, ...] = ()

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def bounds(self, tp_rank: int) -> tuple[int, int]:
        """``(start, stop)`` of rank ``tp_rank``'s slice along ``dim``."""
        if self.dim is None:
            raise ValueError("a replicated parameter has no slice bounds")
        start = sum(self.sizes[:tp_rank])
        return start, start + self.sizes[tp_rank]

    def offsets(self, tp_rank: int, ndim: int) -> tuple[int, ...]:
        """Offset of rank ``tp_rank``'s shard in every dimension of the global tensor."""
        if self.dim is None:
            return (0,) * ndim
        return tuple(self.bounds(tp_rank)[0] if d == self.dim else 0 for d in range(ndim))

    def shard_shape(self, full_shape: Sequence[int], tp_rank: int) -> tuple[int, ...]:
        """Shape of rank ``tp_rank``'s shard of a global tensor shaped ``full_shape``."""
        shape = list(full_shape)
        if self.dim is not None:
            shape[self.dim] = self.sizes[tp_rank]
        return tuple(shape)


def check_tp_size(config: ModelConfig, tp: int) -> None:
    """Raise UserError unless ``tp`` divides the heads, the kv groups and the FFN size."""
    if tp < 1:
        raise UserError(f"tensor-parallel size must be at least 1, got {tp}")
    sizes = (
        (config.num_attention_heads, f"{config.num_attention_heads} attention heads"),
        (config.num_query_groups, f"{config.num_query_groups} query groups (kv heads)"),
        (config.ffn_hidden_size, f"ffn_hidden_size {config.ffn_hidden_size}"),
    )
    bad = [what for n, what in sizes if n % tp]
    if bad:
        raise UserError(
            f"tp={tp} does not divide the model's {' or '.join(bad)}; use a tp "
            "that divides all of them"
        )


def vocab_sizes(vocab_size: int, tp: int) -> tuple[int, ...]:
    """Vocabulary rows per rank, balanced: the first ``vocab_size % tp`` ranks hold one more."""
    base, extra = divmod(vocab_size, tp)
    if base == 0:
        raise UserError(f"vocabulary of {vocab_size} is smaller than tp={tp}; use a smaller tp")
    return tuple(base + (1 if r < extra else 0) for r in range(tp))


def vocab_range(vocab_size: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """``(start, stop)`` token ids whose embedding rows and logits rank ``tp_rank`` holds."""
    return ShardSpec(0, vocab_sizes(vocab_size, tp)).bounds(tp_rank)


def parameter_shape(name: str, config: ModelConfig) -> tuple[int, ...]:
    """The global (single-process) shape of the parameter called ``name``."""
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    nh, ng, v = config.num_attention_heads, config.num_query_groups, config.vocab_size
    layer = _LAYER_PARAM.fullmatch(name)
    local = layer.group(1) if layer else None
    shapes = {
        "attention.qkv.weight": ((nh + 2 * ng) * d, h),
        "attention.proj.weight": (h, nh * d),
        "mlp.gate.weight": (f, h),
        "mlp.up.weight": (f, h),
        "mlp.down.weight": (h, f),
        "input_norm.weight": (h,),
        "post_attention_norm.weight": (h,),
    }
    if local in shapes:
        return shapes[local]
    top = {"embedding.weight": (v, h), "output.weight": (v, h), "final_norm.weight": (h,)}
    if layer is None and name in top:
        return top[name]
    raise ValueError(f"unknown parameter name {name!r}")


def shard_spec(name: str, config: ModelConfig, tp: int) -> ShardSpec:
    """How the parameter called ``name`` (global name) is split over ``tp`` ranks."""
    check_tp_size(config, tp)
    parameter_shape(name, config)  # rejects unknown names
    if name.endswith("norm.weight"):
        return ShardSpec(None)
    if name in ("embedding.weight", "output.weight"):
        return ShardSpec(0, vocab_sizes(config.vocab_size, tp))
    d = config.kv_channels
    per_group = config.num_attention_heads // config.num_query_groups
    ffn = config.ffn_hidden_size // tp
    layer = _LAYER_PARAM.fullmatch(name)
    assert layer is not None  # a known name, and neither a norm nor a vocabulary one
    local = layer.group(1)
    if local == "attention.qkv.weight":
        return ShardSpec(0, ((config.num_query_groups // tp) * (per_group + 2) * d,) * tp)
    if local == "attention.proj.weight":
        return ShardSpec(1, ((config.num_attention_heads // tp) * d,) * tp)
    if local in ("mlp.gate.weight", "mlp.up.weight"):
        return ShardSpec(0, (ffn,) * tp)
    return ShardSpec(1, (ffn,) * tp)  # mlp.down.weight


def shard_tensor(
    name: str, full: torch.Tensor, config: ModelConfig, tp: int, tp_rank: int
) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of the global tensor ``full`` of parameter ``name``.

    Returns a new contiguous tensor (never a view of ``full``), on ``full``'s device and dtype.
    """
    expected = parameter_shape(name, config)
    if tuple(full.shape) != expected:
        raise ValueError(f"{name}: got shape {tuple(full.shape)}, expected {expected}")
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank {tp_rank} is outside [0, {tp})")
    spec = shard_spec(name, config, tp)
    if spec.dim is None:  # replicated
        return full.clone()
    start, stop = spec.bounds(tp_rank)
    return full.narrow(spec.dim, start, stop - start).clone(memory_format=torch.contiguous_format)


def unshard(
    name: str, shards: Sequence[torch.Tensor], config: ModelConfig, tp: int
) -> torch.Tensor:
    """The global tensor of parameter ``name`` from its ``tp`` shards in rank order.

    A replicated parameter returns (a copy of) the first shard.
    """
    if len(shards) != tp:
        raise ValueError(f"{name}: got {len(shards)} shards for tp={tp}")
    spec = shard_spec(name, config, tp)
    full_shape = parameter_shape(name, config)
    for rank, shard in enumerate(shards):
        expected = spec.shard_shape(full_shape, rank)
        if tuple(shard.shape) != tuple(expected):
            raise ValueError(
                f"{name}: shard {rank} has shape {tuple(shard.shape)}, expected {tuple(expected)}"
            )
    if spec.dim is None:  # replicated
        return shards[0].clone()
    return torch.cat(list(shards), dim=spec.dim)
