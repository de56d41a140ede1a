"""SwiGLU's gating product ``silu(gate) * up``: our compiled kernel (``csrc/swiglu``) where built
for the device, else liger's fused kernel where installed (CUDA/ROCm), else torch's ops (the
reference). All give the same result up to rounding; the output has the inputs' dtype.

The order is :mod:`~megatron_het.kernels.selection`'s for every family: ours, then a library's,
then torch's. Ours reads gate and up once and writes the output once (forward), reads grad,
gate and up once and writes both input gradients once (backward), in float32 with one rounding
of each output, and saves only gate and up (silu is recomputed in the backward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_het.kernels.csrc_ops import FLOAT_DTYPES, CsrcSwiGLU, check_swiglu
from megatron_het.kernels.extension import EXTENSION, KernelExtension
from megatron_het.kernels.liger import LIGER, LigerKernels
from megatron_het.kernels.selection import ALL_FUSED, KernelChoice


def use_csrc_swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    choice: KernelChoice,
    extension: KernelExtension = EXTENSION,
) -> bool:
    """Whether our compiled SwiGLU takes these tensors now: allowed by ``choice``, in eager
    mode (under ``torch.compile`` inductor fuses torch's ops itself), one float dtype, and a
    kernel for the device in ``extension``."""
    return (
        choice.swiglu
        and not torch.compiler.is_compiling()
        and gate.dtype == up.dtype
        and gate.dtype in FLOAT_DTYPES
        and extension.supports("swiglu", gate.device.type)
    )


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    liger: LigerKernels | None = None,
    choice: KernelChoice = ALL_FUSED,
    extension: KernelExtension = EXTENSION,
) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate``/``up`` of one shape ``[..., F]`` and float dtypes.

    Our kernel runs where :func:`use_csrc_swiglu` says so; else liger's (one pass forward and
    backward instead of three) on CUDA/ROCm tensors of one dtype in eager mode when
    liger-kernel is installed and ``choice`` allows libraries. ``liger`` and ``extension``
    replace the installed kernels (tests inject fakes). With the fusion off
    (``--no-bias-swiglu-fusion``) torch's two ops run as they are. A bad dtype, shape or device
    pair raises one line naming the op (TypeError or ValueError).
    """
    check_swiglu(gate, up)
    if use_csrc_swiglu(gate, up, choice, extension):
        return CsrcSwiGLU.apply(gate, up)
    kernels = LIGER if liger is None else liger
    fused = kernels.swiglu
    allowed = choice.swiglu and choice.libraries
    if (
        allowed
        and fused is not None
        and gate.dtype == up.dtype
        and kernels.usable(fused, gate.device.type)
    ):
        return fused(gate, up)
    if not choice.swiglu or gate.dtype != up.dtype or torch.compiler.is_compiling():
        return F.silu(gate) * up  # inductor fuses these and picks what to save itself
    return _SwiGLU.apply(gate, up)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` saving only ``gate`` and ``up`` (silu is recomputed in backward);
    eager torch would also keep ``silu(gate)``, one more ``[..., F]`` tensor per layer.

    Backward is torch's own ops in the inputs' dtype, each rounding once as autograd's would:
    ``grad * silu(gate)`` and ``silu_backward(grad * up, gate)`` (float32 internally). Doing it
    in explicit float32 temporaries instead cost 2-5x the time on a CPU (bench.kernels)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate)
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up
