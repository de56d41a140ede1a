"""The compiled fused kernels of ``csrc/`` (the extension ``megatron_het._C``), where built.

The install builds the extension (``setup.py``): C++ for CPU always, CUDA where torch has CUDA
and nvcc is found, HIP (hipified CUDA) on a ROCm torch with hipcc. Importing it registers the ops
``torch.ops.megatron_het.*`` per device with torch's dispatcher; whether an op runs on a device
type is asked of the dispatcher, so a CPU-only build on a GPU host is seen as such. A missing or
broken extension is not an error: every op then runs its torch reference, and :attr:`why` says
why (``python -m megatron_het.kernels`` prints it).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch

from megatron_het.kernels.optional import ImportModule

NAMESPACE = "megatron_het"
# The ops of each op family (csrc/<family>/), in the order they are declared in csrc/ops.cpp.
FAMILY_OPS: dict[str, tuple[str, ...]] = {
    "rms_norm": ("rms_norm_fwd", "rms_norm_bwd"),
    "rope": ("rope_fwd",),
    "cross_entropy": ("cross_entropy_stats", "cross_entropy_grad_", "cross_entropy_fused_"),
    "swiglu": ("swiglu_fwd", "swiglu_bwd"),
}
# torch device type -> the dispatch key the implementations register under
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
HasKernel = Callable[[str, str], bool]


def _dispatcher_has_kernel(op: str, key: str) -> bool:
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", key))


@dataclasses.dataclass(frozen=True)
class KernelExtension:
    """What the built extension provides.

    ``loaded``: it imported (its ops are registered); ``why``: the import error otherwise.
    ``has_kernel(op, dispatch_key)`` asks the dispatcher (tests inject fakes).
    """

    loaded: bool
    why: str = ""
    has_kernel: HasKernel = _dispatcher_has_kernel

    def supports(self, family: str, device_type: str) -> bool:
        """Whether every op of ``family`` has a compiled kernel for ``device_type``."""
        key = _DISPATCH_KEYS.get(device_type)
        return (
            self.loaded
            and key is not None
            and all(self.has_kernel(op, key) for op in FAMILY_OPS[family])
        )

    def device_flavour(self) -> str:
        """What this torch's "cuda" device kernels are compiled as: "CUDA" or "HIP" (ROCm)."""
        return "HIP" if getattr(torch.version, "hip", None) else "CUDA"


def load_extension(import_module: ImportModule = importlib.import_module) -> KernelExtension:
    """Import ``megatron_het._C`` once; a failure is recorded, not raised."""
    try:
        import_module(f"{NAMESPACE}._C")
    except ImportError as exc:
        return KernelExtension(False, f"megatron_het._C is not built ({exc})")
    except Exception as exc:  # built against another torch, missing symbols, ...
        return KernelExtension(False, f"megatron_het._C does not load: {exc}")
    return KernelExtension(True)


def ops() -> Any:
    """``torch.ops.megatron_het`` (the op namespace; only call ops the extension supports)."""
    return getattr(torch.ops, NAMESPACE)


EXTENSION = load_extension()
