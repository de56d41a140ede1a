"""Tensor parallelism: mappings, column/row/vocab-parallel layers, vocab-parallel cross-entropy,
per-parameter shard specs, and :func:`apply_tp` to shard a built Llama model or stage."""

from __future__ import annotations

from megatron_het.tensor_parallel.apply import TensorParallelLlamaModel, apply_tp
from megatron_het.tensor_parallel.cross_entropy import (
    gather_vocab_parallel_logits,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)
from megatron_het.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron_het.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
)
from megatron_het.tensor_parallel.sharding import (
    ShardSpec,
    check_tp_size,
    parameter_shape,
    shard_spec,
    shard_tensor,
    unshard,
    vocab_range,
    vocab_sizes,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "RowParallelLinear",
    "ShardSpec",
    "TensorParallelLlamaModel",
    "VocabParallelEmbedding",
    "apply_tp",
    "check_tp_size",
    "copy_to_tp",
    "gather_from_tp",
    "gather_vocab_parallel_logits",
    "parameter_shape",
    "reduce_from_tp",
    "scatter_to_tp",
    "shard_spec",
    "shard_tensor",
    "unshard",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "vocab_range",
    "vocab_sizes",
]
