"""RMSNorm, alone or with the residual add fused in: our compiled kernel (``csrc/rms_norm``)
where built for the device, else apex's or liger's fused kernel where installed, else torch's
ops, with one dtype rule for all.

The rule (what :func:`rms_norm` returns, whichever kernel runs):

* The output has the dtype of the input ``x``, whatever the weight's dtype and whether
  autocast is on. The statistics (mean of squares, 1/rms) are computed in float32.
* Autocast is switched off inside. Without that the kernels would disagree: under CUDA
  autocast torch's ``rms_norm`` runs in float32 and returns float32, while apex's wrapper
  casts its inputs to the autocast dtype and returns bf16. With fp32 parameters under autocast
  the residual stream is float32, so the norm returns float32 and the next GEMM casts to the
  autocast dtype; with bf16 parameters (no autocast) ``x`` and the output are bf16.
* Our kernel runs in eager mode on the devices it is built for, with the weight in ``x``'s
  dtype or float32; it scales in float32 and rounds once. apex's and liger's run only when ``x``
  and ``weight`` share a dtype, on CUDA/ROCm tensors, in eager mode. Mixed dtypes otherwise take
  the torch path: normalise and scale in float32, round once to ``x``'s dtype.

apex counts as present only when its compiled extension imports as well as its Python wrapper
(:mod:`megatron_het.kernels.apex_norm`). apex is preferred to liger where both are installed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_het.kernels.apex_norm import APEX_RMS_NORM
from megatron_het.kernels.autocast import autocast_off
from megatron_het.kernels.csrc_ops import (
    CsrcAddRMSNorm,
    CsrcRMSNorm,
    check_float,
    check_shape,
    csrc_dtypes_ok,
)
from megatron_het.kernels.extension import EXTENSION, KernelExtension
from megatron_het.kernels.liger import LIGER, LigerKernels, RmsNormKernel
from megatron_het.kernels.selection import ALL_FUSED, KernelChoice


def fused_rms_norm_kernel(
    device_type: str,
    x_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    apex: RmsNormKernel | None = APEX_RMS_NORM,
    liger: LigerKernels = LIGER,
) -> RmsNormKernel | None:
    """The fused kernel :func:`rms_norm` uses for these tensors, or None for torch's op:
    apex's, else liger's, on CUDA/ROCm when ``x`` and ``weight`` share a dtype, not while
    ``torch.compile`` traces (inductor fuses torch's op with its neighbours itself)."""
    if x_dtype != weight_dtype or torch.compiler.is_compiling():
        return None
    if apex is not None and device_type == "cuda":
        return apex
    if liger.usable(liger.rms_norm, device_type):
        return liger.rms_norm
    return None


def use_csrc_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    choice: KernelChoice,
    extension: KernelExtension = EXTENSION,
    dtype: torch.dtype | None = None,
) -> bool:
    """Whether our compiled norm takes these tensors now (see the module docstring), ``x``
    taken in ``dtype`` when given (the dtype it will be cast to first)."""
    return (
        choice.rms_norm
        and not torch.compiler.is_compiling()
        and extension.supports("rms_norm", x.device.type)
        and csrc_dtypes_ok(dtype or x.dtype, weight.dtype)
    )


def _check_norm(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    check_float(op, "x", x)
    check_float(op, "weight", weight)
    check_shape(
        op,
        weight.dim() == 1 and x.dim() >= 1 and weight.shape[0] == x.shape[-1],
        f"weight must be [H] for x [..., H], got {tuple(weight.shape)} for {tuple(x.shape)}",
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    fused: RmsNormKernel | None = None,
    choice: KernelChoice = ALL_FUSED,
) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dimension, in ``x``'s dtype.

    ``x[..., H]``, ``weight[H]`` of float dtypes (float32, bfloat16, float16); see the module
    docstring for the dtype rule. ``choice`` says which fused kernels may run. ``fused`` forces
    a kernel ``(x, weight, eps) -> y`` (tests inject fakes; it then runs on any device, still
    only for matching dtypes); by default our kernel, else :func:`fused_rms_norm_kernel`'s.
    """
    _check_norm("rms_norm", x, weight)
    with autocast_off(x.device.type):
        if fused is None and use_csrc_norm(x, weight, choice):
            return CsrcRMSNorm.apply(x, weight, eps)
        if x.dtype != weight.dtype:
            normed = F.rms_norm(x.float(), weight.shape, None, eps)
            return (normed * weight.float()).to(x.dtype)
        kernel = fused
        if kernel is None and choice.rms_norm and choice.libraries:
            kernel = fused_rms_norm_kernel(x.device.type, x.dtype, weight.dtype)
        if kernel is not None:
            return kernel(x, weight, eps)
        if torch.compiler.is_compiling():  # inductor fuses torch's op and picks what to save
            return F.rms_norm(x, weight.shape, weight, eps)
        return _RMSNorm.apply(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    choice: KernelChoice = ALL_FUSED,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)``: a pre-norm block's residual add
    and the next norm in one pass where our kernel runs (two outputs, one read of each input).

    ``x`` and ``residual`` of one shape ``[..., H]``; the sum has their promoted dtype (as
    ``x + residual``), the normed output the sum's dtype. Where the dtypes differ the lower one
    is cast first, as the add would."""
    _check_norm("add_rms_norm", x, weight)
    check_float("add_rms_norm", "residual", residual)
    check_shape(
        "add_rms_norm",
        x.shape == residual.shape,
        f"x and residual must have one shape, got {tuple(x.shape)} and {tuple(residual.shape)}",
    )
    dtype = torch.promote_types(x.dtype, residual.dtype)
    if use_csrc_norm(x, weight, choice, dtype=dtype):
        with autocast_off(x.device.type):
            normed, total = CsrcAddRMSNorm.apply(x.to(dtype), residual.to(dtype), weight, eps)
        return normed, total
    total = x + residual
    return rms_norm(total, weight, eps, choice=choice), total


class _RMSNorm(torch.autograd.Function):
    """torch's RMSNorm arithmetic (float32 statistics, ``round(x * rstd) * weight``) saving
    only ``x`` in its own dtype and the float32 ``rstd[..., 1]`` for backward. torch's
    composite op would keep float32 copies of a low-precision ``x`` (4 bytes per element
    instead of 2, twice), which the memory model would have to count per norm."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        x32, grad32 = x.float(), grad.float()
        normed = x32 * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            dims = tuple(range(grad.dim() - 1))
            grad_weight = (grad32 * normed.to(x.dtype).float()).sum(dims).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = grad32 * weight.float()
            mean = (grad_normed * normed).mean(-1, keepdim=True)
            grad_x = ((grad_normed - normed * mean) * rstd).to(x.dtype)
        return grad_x, grad_weight, None
