"""``apply_tp``: turn a single-process Llama model (or pipeline stage) into its TP-sharded form.

The model code knows nothing of tensor parallelism. ``apply_tp`` replaces, in place, each
layer's ``attention.qkv``/``attention.proj`` with column/row-parallel linears, each ``mlp`` with
a :class:`ParallelMLP`, the embedding with a :class:`VocabParallelEmbedding` and the untied
output projection with a vocabulary-sharded weight, all holding this rank's slice of the full
weights (:mod:`megatron_het.tensor_parallel.sharding`). Parameter names stay global. The model's
class becomes :class:`TensorParallelLlamaModel`, whose head computes the vocabulary-parallel loss
without full-vocabulary logits.

Per rank, attention runs ``nh/tp`` query heads and ``ng/tp`` kv groups (contiguous in the
grouped ``qkv`` layout) and the MLP ``F/tp`` hidden units. Each layer communicates two
all-reduces of ``[B, S, H]`` in forward (after ``proj`` and ``down``) and two in backward (before
``qkv`` and before ``gate``/``up``); the embedding adds one in forward, the head one in backward
plus the loss statistics.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from megatron_het.config import ModelConfig
from megatron_het.model.init import initial_value
from megatron_het.model.llama import LlamaModel
from megatron_het.parallel.stage_plan import ATTENTION_BLOCK, MLP_BLOCK
from megatron_het.tensor_parallel.cross_entropy import (
    gather_vocab_parallel_logits,
    vocab_parallel_linear_cross_entropy,
)
from megatron_het.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    SequenceParallelRMSNorm,
    VocabParallelEmbedding,
)
from megatron_het.tensor_parallel.mappings import copy_to_tp
from megatron_het.tensor_parallel.sequence_parallel import gather_from_sp
from megatron_het.tensor_parallel.sharding import (
    check_tp_size,
    shard_tensor,
    vocab_range,
    vocab_sizes,
)
from megatron_het.tensor_parallel.tp_group import TPGroup


class TensorParallelLlamaModel(LlamaModel):
    """A :class:`LlamaModel` after :func:`apply_tp` (never constructed directly).

    ``tp_group`` is its tensor-parallel group; ``vocab_range`` the token ids whose embedding and
    output rows this rank holds. Only :meth:`head` is overridden (the layers and embedding are
    parallel modules already). ``forward`` has the single-process signature and results:
    activations between layers are replicated over the group, logits come back full
    ``[B, S, V]`` (all-gathered) and the loss is the same float32 scalar on every rank.
    """

    tp_group: TPGroup
    vocab_range: tuple[int, int]
    sequence_parallel: bool = False

    def sequence_length(self, hidden: torch.Tensor) -> int:
        return hidden.shape[1] * (self.tp_group.size if self.sequence_parallel else 1)

    def head(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As :meth:`LlamaModel.head`, with the output projection split by vocabulary over
        ``tp_group``: the loss never forms full-vocabulary logits; logits are all-gathered.
        With sequence parallelism the normed ``[B, S/tp, H]`` shards are gathered first (the
        gather's backward sums the ranks' partial input gradients)."""
        if not self.has_head or self.final_norm is None:  # a head has its final norm
            raise RuntimeError("this stage has no head")
        self._ready("head")  # --overlap-param-gather: the head's buckets may be in flight
        normed = self.final_norm(hidden)
        if self.sequence_parallel:
            normed = gather_from_sp(normed, self.tp_group)
        if labels is not None:
            return vocab_parallel_linear_cross_entropy(
                normed,
                self.output_weight(),
                labels,
                self.tp_group,
                self.vocab_range[0],
                loss_weights,
                copy_input=not self.sequence_parallel,
                choice=self.kernels,
            )
        return self.vocab_parallel_logits(normed, gather=True)

    def vocab_parallel_logits(self, normed: torch.Tensor, gather: bool = False) -> torch.Tensor:
        """Logits of final-normed hidden states ``[..., H]`` (the whole sequence): this rank's
        ``[..., Vr]`` columns (token ids ``vocab_range``), or with ``gather`` the full
        ``[..., V]`` on every rank."""
        group = self.tp_group
        if not self.sequence_parallel:  # gathered shards' backward sums the gradient already
            normed = copy_to_tp(normed, group, inplace_grad=True)
        local = F.linear(normed, self.output_weight())
        if not gather:
            return local
        return gather_vocab_parallel_logits(
            local, group, vocab_sizes(self.config.vocab_size, group.size)
        )


def _shard(
    model: nn.Module, name: str, config: ModelConfig, tp: int, tp_rank: int, seed: int | None
) -> torch.Tensor:
    """This rank's shard of parameter ``name``: sliced from the model's current full value, or
    from the layout-independent initial value when ``seed`` is given."""
    param = model.get_parameter(name)
    if seed is None:
        if param.is_meta:
            raise ValueError(f"{name} is on the meta device; pass seed= to initialise the shards")
        full = param.detach()
    else:
        full = initial_value(name, param.shape, config, seed)
    device = torch.device("cpu") if param.is_meta else param.device
    return shard_tensor(name, full, config, tp, tp_rank).to(device=device, dtype=param.dtype)


