"""Tensor-parallel communication ops, each beside its backward twin and the group it uses.

Every op is an ``autograd.Function`` that takes the tensor-parallel group explicitly (a
:class:`~megatron_het.tensor_parallel.tp_group.TPGroup`, such as a
:class:`~megatron_het.comm.UnifiedGroup`; nothing here looks a group up). Collectives are
synchronous and run on the group's own links, so a TP group of one accelerator kind stays on its
native backend.

    op               forward                          backward
    copy_to_tp       identity                         all-reduce (sum)
    reduce_from_tp   all-reduce (sum)                 identity
    gather_from_tp   all-gather along the last dim    keep this rank's slice of the last dim
    scatter_to_tp    keep this rank's slice           all-gather along the last dim

Slices along the last dimension are equal, contiguous and in group-rank order: rank r holds
columns ``[r * c, (r + 1) * c)`` of a ``[..., size * c]`` tensor.

All-reduces work in place, so by default they first copy their input. Two opt-ins skip that
copy when the tensor is contiguous: ``reduce_from_tp(x, group, inplace=True)`` sums ``x``
itself (marked dirty for autograd, so a use of the partial values that autograd saved raises
instead of reading the sum); ``copy_to_tp(x, group, inplace_grad=True)`` sums the incoming
gradient itself, which is right when the op after ``copy_to_tp`` makes a fresh input gradient
that nothing else holds (a linear layer does; an addition, which hands one gradient to both
operands, does not). Results are the same either way.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_het.kernels.graph_break import graph_break
from megatron_het.tensor_parallel.tp_group import TPGroup


def _all_reduce(x: torch.Tensor, group: TPGroup, inplace: bool = False) -> torch.Tensor:
    """Sum of ``x`` over the group: ``x`` itself when ``inplace`` and ``x`` is contiguous, else
    a fresh contiguous tensor (``x`` is left untouched)."""
    out = x if inplace and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
    group.all_reduce(out, op="sum")
    return out


def _all_gather_last_dim(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """``[..., c]`` on every rank -> ``[..., size * c]``, rank r's block at columns r*c."""
    size = group.size
    stacked = torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)
    group.all_gather_into_tensor(stacked, x.contiguous())
    # [size, ..., c] -> [..., size, c] -> [..., size * c]
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


def _split_last_dim(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """This rank's contiguous block of the last dimension (which ``group.size`` must divide)."""
    size, last = group.size, x.shape[-1]
    if last % size:
        raise ValueError(f"last dimension {last} is not divisible by the TP size {size}")
    width = last // size
    return x.narrow(-1, group.rank * width, width).contiguous()


class _CopyToTP(torch.autograd.Function):
    """Enter a tensor-parallel region whose ranks each use the whole (replicated) input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup, inplace_grad: bool) -> torch.Tensor:
        ctx.group, ctx.inplace_grad = group, inplace_grad
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.group, ctx.inplace_grad), None, None


class _ReduceFromTP(torch.autograd.Function):
    """Leave a tensor-parallel region by summing the ranks' partial results."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup, inplace: bool) -> torch.Tensor:
        # a view changed in place would need autograd to rebase it: copy those as before
        out = _all_reduce(x, group, inplace and x._base is None)
        if out is x:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    """Concatenate the ranks' last-dimension slices into the full tensor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last_dim(grad, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's last-dimension slice of a replicated tensor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_last_dim(grad, ctx.group), None


@graph_break  # a compiled layer breaks its graph here: dynamo cannot trace groups
def copy_to_tp(x: torch.Tensor, group: TPGroup, inplace_grad: bool = False) -> torch.Tensor:
    """Identity forward; backward all-reduces (sums) the gradient over ``group`` (in the
    incoming gradient itself with ``inplace_grad``, see the module docstring)."""
    return _CopyToTP.apply(x, group, inplace_grad)


@graph_break  # a compiled layer breaks its graph here: dynamo cannot trace groups
def reduce_from_tp(x: torch.Tensor, group: TPGroup, inplace: bool = False) -> torch.Tensor:
    """Forward sums ``x`` over ``group`` (a new tensor; ``x`` itself with ``inplace`` when it
    is contiguous and not a view); backward passes the gradient through."""
    return _ReduceFromTP.apply(x, group, inplace)


@graph_break  # a compiled layer breaks its graph here: dynamo cannot trace groups
def gather_from_tp(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """``[..., c] -> [..., size * c]`` by all-gather; backward keeps this rank's ``c`` columns."""
    return _GatherFromTP.apply(x, group)


@graph_break  # a compiled layer breaks its graph here: dynamo cannot trace groups
def scatter_to_tp(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """``[..., size * c] -> [..., c]`` (this rank's columns); backward all-gathers the gradient."""
    return _ScatterToTP.apply(x, group)
