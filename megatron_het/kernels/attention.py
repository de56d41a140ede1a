"""Causal grouped-query attention with a deliberately chosen kernel.

Left to itself, ``F.scaled_dot_product_attention`` silently takes its math kernel, which builds
the full ``S x S`` score matrix, whenever the fused kernels refuse the inputs; with GQA in
float32 on CUDA that is every call (the memory-efficient kernel has no GQA). So the kernel is
chosen here, from the device type, dtype, GQA, head size and what is installed
(:func:`choose_attention_kernel`), and SDPA is restricted to it with ``sdpa_kernel``:

========  =============  ==========================================================
device    dtype          kernel
========  =============  ==========================================================
cuda      bf16 / fp16    flash-attn's ``flash_attn_func`` where installed (GQA natively);
                         else SDPA's flash backend (GQA natively). Where the device cannot
                         run flash (pre-Ampere GPUs, head size > 256): fp16 the
                         memory-efficient backend, bf16 math.
cuda      fp32           SDPA's memory-efficient backend; kv heads repeated to the query
                         heads for GQA (the backend has no GQA), which costs ``[B, S, N, D]``
                         per k and v, not ``S x S``.
cuda      fp64           math (the only CUDA kernel for float64).
cpu       any float      SDPA's CPU flash kernel (fp32, bf16, fp16, fp64; GQA natively), which
                         tiles the scores instead of materialising ``S x S``.
other     any            SDPA's own choice.
========  =============  ==========================================================

CUDA here includes ROCm builds of torch. Under ``torch.compile`` the flash-attn package is not
used (SDPA's flash backend, the same algorithm, traces into the graph). Query head ``j`` attends
with kv head ``j // (N / G)`` on every path, as in Hugging Face's GQA.

Shape legend: B batch, S sequence, N query heads, G kv heads, D head dim.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_het.kernels.optional import ImportModule, optional_attr

FLASH_MAX_HEAD_DIM = 256  # flash attention (flash-attn 2 and SDPA's) supports D <= 256
# The memory-efficient kernel wants the head size aligned to 8 elements (16-byte loads).
EFFICIENT_HEAD_DIM_MULTIPLE = 8


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """How to run attention.

    ``name``: "flash_attn" (the flash-attn package) or "sdpa". ``backends``: the SDPA
    backends allowed, in priority order (None: SDPA's own choice). ``expand_kv``: repeat the
    kv heads to the query heads first (for a backend without GQA).
    """

    name: str
    backends: tuple[SDPBackend, ...] | None = None
    expand_kv: bool = False

    @property
    def label(self) -> str:
        """The name with the allowed SDPA backends, e.g. ``sdpa[FLASH_ATTENTION]``."""
        if self.backends is None:
            return self.name
        return self.name + "[" + ",".join(b.name for b in self.backends) + "]"


FLASH_ATTN = AttentionKernel("flash_attn")
SDPA_FLASH = AttentionKernel("sdpa", (SDPBackend.FLASH_ATTENTION,))
SDPA_MATH = AttentionKernel("sdpa", (SDPBackend.MATH,))
SDPA_DEFAULT = AttentionKernel("sdpa")


def _sdpa_efficient(gqa: bool) -> AttentionKernel:
    return AttentionKernel("sdpa", (SDPBackend.EFFICIENT_ATTENTION,), expand_kv=gqa)


def choose_attention_kernel(
    device_type: str,
    dtype: torch.dtype,
    gqa: bool,
    head_dim: int,
    flash_attn_installed: bool,
    device_runs_flash: bool = True,
) -> AttentionKernel:
    """The kernel for causal attention over these inputs (the table in the module docstring).

    Args:
        device_type: the tensors' ``device.type`` ("cuda" also for ROCm).
        dtype: the dtype of q, k and v.
        gqa: fewer kv heads than query heads.
        head_dim: D.
        flash_attn_installed: the flash-attn package imports (and may be used now).
        device_runs_flash: the CUDA device runs flash attention (Ampere or newer, or a ROCm
            GPU torch's flash supports); see :func:`device_runs_flash`.
    """
    if device_type == "cpu":
        return SDPA_FLASH if dtype.is_floating_point else SDPA_DEFAULT
    if device_type != "cuda":
        return SDPA_DEFAULT
    efficient_fits = head_dim % EFFICIENT_HEAD_DIM_MULTIPLE == 0
    if dtype in (torch.bfloat16, torch.float16):
        if device_runs_flash and head_dim <= FLASH_MAX_HEAD_DIM:
            return FLASH_ATTN if flash_attn_installed else SDPA_FLASH
        # bf16 in the memory-efficient kernel needs Ampere too: the device lacks flash only
        # when it predates Ampere, or for a head too large for flash.
        if efficient_fits and (dtype == torch.float16 or device_runs_flash):
            return _sdpa_efficient(gqa)
        return SDPA_MATH
    if dtype == torch.float32 and efficient_fits:
        return _sdpa_efficient(gqa)
    return SDPA_MATH


def load_flash_attn(
    import_module: ImportModule = importlib.import_module,
) -> Callable[..., torch.Tensor] | None:
    """flash-attn's ``flash_attn_func``, or None when the package (or its CUDA extension,
    ``flash_attn_2_cuda``, which it imports itself) is missing."""
    return optional_attr("flash_attn", "flash_attn_func", import_module=import_module)


_FLASH_ATTN_FUNC = load_flash_attn()
# (CUDA device, head dim) -> whether torch's flash attention trains on it (decided once each).
_DEVICE_RUNS_FLASH: dict[tuple[torch.device, int], bool] = {}


def device_runs_flash(device: torch.device, head_dim: int = 64) -> bool:
    """Whether SDPA's flash backend runs forward and backward on ``device`` at ``head_dim``
    (asked of torch once per device and head dim, on a tiny bf16 input that needs gradients:
    some GPUs run large heads' forward only; CPU: True). Under ``torch.compile`` an unasked
    pair counts as capable: :func:`~megatron_het.model.compile.compile_layers` asks first."""
    if device.type != "cuda":
        return device.type == "cpu"
    key = (device, head_dim)
    known = _DEVICE_RUNS_FLASH.get(key)
    if known is None:
        if torch.compiler.is_compiling():
            return True
        known = _ask_torch_about_flash(device, head_dim)
        _DEVICE_RUNS_FLASH[key] = known
    return known


def _ask_torch_about_flash(device: torch.device, head_dim: int) -> bool:
    probe = torch.zeros(1, 2, 16, head_dim, dtype=torch.bfloat16, device=device, requires_grad=True)
    try:
        params = torch.backends.cuda.SDPAParams(probe, probe, probe, None, 0.0, True, False)
        return bool(torch.backends.cuda.can_use_flash_attention(params, False))
    except (AttributeError, TypeError, RuntimeError):  # an older torch's API
        if torch.version.hip is not None:
            return False
        return torch.cuda.get_device_capability(device) >= (8, 0)


def kernel_for(q_BSND: torch.Tensor, k_BSGD: torch.Tensor) -> AttentionKernel:
    """:func:`choose_attention_kernel` for these tensors and what is installed."""
    device = q_BSND.device
    flash_ok = device.type != "cuda" or device_runs_flash(device, q_BSND.shape[-1])
    return choose_attention_kernel(
        device.type,
        q_BSND.dtype,
        q_BSND.shape[2] != k_BSGD.shape[2],
        q_BSND.shape[-1],
        _FLASH_ATTN_FUNC is not None and not torch.compiler.is_compiling(),
        flash_ok,
    )


def causal_attention(
    q_BSND: torch.Tensor,
    k_BSGD: torch.Tensor,
    v_BSGD: torch.Tensor,
    kernel: AttentionKernel | None = None,
    flash_attn_func: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal softmax attention, ``[B, S, N, D]`` out, scale ``1/sqrt(D)``.

    ``q[B, S, N, D]``, ``k``/``v[B, S, G, D]`` with ``G`` dividing ``N`` (last dimension
    contiguous; other strides free). ``kernel`` overrides :func:`kernel_for`'s choice and
    ``flash_attn_func`` the installed flash-attn function (tests inject both). The output is a
    view in the ``[B, S, N, D]`` order, not necessarily contiguous.
    """
    kernel = kernel_for(q_BSND, k_BSGD) if kernel is None else kernel
    if kernel.name == "flash_attn":
        function = _FLASH_ATTN_FUNC if flash_attn_func is None else flash_attn_func
        assert function is not None  # kernel_for picks flash_attn only where it is installed
        return function(q_BSND, k_BSGD, v_BSGD, causal=True)
    per_group = q_BSND.shape[2] // k_BSGD.shape[2]
    if kernel.expand_kv and per_group > 1:
        k_BSGD, v_BSGD = _repeat_kv(k_BSGD, per_group), _repeat_kv(v_BSGD, per_group)
        per_group = 1
    q, k, v = q_BSND.transpose(1, 2), k_BSGD.transpose(1, 2), v_BSGD.transpose(1, 2)
    if kernel.backends is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=per_group > 1)
    else:
        with sdpa_kernel(list(kernel.backends)):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=per_group > 1)
    return out.transpose(1, 2)


