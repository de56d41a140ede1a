"""Fused ops with pure-torch fallbacks.

apex is optional: where it is installed and the tensors are on a CUDA/ROCm device, its fused
kernels are used; everywhere else the torch implementation runs. ``csrc/`` will add our own
kernels behind the same functions.
"""
from megatron_het.kernels.norms import apex_rms_norm_available, rms_norm

__all__ = ["apex_rms_norm_available", "rms_norm"]
