"""liger-kernel's fused Triton kernels, where installed: RMSNorm, SwiGLU, linear + cross-entropy.

liger-kernel is optional and never required. It is looked up once, at import; each kernel is
present only if its module imports (liger itself, Triton, and what it needs). The kernels run
only on tensors of :attr:`LigerKernels.device_types` (CUDA, which includes ROCm builds) and only
in eager mode (under ``torch.compile`` inductor fuses our torch code itself). Every use falls
back to our torch implementation; tests inject a :class:`LigerKernels` of fakes.

Only liger's autograd functions (``liger_kernel.ops``) are imported, not its Hugging Face
integration, which would import transformers. They are called with the leading positional
arguments that every liger release accepts and liger's defaults for the rest.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch

from megatron_het.kernels.optional import ImportModule, optional_attr

# (x[..., H], weight[H], eps) -> [..., H] in x's dtype
RmsNormKernel = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
# (gate, up) -> silu(gate) * up
SwiGLUKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (hidden[N, H], weight[V, H], labels[N] with -100 ignored) -> float32 mean cross-entropy
LinearCrossEntropyKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class LigerKernels:
    """The liger kernels found (None where absent) and the device types they run on."""

    rms_norm: RmsNormKernel | None = None
    swiglu: SwiGLUKernel | None = None
    linear_cross_entropy: LinearCrossEntropyKernel | None = None
    device_types: frozenset[str] = frozenset({"cuda"})

    def usable(self, kernel: Callable[..., torch.Tensor] | None, device_type: str) -> bool:
        """Whether ``kernel`` (one of these) exists and may run on ``device_type`` now."""
        return (
            kernel is not None
            and device_type in self.device_types
            and not torch.compiler.is_compiling()
        )


def load_liger(import_module: ImportModule = importlib.import_module) -> LigerKernels:
    """The installed liger kernels, each wrapped to our calling convention."""
    rms = optional_attr(
        "liger_kernel.ops.rms_norm", "LigerRMSNormFunction", import_module=import_module
    )
    silu_mul = optional_attr(
        "liger_kernel.ops.swiglu", "LigerSiLUMulFunction", import_module=import_module
    )
    flce = optional_attr(
        "liger_kernel.ops.fused_linear_cross_entropy",
        "LigerFusedLinearCrossEntropyFunction",
        import_module=import_module,
    )
    return LigerKernels(
        rms_norm=None if rms is None else _rms_norm_adapter(rms),
        swiglu=None if silu_mul is None else silu_mul.apply,
        linear_cross_entropy=None if flce is None else _flce_adapter(flce),
    )


def _rms_norm_adapter(function: type[torch.autograd.Function]) -> RmsNormKernel:
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # liger's default ("llama") casting: 1/rms in float32, output in x's dtype.
        return function.apply(x, weight, eps)

    return rms_norm


def _flce_adapter(function: type[torch.autograd.Function]) -> LinearCrossEntropyKernel:
    def linear_cross_entropy(
        hidden_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor
    ) -> torch.Tensor:
        # Defaults: no bias, ignore_index -100, mean over the tokens not ignored.
        out = function.apply(hidden_NH, weight_VH, labels_N)
        return out[0] if isinstance(out, tuple) else out  # releases differ: loss or (loss, ...)

    return linear_cross_entropy


LIGER = load_liger()
