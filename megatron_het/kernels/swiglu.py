"""SwiGLU's gating product ``silu(gate) * up``: liger's fused kernel where available, torch's
ops otherwise (the same result up to rounding; the output has the inputs' dtype)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_het.kernels.liger import LIGER, LigerKernels


def swiglu(gate: torch.Tensor, up: torch.Tensor, liger: LigerKernels | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate``/``up`` of one shape ``[..., F]``.

    liger's kernel (one pass forward and backward instead of three) runs on CUDA/ROCm tensors
    of one dtype in eager mode when liger-kernel is installed; ``liger`` replaces the installed
    kernels (tests inject fakes).
    """
    kernels = LIGER if liger is None else liger
    fused = kernels.swiglu
    if fused is not None and gate.dtype == up.dtype and kernels.usable(fused, gate.device.type):
        return fused(gate, up)
    if gate.dtype != up.dtype or torch.compiler.is_compiling():
        return F.silu(gate) * up  # inductor fuses these and picks what to save itself
    return _SwiGLU.apply(gate, up)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` saving only ``gate`` and ``up`` (silu is recomputed in backward);
    eager torch would also keep ``silu(gate)``, one more ``[..., F]`` tensor per layer."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate.float())
        silu = gate.float() * sig
        grad32 = grad.float()
        grad_up = (grad32 * silu).to(up.dtype)
        grad_gate = (grad32 * up.float() * sig * (1 + gate.float() * (1 - sig))).to(gate.dtype)
        return grad_gate, grad_up
