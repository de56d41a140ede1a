"""apex's fused RMSNorm, where installed with its compiled extension.

apex counts as present only when its compiled extension ``fused_layer_norm_cuda`` imports as
well as its Python wrapper (a pure-Python apex install then falls back to torch). Looked up
once, at import.
"""

from __future__ import annotations

import importlib

import torch

from megatron_het.kernels.liger import RmsNormKernel
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


APEX_RMS_NORM = load_apex_rms_norm()


def apex_rms_norm_available() -> bool:
    """Whether apex's fused RMSNorm kernel can be used (on CUDA/ROCm tensors)."""
    return APEX_RMS_NORM is not None
