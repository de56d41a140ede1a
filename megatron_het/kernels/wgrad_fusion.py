"""A linear layer's weight-gradient GEMM fused with the gradient's accumulation (Megatron's
gradient accumulation fusion; ``--no-gradient-accumulation-fusion`` turns it off).

Unfused, the backward of ``y = x @ W.T`` hands ``dW = dY.T @ X`` to autograd as a new tensor in
the weight's dtype, which autograd then adds into ``.grad`` (a float32 weight's gradient bucket
view) or which the optimizer's hook adds into the float32 ``main_grad`` and frees (a bf16/fp16
weight, :mod:`megatron_het.kernels.main_grad`). Fused, backward adds ``dY.T @ X`` where it ends
up, with the destination as the GEMM's accumulator (beta = 1), and returns no gradient for the
weight:

* a weight with a ``main_grad``: ``main_grad += dY.T @ X`` in float32
  (:func:`~megatron_het.kernels.gemm.addmm_fp32_out_`: ``out_dtype`` GEMMs on CUDA/ROCm; on the
  CPU, which has no ``aten::mm.dtype`` kernel, the operands are upcast, which on hosts without
  bf16 matrix units is also several times faster than a bf16 GEMM, see docs/kernels.md). The
  products are never rounded to bf16. The optimizer is then told, by the ``main_grad`` callback,
  exactly as the fused head does; the parameter's post-accumulate hook finds no ``.grad`` and
  counts nothing, so the data-parallel buckets see one gradient event per backward pass.
* a float32 (or float64) weight whose ``.grad`` exists (its bucket view, or the sum of earlier
  micro-batches): ``.grad += dY.T @ X`` in place. Autograd still runs the weight's gradient
  accumulator with nothing to add, and with it the post-accumulate-grad hooks: again one event
  per backward pass, from the same hook as unfused.

Everything else gets the ordinary gradient from the same function: a weight with neither (a
float32 weight's first backward outside the optimizer; a bf16 weight without ``main_grad``),
``create_graph``, and a backward pass that will not accumulate into the weight
(``torch.autograd.grad``, ``backward(inputs=...)`` without it), where an in-place add would be a
side effect nobody asked for. Without grad, with ``fuse=False`` and under ``torch.compile``
(inductor schedules the GEMMs itself) the layer is plain ``F.linear``.

Shape legend: N rows (tokens, all leading dimensions), I input features, O output features.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

from megatron_het.kernels.autocast import autocast_dtype, autocast_off
from megatron_het.kernels.gemm import addmm_fp32_out_
from megatron_het.kernels.main_grad import MAIN_GRAD, notify_main_grad_added
from megatron_het.kernels.selection import ALL_FUSED, KernelChoice

_IN_PLACE_GRAD_DTYPES = (torch.float32, torch.float64)


def _engine_accumulates(param: torch.Tensor) -> bool:
    """Whether the running backward pass will run ``param``'s gradient accumulator (False under
    ``torch.autograd.grad``, which returns gradients instead of accumulating them)."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:  # a torch without the query: never risk an unasked side effect
        return False
    try:
        return bool(will_execute(get_gradient_edge(param).node))
    except RuntimeError:  # raised for a leaf under autograd.grad(): nothing accumulates
        return False


def accumulation_target(param: torch.Tensor) -> torch.Tensor | None:
    """Where the running backward pass may add ``param``'s gradient in place: its float32
    ``main_grad``, its existing float32/float64 ``.grad``, or None (return the gradient to
    autograd). Call it from a backward function; after adding, call :func:`added_in_place`."""
    if torch.is_grad_enabled() or not param.is_leaf or not param.requires_grad:
        return None  # create_graph (the gradient must be differentiable), or not a parameter
    main: torch.Tensor | None = getattr(param, MAIN_GRAD, None)
    grad = param.grad
    if main is None and (grad is None or param.dtype not in _IN_PLACE_GRAD_DTYPES):
        return None
    if not _engine_accumulates(param):
        return None
    return main if main is not None else grad


def added_in_place(param: torch.Tensor, target: torch.Tensor) -> None:
    """Report that this backward pass's gradient of ``param`` went into ``target`` (from
    :func:`accumulation_target`): the optimizer is told when it was the ``main_grad``; a
    ``.grad`` needs nothing, since autograd's accumulator runs the hooks anyway."""
    if target is getattr(param, MAIN_GRAD, None):
        notify_main_grad_added(param)


def accumulate_weight_grad(
    param: torch.Tensor, grad_out_NO: torch.Tensor, x_NI: torch.Tensor
) -> torch.Tensor | None:
    """``dW[O, I] = grad_out.T @ x`` added in place where :func:`accumulation_target` says
    (then None, the weight's gradient for autograd), else returned in the operands' dtype."""
    target = accumulation_target(param)
    if target is None:
        return grad_out_NO.t().mm(x_NI)
    addmm_fp32_out_(target, grad_out_NO.t(), x_NI)
    added_in_place(param, target)
    return None


class _LinearFusedWgrad(torch.autograd.Function):
    """``F.linear(x, weight)`` whose backward accumulates the weight gradient in place."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.param = weight  # the parameter itself, whose main_grad / .grad backward reads
        dtype = autocast_dtype(x.device.type)
        if dtype is not None:  # what F.linear multiplies under autocast
            x, weight = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x, weight)
        with autocast_off(x.device.type):
            return F.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = accumulate_weight_grad(
                ctx.param, grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
            )
        return grad_x, grad_weight


def linear(x: torch.Tensor, weight: torch.Tensor, fuse: bool = True) -> torch.Tensor:
    """``x[..., I] @ weight[O, I].T -> [..., O]`` (no bias), values as ``F.linear``.

    ``fuse``: the backward pass adds the weight gradient into ``main_grad`` or the existing
    ``.grad`` in place (module docstring); off, without grad or under ``torch.compile`` this is
    ``F.linear``. Side effect of the fused backward: the ``main_grad`` callback runs."""
    if fuse and weight.requires_grad and torch.is_grad_enabled():
        if not torch.compiler.is_compiling():
            result: torch.Tensor = _LinearFusedWgrad.apply(x, weight)
            return result
    return F.linear(x, weight)


class FusedWgradLinear(nn.Linear):
    """``nn.Linear`` without a bias (``weight [O, I]``, the same state-dict key) whose forward
    is :func:`linear`, fused as ``kernels.gradient_accumulation_fusion`` says
    (:func:`~megatron_het.model.llama.use_kernels` sets ``kernels``)."""

    kernels: KernelChoice = ALL_FUSED

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.kernels.gradient_accumulation_fusion)
