"""RMSNorm: apex's fused CUDA kernel where available, ``torch.nn.functional.rms_norm`` otherwise."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F


def _load_apex() -> Optional[Callable[..., torch.Tensor]]:
    try:
        from apex.normalization.fused_layer_norm import fused_rms_norm_affine
    except Exception:  # apex absent, or built without its CUDA extensions
        return None
    return fused_rms_norm_affine


_APEX_RMS_NORM = _load_apex()


def apex_rms_norm_available() -> bool:
    """Whether apex's fused RMSNorm kernel can be used (on CUDA/ROCm tensors)."""
    return _APEX_RMS_NORM is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             fused: Any = None) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dimension.

    ``x`` and ``weight`` share a dtype. ``fused`` overrides the kernel (for tests); by default
    apex's kernel runs on device tensors when apex is installed, torch's op everywhere else.
    """
    kernel = _APEX_RMS_NORM if fused is None else fused
    if kernel is not None and x.is_cuda:
        return kernel(x, weight, weight.shape, eps)
    return F.rms_norm(x, weight.shape, weight, eps)
