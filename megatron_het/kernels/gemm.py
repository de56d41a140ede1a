"""Matrix products whose results come out in float32 from low-precision operands.

The fused output layer + loss computes its logits in float32 and sums its weight gradient over
chunks in float32. A bf16 GEMM rounds its float32 accumulator to bf16 on the way out, which
would throw both away. So the head holds its GEMM operands in :func:`gemm_operand_dtype`:

* the compute dtype (bf16/fp16) where torch has ``out_dtype`` GEMMs for the device (CUDA and
  ROCm builds of torch >= 2.8, found by one tiny trial GEMM per device): tensor-core speed,
  float32 results;
* float32 elsewhere (CPU, which has no ``aten::mm.dtype`` kernel, or an older torch): the
  operands are upcast once, so every product of the bf16 values is exact and summed in
  float32. Same numbers, slower on an accelerator.
"""

from __future__ import annotations

import torch

_LOW_PRECISION = (torch.bfloat16, torch.float16)
# (device type, index) -> whether torch.mm(..., out_dtype=torch.float32) runs there, and
# whether torch.addmm(acc, ..., out_dtype=torch.float32, out=acc) with a float32 acc does too
# (torch before late 2025 refuses a float32 ``self`` with bf16 operands).
_OUT_DTYPE_GEMM: dict[tuple[str, int | None], tuple[bool, bool]] = {}


def _probe(device: torch.device) -> tuple[bool, bool]:
    """(mm, addmm) with ``out_dtype=torch.float32`` on bf16 operands work on ``device`` and
    give the right sums; tried once per device, with one host synchronisation each."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, False
    key = (device.type, device.index)
    known = _OUT_DTYPE_GEMM.get(key)
    if known is None:
        probe = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        try:
            product = torch.mm(probe, probe, out_dtype=torch.float32)
            mm = product.dtype == torch.float32 and bool((product == 16).all())
        except (RuntimeError, TypeError, NotImplementedError):  # older torch, or no kernel
            mm = False
        try:
            acc = torch.ones(16, 16, dtype=torch.float32, device=device)
            torch.addmm(acc, probe, probe, out_dtype=torch.float32, out=acc)
            addmm = mm and bool((acc == 17).all())
        except (RuntimeError, TypeError, NotImplementedError):
            addmm = False
        known = _OUT_DTYPE_GEMM[key] = (mm, addmm)
    return known


def fp32_out_gemm_supported(device: torch.device) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` works for bf16 operands on
    ``device`` (then :func:`mm_fp32_out` and :func:`addmm_fp32_out_` keep the operands in
    bf16)."""
    return _probe(device)[0]


def fp32_out_addmm_supported(device: torch.device) -> bool:
    """Whether the in-place accumulation ``torch.addmm(acc, a, b, out_dtype=torch.float32,
    out=acc)`` (``acc`` float32, bf16 operands) works on ``device``; where only the product
    does, :func:`addmm_fp32_out_` adds a float32 product instead."""
    return _probe(device)[1]


def gemm_operand_dtype(compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to hold GEMM operands in so that :func:`mm_fp32_out` and
    :func:`addmm_fp32_out_` return float32 sums: ``compute_dtype`` itself unless it is bf16/fp16
    on a device without ``out_dtype`` GEMMs, where it is float32."""
    if compute_dtype in _LOW_PRECISION and not fp32_out_gemm_supported(device):
        return torch.float32
    return compute_dtype


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a[M, K] @ b[K, N]`` accumulated and returned in float32 (float64 stays float64).

    bf16/fp16 operands need :func:`fp32_out_gemm_supported`; otherwise they are upcast here
    (callers that multiply the same operand many times upcast it once with
    :func:`gemm_operand_dtype` instead)."""
    if a.dtype in _LOW_PRECISION and a.dtype == b.dtype and fp32_out_gemm_supported(a.device):
        return torch.mm(a, b, out_dtype=torch.float32)
    if a.dtype in _LOW_PRECISION or b.dtype in _LOW_PRECISION:
        return torch.mm(a.float(), b.float())
    return torch.mm(a, b)


def addmm_fp32_out_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc[M, N] += a[M, K] @ b[K, N]`` in place, ``acc`` float32 (or float64): the product is
    never rounded to the operands' dtype. Returns ``acc``."""
    if a.dtype in _LOW_PRECISION and a.dtype == b.dtype and fp32_out_gemm_supported(a.device):
        if fp32_out_addmm_supported(a.device):
            return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return acc.add_(torch.mm(a, b, out_dtype=torch.float32))
    if a.dtype != acc.dtype or b.dtype != acc.dtype:
        a, b = a.to(acc.dtype), b.to(acc.dtype)
    return acc.addmm_(a, b)