@torch.no_grad()
def apply_tp(
    model: LlamaModel,
    group: TPGroup,
    config: ModelConfig,
    seed: int | None = None,
    sequence_parallel: bool = False,
    tp_comm_overlap: bool = False,
) -> LlamaModel:
    """Shard ``model`` over the tensor-parallel ``group`` in place and return it.

    Args:
        model: a single-process :class:`LlamaModel` or stage (any layer range, with or without
            embedding and head), with full-size weights; not yet wrapped or given to an
            optimizer (its parameters are replaced).
        group: the stage's TP group; this rank's slice is ``group.rank`` of ``group.size``.
        config: the model's config (heads, kv groups and FFN must be divisible by the TP size).
        seed: when given, shards are drawn from :func:`~megatron_het.model.init.initial_value`
            instead of sliced from the current weights (which may then be on the meta device;
            shards go to the parameters' device, CPU for meta). Either way a shard equals the
            matching slice of the single-process model built with that seed.

    With ``group.size == 1`` the model is returned unchanged (``seed`` is then not used; build
    it with :func:`~megatron_het.model.llama.build_model`). Otherwise every parameter keeps
    its global name and holds this rank's slice (:func:`~megatron_het.tensor_parallel.sharding.
    shard_spec`); norms stay replicated. Collective-free: only the layers' forward and backward
    communicate. ``sequence_parallel`` shards the regions between TP blocks along the sequence
    (:mod:`megatron_het.tensor_parallel.sequence_parallel`): hidden states between layers and
    stages are ``[B, S/tp, H]`` per rank. ``tp_comm_overlap`` (with ``sequence_parallel``)
    overlaps the layers' sequence all-gathers and reduce-scatters with their GEMMs
    (:mod:`megatron_het.tensor_parallel.comm_overlap`).
    """
    tp, tp_rank = group.size, group.rank
    if tp == 1:
        return model
    if isinstance(model, TensorParallelLlamaModel):
        raise ValueError("apply_tp was already applied to this model")
    if config != model.config:
        raise ValueError("config differs from the model's own config")
    check_tp_size(config, tp)

    def shard(name: str) -> torch.Tensor:
        return _shard(model, name, config, tp, tp_rank, seed)

    sp, overlap = sequence_parallel, tp_comm_overlap
    for index, layer in model.decoder_layers():
        prefix = f"layers.{index}."
        norms = []
        if ATTENTION_BLOCK in layer.parts:
            attention = layer.attention
            qkv = shard(prefix + "attention.qkv.weight")
            proj = shard(prefix + "attention.proj.weight")
            attention.qkv = ColumnParallelLinear(
                qkv, group, sequence_parallel=sp, tp_comm_overlap=overlap
            )
            attention.proj = RowParallelLinear(proj, group, sp, overlap)
            attention.num_heads = config.num_attention_heads // tp
            attention.num_groups = config.num_query_groups // tp
            norms.append("input_norm")
        if MLP_BLOCK in layer.parts:
            layer.mlp = ParallelMLP(
                shard(prefix + "mlp.gate.weight"),
                shard(prefix + "mlp.up.weight"),
                shard(prefix + "mlp.down.weight"),
                group,
                sp,
                overlap,
            )
            norms.append("post_attention_norm")
        for norm in norms:
            _replace_replicated(model, f"{prefix}{norm}.weight", seed, config)
            _sequence_parallel_norm(layer.get_submodule(norm), group, sp)
    start, stop = vocab_range(config.vocab_size, tp, tp_rank)
    if model.embedding is not None:
        model.embedding = VocabParallelEmbedding(
            shard("embedding.weight"), start, group, sequence_parallel
        )
    if model.output is not None:
        model.output.weight = nn.Parameter(shard("output.weight"))
        model.output.out_features = model.output.weight.shape[0]
    if model.final_norm is not None:
        _replace_replicated(model, "final_norm.weight", seed, config)
        _sequence_parallel_norm(model.final_norm, group, sequence_parallel)
    model.__class__ = TensorParallelLlamaModel
    tp_model = cast(TensorParallelLlamaModel, model)  # its class, just set
    tp_model.tp_group = group
    tp_model.vocab_range = (start, stop)
    tp_model.sequence_parallel = sequence_parallel
    return tp_model


def _sequence_parallel_norm(norm: nn.Module, group: TPGroup, enabled: bool) -> None:
    """Make a replicated norm sum its weight gradient over ``group`` (sequence parallelism)."""
    if enabled:
        norm.__class__ = SequenceParallelRMSNorm
        cast(SequenceParallelRMSNorm, norm).group = group  # its class, just set


def _replace_replicated(model: nn.Module, name: str, seed: int | None, config: ModelConfig) -> None:
    """Give a replicated parameter its initial value when shards are drawn from ``seed``."""
    if seed is None:
        return
    module_name, _, attr = name.rpartition(".")
    param = model.get_parameter(name)
    device = torch.device("cpu") if param.is_meta else param.device
    value = initial_value(name, param.shape, config, seed).to(device=device, dtype=param.dtype)
    setattr(model.get_submodule(module_name), attr, nn.Parameter(value))
