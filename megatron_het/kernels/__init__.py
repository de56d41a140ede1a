"""Fused ops with pure-torch fallbacks.

apex, liger-kernel and flash-attn are optional: each is looked up once (its compiled parts
included) and, where installed and the tensors are on a CUDA/ROCm device, its fused kernels are
used; everywhere else the torch implementation runs. Attention picks its kernel deliberately
(:mod:`megatron_het.kernels.attention`). Our own compiled kernels (``csrc/``, the extension
``megatron_het._C``) come first where built: :mod:`megatron_het.kernels.selection` says which
implementation each op runs, ``python -m megatron_het.kernels`` prints it.
"""

from megatron_het.kernels.apex_norm import apex_rms_norm_available
from megatron_het.kernels.attention import (
    AttentionKernel,
    causal_attention,
    choose_attention_kernel,
    reference_attention,
)
from megatron_het.kernels.liger import LIGER, LigerKernels
from megatron_het.kernels.norms import rms_norm
from megatron_het.kernels.swiglu import swiglu

__all__ = [
    "AttentionKernel",
    "LIGER",
    "LigerKernels",
    "apex_rms_norm_available",
    "causal_attention",
    "choose_attention_kernel",
    "reference_attention",
    "rms_norm",
    "swiglu",
]
