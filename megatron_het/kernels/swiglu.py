"""SwiGLU's gating product ``silu(gate) * up``: liger's fused kernel where available, torch's
ops otherwise (the same result up to rounding; the output has the inputs' dtype)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_het.kernels.liger import LIGER, LigerKernels
from megatron_het.kernels.selection import ALL_FUSED, KernelChoice


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    liger: LigerKernels | None = None,
    choice: KernelChoice = ALL_FUSED,
) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate``/``up`` of one shape ``[..., F]``.

    liger's kernel (one pass forward and backward instead of three) runs on CUDA/ROCm tensors
    of one dtype in eager mode when liger-kernel is installed and ``choice`` allows it;
    ``liger`` replaces the installed kernels (tests inject fakes). With the fusion off
    (``--no-bias-swiglu-fusion``) torch's two ops run as they are.
    """
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