def _repeat_kv(x_BSGD: torch.Tensor, per_group: int) -> torch.Tensor:
    """``[B, S, G, D] -> [B, S, G * per_group, D]``, kv head g serving query heads
    ``g * per_group .. (g + 1) * per_group - 1``."""
    B, S, G, D = x_BSGD.shape
    return x_BSGD[:, :, :, None].expand(B, S, G, per_group, D).reshape(B, S, G * per_group, D)


def reference_attention(
    q_BSND: torch.Tensor, k_BSGD: torch.Tensor, v_BSGD: torch.Tensor
) -> torch.Tensor:
    """Pure-torch causal GQA with the explicit ``S x S`` scores (softmax in float32 or wider);
    the
    reference :func:`causal_attention` is tested against. Returns ``[B, S, N, D]``."""
    per_group = q_BSND.shape[2] // k_BSGD.shape[2]
    k, v = _repeat_kv(k_BSGD, per_group), _repeat_kv(v_BSGD, per_group)
    wide = torch.promote_types(q_BSND.dtype, torch.float32)
    q_f, k_f, v_f = (t.transpose(1, 2).to(wide) for t in (q_BSND, k, v))  # [B, N, S, D]
    S = q_f.shape[2]
    scores = q_f @ k_f.transpose(-1, -2) / math.sqrt(q_f.shape[-1])
    mask = torch.ones(S, S, dtype=torch.bool, device=scores.device).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return (probs @ v_f).transpose(1, 2).to(q_BSND.dtype)
