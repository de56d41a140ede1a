"""Rotary position embeddings (RoPE) in the rotate-half convention.

Head channels ``[0, d/2)`` pair with ``[d/2, d)``: channel ``j`` and ``j + d/2`` rotate together
by the angle ``position * inv_freq[j]``. This is the convention of Hugging Face's Llama, so
weights move between the two without any permutation of query/key rows.

Optional Llama-3.1 frequency scaling (``ModelConfig.rope_scaling``) rescales ``inv_freq``: long
wavelengths are divided by ``factor``, short ones kept, and the band in between interpolated.

Our compiled kernel (``csrc/rope``) rotates q and k in one pass from float32 tables, at
positions ``offset + s`` (a shard of the sequence rotates by its own positions); the torch
reference rounds the tables to the activations' dtype first, as Hugging Face does.

Shape legend: B batch, S sequence, N heads, G head groups, R heads per group, D head dimension,
P table positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from megatron_het.config import ModelConfig, RopeScaling
from megatron_het.kernels.autocast import autocast_dtype
from megatron_het.kernels.csrc_ops import FLOAT_DTYPES, CsrcRope, check_rope
from megatron_het.kernels.extension import EXTENSION, KernelExtension
from megatron_het.kernels.selection import ALL_FUSED, KernelChoice


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """``inv_freq[D/2]`` in float32, with Llama-3.1 scaling applied when ``scaling`` is given."""
    # Explicit CPU device: the tables must be real even when the model is built on "meta".
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    # Between the two wavelengths, blend the scaled and unscaled frequencies linearly in
    # old_context / wavelen.
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def use_csrc_rope(
    x: torch.Tensor, choice: KernelChoice = ALL_FUSED, extension: KernelExtension = EXTENSION
) -> bool:
    """Whether our compiled RoPE takes activations like ``x`` now (eager mode only)."""
    return (
        choice.rope
        and not torch.compiler.is_compiling()
        and x.dtype in FLOAT_DTYPES
        and extension.supports("rope", x.device.type)
    )


def rope_table_dtype(activations: torch.Tensor, choice: KernelChoice = ALL_FUSED) -> torch.dtype:
    """The dtype of the tables RoPE takes, so they need no cast per layer: float32 for our
    kernel; for the torch reference the dtype q and k have when they reach RoPE: the autocast
    dtype when autocast is on for the activations' device (the qkv GEMM then outputs it), else
    the activations' own dtype (bf16 with bf16 parameters, float32 in fp32 runs)."""
    if use_csrc_rope(activations, choice):
        return torch.float32
    return autocast_dtype(activations.device.type) or activations.dtype


class RotaryEmbedding(nn.Module):
    """Holds ``inv_freq`` and caches ``cos``/``sin`` tables per (seq, device, dtype).

    The cache is an ordinary dict on this instance (not a buffer), so it never enters a state
    dict and follows no ``.to()``; entries are keyed by device and dtype instead.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.kv_channels
        self.inv_freq = rope_inverse_frequencies(
            self.head_dim, config.rope_theta, config.rope_scaling
        )
        self._cache: dict[
            tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]
        ] = {}

    def cos_sin(
        self, seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos[S, 1, D/2]`` and ``sin[S, 1, D/2]`` for positions ``0 .. S-1``.

        Half width: channels ``j`` and ``j + D/2`` share an angle, see :func:`apply_rope`.
        Computed in float32 and then cast to ``dtype`` (as Hugging Face does). The tables are
        made outside inference mode so a model evaluated under ``torch.inference_mode`` can
        still train afterwards with the cached entries.
        """
        key = (seq_len, torch.device(device), dtype)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        with torch.inference_mode(False), torch.no_grad():
            positions = torch.arange(seq_len, dtype=torch.float32, device="cpu")
            angles = torch.outer(positions, self.inv_freq)  # [S, D/2]
            cos = angles.cos().to(device=device, dtype=dtype)[:, None, :].contiguous()
            sin = angles.sin().to(device=device, dtype=dtype)[:, None, :].contiguous()
        self._cache[key] = (cos, sin)
        return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """``[x1 cos - sign x2 sin, x2 cos + sign x1 sin]`` into one fresh contiguous tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=out1)
    out1.addcmul_(x2, sin, value=-sign)
    torch.mul(x2, cos, out=out2)
    out2.addcmul_(x1, sin, value=sign)
    return out


class _Rope(torch.autograd.Function):
    """Rotation by the tables; backward is the rotation by the opposite angle."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[..., S, <heads>, D]`` by the half-width tables of :meth:`RotaryEmbedding.cos_sin`.

    ``cos``/``sin`` broadcast against ``x[..., :D/2]`` (``[S, 1, D/2]`` for ``x[B, S, N, D]``).
    Equals ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` with four fused kernels and
    no temporaries; ``x`` may be a strided view. Returns a new contiguous tensor.
    """
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return _Rope.apply(x, cos, sin)


def apply_rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    offset: int = 0,
    choice: KernelChoice = ALL_FUSED,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q[B, S, G, R, D]`` and ``k[B, S, G2, R2, D]`` (strided views of a fused qkv
    output are fine) at positions ``offset .. offset + S - 1``.

    ``cos``/``sin`` are the tables of :meth:`RotaryEmbedding.cos_sin` for at least
    ``offset + S`` positions (``[P, 1, D/2]`` or ``[P, D/2]``). Returns new contiguous tensors
    of q's and k's shapes, by our kernel (one launch for both, float32 tables) where
    :func:`use_csrc_rope`, else by :func:`apply_rope`.
    """
    cos2, sin2 = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    check_rope(q, k, cos2, sin2, offset)
    if use_csrc_rope(q, choice):
        return CsrcRope.apply(q, k, cos2.float(), sin2.float(), offset)
    positions = slice(offset, offset + q.shape[1])
    cos_q = cos2[positions][:, None, None, :]  # [S, 1, 1, D/2] against [B, S, G, R, D/2]
    sin_q = sin2[positions][:, None, None, :]
    return apply_rope(q, cos_q, sin_q), apply_rope(k, cos_q, sin_q)
