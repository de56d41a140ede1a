"""RMSNorm: apex's or liger's fused kernel where available, ``torch.nn.functional.rms_norm``
otherwise, with one dtype rule for all three.

The rule (what :func:`rms_norm` returns, whichever kernel runs):

* The output has the dtype of the input ``x``, whatever the weight's dtype and whether
  autocast is on. The statistics (mean of squares, 1/rms) are computed in float32.
* Autocast is switched off inside. Without that the kernels would disagree: under CUDA
  autocast torch's ``rms_norm`` runs in float32 and returns float32, while apex's wrapper
  casts its inputs to the autocast dtype and returns bf16. With fp32 parameters under autocast
  the residual stream is float32, so the norm returns float32 and the next GEMM casts to the
  autocast dtype; with bf16 parameters (no autocast) ``x`` and the output are bf16.
* A fused kernel runs only when ``x`` and ``weight`` share a dtype, on CUDA/ROCm tensors, in
  eager mode. Mixed dtypes take the torch path: normalise and scale in float32, round once to
  ``x``'s dtype.

apex counts as present only when its compiled extension ``fused_layer_norm_cuda`` imports as
well as its Python wrapper (a pure-Python apex install then falls back to torch). apex is
preferred to liger where both are installed.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F

from megatron_het.kernels.autocast import autocast_off
from megatron_het.kernels.liger import LIGER, LigerKernels, RmsNormKernel
from megatron_het.kernels.optional import ImportModule, optional_attr

# The CUDA extension apex's fused norms call (imported lazily by apex, at the first call).
APEX_NORM_EXTENSION = "fused_layer_norm_cuda"


def load_apex_rms_norm(
    import_module: ImportModule = importlib.import_module,
) -> RmsNormKernel | None:
    """apex's fused affine RMSNorm as ``(x, weight, eps) -> y``, or None when apex or its
    compiled extension is missing."""
    fused = optional_attr(
        "apex.normalization.fused_layer_norm",
        "fused_rms_norm_affine",
        requires=(APEX_NORM_EXTENSION,),
        import_module=import_module,
    )
    if fused is None:
        return None

    def apex_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused(x, weight, weight.shape, eps)

    return apex_rms_norm


_APEX_RMS_NORM = load_apex_rms_norm()


def apex_rms_norm_available() -> bool:
    """Whether apex's fused RMSNorm kernel can be used (on CUDA/ROCm tensors)."""
    return _APEX_RMS_NORM is not None


def fused_rms_norm_kernel(
    device_type: str,
    x_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    apex: RmsNormKernel | None = _APEX_RMS_NORM,
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


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, fused: RmsNormKernel | None = None
) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dimension, in ``x``'s dtype.

    ``x[..., H]``, ``weight[H]`` of any float dtypes; see the module docstring for the dtype
    rule. ``fused`` forces a kernel ``(x, weight, eps) -> y`` (tests inject fakes; it then runs
    on any device, still only for matching dtypes); by default :func:`fused_rms_norm_kernel`
    picks one.
    """
    with autocast_off(x.device.type):
        if x.dtype != weight.dtype:
            normed = F.rms_norm(x.float(), weight.shape, None, eps)
            return (normed * weight.float()).to(x.dtype)
        kernel = (
            fused
            if fused is not None
            else fused_rms_norm_kernel(x.device.type, x.dtype, weight.dtype)
        )
        if kernel is not None:
            return kernel(x, weight, eps)
        if torch.compiler.is_compiling():  # inductor fuses torch's op and picks what to save
            return F.rms_norm(x, weight.shape, weight, eps)
        return _RMSNorm.apply(x, weight, eps)


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
