"""Sequence parallelism: the regions between TP blocks sharded along the sequence.

With ``sequence_parallel`` a stage's activations between its TP blocks (norms, residual adds,
the stage boundary) are ``[B, S/tp, H]`` per rank, rank r holding positions
``[r * S/tp, (r + 1) * S/tp)`` (:func:`megatron_het.parallel.sequence.sequence_range`),
instead of the replicated ``[B, S, H]``. Where a TP block starts, an all-gather along the
sequence replaces the identity (its backward a reduce-scatter replaces the all-reduce); where
it ends, a reduce-scatter replaces the all-reduce (backward: an all-gather). Bytes on the wire
are those of TP's all-reduces (an all-reduce is a reduce-scatter plus an all-gather);
activation memory between blocks drops by ``tp``.

    op                      forward                           backward
    gather_from_sp          all-gather along the sequence     reduce-scatter along the sequence
    reduce_scatter_to_sp    reduce-scatter along the sequence all-gather along the sequence
    sp_norm_weight          identity                          all-reduce of the weight grad

The replicated norm weights see only this rank's positions, so their gradients are partial:
:func:`sp_norm_weight` sums them over the group in backward (in float32), before they reach
``.grad`` (or the float32 main gradient), so every TP rank holds the full gradient as without
sequence parallelism and nothing downstream changes.

Tensors are ``[B, S, H]`` (batch first): the sequence is dim 1. Shape legend: B batch, S
sequence, H hidden, tp the group size.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_het.kernels.graph_break import graph_break
from megatron_het.kernels.main_grad import add_to_main_grad
from megatron_het.tensor_parallel.tp_group import TPGroup

SEQ_DIM = 1


def _gather_seq(x_BsH: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """``[B, S/tp, H]`` per rank -> ``[B, S, H]`` with rank r's block at positions r*S/tp."""
    size = group.size
    stacked = torch.empty((size, *x_BsH.shape), dtype=x_BsH.dtype, device=x_BsH.device)
    group.all_gather_into_tensor(stacked, x_BsH.contiguous())
    B, s, H = x_BsH.shape
    return stacked.permute(1, 0, 2, 3).reshape(B, size * s, H)


def _reduce_scatter_seq(x_BSH: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """``[B, S, H]`` partial sums -> this rank's ``[B, S/tp, H]`` block of their sum."""
    size = group.size
    B, S, H = x_BSH.shape
    if S % size:
        raise ValueError(f"sequence length {S} is not divisible by the TP size {size}")
    blocks = x_BSH.reshape(B, size, S // size, H).transpose(0, 1).contiguous()
    out = torch.empty((B, S // size, H), dtype=x_BSH.dtype, device=x_BSH.device)
    group.reduce_scatter_tensor(out, blocks, "sum")
    return out


class _GatherFromSP(torch.autograd.Function):
    """Enter a TP block: every rank needs the whole sequence."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    """Leave a TP block: sum the ranks' partial results, keep this rank's positions."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_seq(grad, ctx.group), None


class _NormWeight(torch.autograd.Function):
    """A replicated weight used on this rank's positions only: sum its gradient over TP."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group, ctx.param = group, weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        total = grad.float().contiguous()  # sum partial gradients once, in float32
        ctx.group.all_reduce(total, op="sum")
        if add_to_main_grad(ctx.param, total):  # a bf16 weight: kept in float32
            return None, None
        return total.to(grad.dtype), None


@graph_break  # a compiled layer breaks its graph here: dynamo cannot trace groups
def gather_from_sp(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """``[B, S/tp, H] -> [B, S, H]`` by all-gather; backward reduce-scatters the gradient."""
    return _GatherFromSP.apply(x, group)


@graph_break  # a compiled layer breaks its graph here: dynamo cannot trace groups
def reduce_scatter_to_sp(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """``[B, S, H]`` partial sums -> this rank's ``[B, S/tp, H]`` of their sum; backward
    all-gathers the gradient."""
    return _ReduceScatterToSP.apply(x, group)


@graph_break  # a compiled layer breaks its graph here: dynamo cannot trace groups
def sp_norm_weight(weight: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Identity forward; backward all-reduces the weight's gradient over ``group`` (float32)."""
    return _NormWeight.apply(weight, group)
