"""Tensor-parallel layers built from this rank's shard of a weight (no biases).

Each layer holds its shard as ``weight`` so that, put in place of a single-process module, the
parameter keeps its global name (``layers.3.mlp.up.weight``). The shard comes from
:func:`~megatron_het.tensor_parallel.sharding.shard_tensor`, so it equals the matching slice of
the single-process weights. Communication goes through the mappings of
:mod:`megatron_het.tensor_parallel.mappings` on the group given at construction, or with
``sequence_parallel`` through those of :mod:`megatron_het.tensor_parallel.sequence_parallel`
(inputs and outputs ``[B, S/tp, H]`` sharded along the sequence instead of replicated);
with ``tp_comm_overlap`` as well, the sequence's all-gathers and reduce-scatters run as rings
overlapped with the GEMMs (:mod:`megatron_het.tensor_parallel.comm_overlap`).

Shape legend: H hidden (input features), O output features, tp the group size, V vocabulary,
Vr this rank's vocabulary rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_het.kernels import swiglu
from megatron_het.kernels.selection import ALL_FUSED, KernelChoice
from megatron_het.kernels.wgrad_fusion import linear
from megatron_het.model.llama import RMSNorm
from megatron_het.tensor_parallel.comm_overlap import all_gather_linear, linear_reduce_scatter
from megatron_het.tensor_parallel.mappings import copy_to_tp, reduce_from_tp
from megatron_het.tensor_parallel.sequence_parallel import (
    gather_from_sp,
    reduce_scatter_to_sp,
    sp_norm_weight,
)
from megatron_het.tensor_parallel.tp_group import TPGroup


class ColumnParallelLinear(nn.Module):
    """``y = x @ W.T`` with W's OUTPUT rows split: this rank computes ``y[..., O/tp]``.

    Args:
        weight: this rank's rows ``[O/tp, H]`` (becomes the parameter ``weight``).
        group: the tensor-parallel group.
        copy_input: wrap the input in :func:`copy_to_tp`, whose backward all-reduces the input
            gradient over ``group``. Turn it off when the caller already did that for the same
            input (several column-parallel layers reading one tensor need only one all-reduce).
        sequence_parallel: the input is ``[B, S/tp, H]``; entering gathers the sequence (its
            backward reduce-scatters the input gradient) instead of :func:`copy_to_tp`.
        tp_comm_overlap: with ``sequence_parallel``, the gather runs block by block beside
            the GEMM (:func:`~megatron_het.tensor_parallel.comm_overlap.all_gather_linear`).

    Input ``[..., H]`` replicated on every rank; output ``[..., O/tp]`` sharded, not gathered.
    The weight gradient is accumulated in the backward GEMM as ``kernels`` allows
    (:mod:`megatron_het.kernels.wgrad_fusion`).
    """

    kernels: KernelChoice = ALL_FUSED

    def __init__(
        self,
        weight: torch.Tensor,
        group: TPGroup,
        copy_input: bool = True,
        sequence_parallel: bool = False,
        tp_comm_overlap: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.group = group
        self.copy_input = copy_input
        self.sequence_parallel = sequence_parallel
        self.tp_comm_overlap = tp_comm_overlap and sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fuse = self.kernels.gradient_accumulation_fusion
        if self.copy_input and self.tp_comm_overlap:
            return all_gather_linear(x, (self.weight,), self.group, fuse)[0]
        if self.copy_input:
            x = enter_tp(x, self.group, self.sequence_parallel)
        return linear(x, self.weight, fuse)

    def extra_repr(self) -> str:
        rows, cols = self.weight.shape
        return f"in={cols}, out={rows}x{self.group.size} (column-parallel)"


class RowParallelLinear(nn.Module):
    """``y = x @ W.T`` with W's INPUT columns split: partial products summed over the group.

    Args:
        weight: this rank's columns ``[O, H/tp]``.
        group: the tensor-parallel group.
        sequence_parallel: leave by a reduce-scatter along the sequence (output
            ``[B, S/tp, O]``) instead of an all-reduce.
        tp_comm_overlap: with ``sequence_parallel``, the reduce-scatter runs block by block
            beside the GEMM (:func:`~megatron_het.tensor_parallel.comm_overlap.
            linear_reduce_scatter`).

    Input ``[..., H/tp]`` sharded (the output of a column-parallel layer); output ``[..., O]``
    replicated, after one all-reduce in forward (none in backward). The weight gradient is
    accumulated as in :class:`ColumnParallelLinear`.
    """

    kernels: KernelChoice = ALL_FUSED

    def __init__(
        self,
        weight: torch.Tensor,
        group: TPGroup,
        sequence_parallel: bool = False,
        tp_comm_overlap: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.tp_comm_overlap = tp_comm_overlap and sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fuse = self.kernels.gradient_accumulation_fusion
        if self.tp_comm_overlap:
            return linear_reduce_scatter(x, self.weight, self.group, fuse)
        return leave_tp(linear(x, self.weight, fuse), self.group, self.sequence_parallel)

    def extra_repr(self) -> str:
        rows, cols = self.weight.shape
        return f"in={cols}x{self.group.size}, out={rows} (row-parallel)"


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split over the group.

    Args:
        weight: rows ``[vocab_start, vocab_start + Vr)`` of the ``[V, H]`` table, shape ``[Vr, H]``.
        vocab_start: first token id held here.
        group: the tensor-parallel group.

    ``forward(ids[...]) -> [..., H]``, replicated: each rank looks up the ids it holds (zeros
    for the others) and one all-reduce sums the ranks' contributions. The weight gradient of
    each rank is exactly its rows of the single-process gradient.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        vocab_start: int,
        group: TPGroup,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab_start = vocab_start
        self.group = group
        self.sequence_parallel = sequence_parallel  # output [B, S/tp, H] (reduce-scatter)

    @property
    def vocab_stop(self) -> int:
        return self.vocab_start + self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        here = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(here, local, 0), self.weight)
        # Zero (not just skip) the foreign rows, so row 0 gets no gradient from them either.
        rows = rows * here.unsqueeze(-1).to(rows.dtype)
        return leave_tp(rows, self.group, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (
            f"vocab=[{self.vocab_start}, {self.vocab_stop}) of {self.group.size} ranks, "
            f"hidden={self.weight.shape[1]}"
        )


class ParallelMLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))`` with gate/up column- and down row-parallel.

    The children keep the names ``gate``, ``up`` and ``down``. The input enters the parallel
    region once (one backward all-reduce for gate and up together); the output is all-reduced
    once by ``down``. Input and output ``[..., H]`` replicated. With ``sequence_parallel`` and
    ``tp_comm_overlap``, gate and up multiply each sequence block of one overlapped all-gather.
    """

    kernels: KernelChoice = ALL_FUSED

    def __init__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        group: TPGroup,
        sequence_parallel: bool = False,
        tp_comm_overlap: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.tp_comm_overlap = tp_comm_overlap and sequence_parallel
        self.gate = ColumnParallelLinear(gate, group, copy_input=False)
        self.up = ColumnParallelLinear(up, group, copy_input=False)
        self.down = RowParallelLinear(down, group, sequence_parallel, tp_comm_overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_comm_overlap:
            weights = (self.gate.weight, self.up.weight)
            fuse = self.kernels.gradient_accumulation_fusion
            gate, up = all_gather_linear(x, weights, self.group, fuse)
            return self.down(swiglu(gate, up, choice=self.kernels))
        x = enter_tp(x, self.group, self.sequence_parallel)
        return self.down(swiglu(self.gate(x), self.up(x), choice=self.kernels))


class SequenceParallelRMSNorm(RMSNorm):
    """:class:`~megatron_het.model.llama.RMSNorm` on ``[B, S/tp, H]`` sequence shards: the
    weight (replicated, name unchanged) passes :func:`sp_norm_weight`, whose backward sums its
    partial gradients over ``group``."""

    group: TPGroup

    def norm_weight(self) -> torch.Tensor:
        return sp_norm_weight(self.weight, self.group)


def enter_tp(x: torch.Tensor, group: TPGroup, sequence_parallel: bool) -> torch.Tensor:
    """Enter a TP block whose ranks all read the whole input: :func:`copy_to_tp`, or with
    sequence parallelism the all-gather of the sequence shards."""
    if sequence_parallel:
        return gather_from_sp(x, group)
    return copy_to_tp(x, group, inplace_grad=True)


def leave_tp(x: torch.Tensor, group: TPGroup, sequence_parallel: bool) -> torch.Tensor:
    """Leave a TP block by summing the ranks' partial results: the all-reduce, or with
    sequence parallelism the reduce-scatter into sequence shards."""
    if sequence_parallel:
        return reduce_scatter_to_sp(x, group)
    return reduce_from_tp(x, group, inplace=True)
