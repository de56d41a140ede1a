"""Pure-torch float64 references of the compiled ops' contract (``csrc/ops.cpp``) and the
inputs the ``kernels`` check feeds both, at the 7B layer's shapes.

Shape legend: N rows (tokens), H hidden, F FFN width, B batch, S sequence, G head groups, R heads
per group, D head dimension, P table positions, V vocabulary (shard) columns.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64
SEED = 1234
# The 7B layer (Llama-2 7B, 8192 tokens of a micro-batch): H 4096, F 11008, 32 query and 8 kv
# heads of 128, a 32000-token vocabulary over 4096 rows.
ROWS, HIDDEN, FFN = 8192, 4096, 11008
SEQ, Q_HEADS, KV_HEADS, HEAD_DIM = 8192, 32, 8, 128
CE_ROWS, VOCAB = 4096, 32000
EPS = 1e-5
ROPE_OFFSET = 16  # positions start past 0: the table lookup must add it
VOCAB_START = 1000  # a vocabulary shard: labels below it or past its end are not in the shard


def generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(SEED)


def rms_inputs(device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """x, residual, grad_out, grad_sum [N, H] and weight [H] in ``dtype``."""
    g = generator(device)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=g).to(dtype)

    weight = (1 + 0.1 * torch.randn(HIDDEN, device=device, generator=g)).to(dtype)
    return {
        "x": draw(ROWS, HIDDEN),
        "residual": draw(ROWS, HIDDEN),
        "weight": weight,
        "grad_out": draw(ROWS, HIDDEN),
        "grad_sum": draw(ROWS, HIDDEN),
    }


def rms_norm_fwd_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, sum, rstd) in float64; sum is x + residual rounded to x's dtype, as stored."""
    s = x if residual is None else (x.to(F64) + residual.to(F64)).to(x.dtype)
    s64 = s.to(F64)
    rstd = torch.rsqrt(s64.square().mean(-1) + eps)
    return s64 * rstd[:, None] * weight.to(F64), s64, rstd


def rms_norm_bwd_ref(
    grad_out: torch.Tensor,
    grad_sum: torch.Tensor | None,
    inp: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_input, grad_weight) in float64."""
    r = rstd.to(F64)[:, None]
    n = inp.to(F64) * r
    g = grad_out.to(F64)
    wg = weight.to(F64) * g
    grad_input = (wg - n * (wg * n).mean(-1, keepdim=True)) * r
    if grad_sum is not None:
        grad_input = grad_input + grad_sum.to(F64)
    return grad_input, (g * n).sum(0)


def rope_inputs(
    device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1, S, 32, 1, D] and k [1, S, 8, 1, D] as strided views of one fused qkv projection
    [1, S, 48, 1, D] (the normal case), and float32 cos, sin [P, D/2]."""
    g = generator(device)
    qkv = torch.randn(1, SEQ, Q_HEADS + 2 * KV_HEADS, 1, HEAD_DIM, device=device, generator=g)
    qkv = qkv.to(dtype)
    q, k = qkv[:, :, :Q_HEADS], qkv[:, :, Q_HEADS : Q_HEADS + KV_HEADS]
    positions = torch.arange(ROPE_OFFSET + SEQ, device=device, dtype=F64)
    inv_freq = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2, device=device, dtype=F64) / HEAD_DIM)
    angles = positions[:, None] * inv_freq[None, :]
    return q, k, angles.cos().float(), angles.sin().float()


def rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int, inverse: bool
) -> torch.Tensor:
    """x [B, S, G, R, D] rotated (rotate-half) at positions offset + s, in float64."""
    seq, half = x.shape[1], x.shape[-1] // 2
    c = cos[offset : offset + seq].to(F64)[None, :, None, None, :]
    s = sin[offset : offset + seq].to(F64)[None, :, None, None, :]
    sign = -1.0 if inverse else 1.0
    x1, x2 = x.to(F64)[..., :half], x.to(F64)[..., half:]
    return torch.cat([x1 * c - sign * x2 * s, x2 * c + sign * x1 * s], dim=-1)


def swiglu_inputs(
    device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate and up [N, F] in ``dtype`` as the two halves of one fused [N, 2F] projection (rows
    with a stride of 2F; gate at scale 3, so that silu's curved part and tails are both
    crossed), and grad [N, F]."""
    g = generator(device)
    fused = torch.randn(ROWS, 2 * FFN, device=device, generator=g)
    fused[:, :FFN] *= 3
    gate, up = fused.to(dtype).chunk(2, dim=-1)
    return gate, up, torch.randn(ROWS, FFN, device=device, generator=g).to(dtype)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float64."""
    g = gate.to(F64)
    return g * torch.sigmoid(g) * up.to(F64)


def swiglu_bwd_ref(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up) in float64: grad * up * silu'(gate) and grad * silu(gate)."""
    g, d = gate.to(F64), grad.to(F64)
    s = torch.sigmoid(g)
    return d * up.to(F64) * s * (1 + g * (1 - s)), d * g * s


def ce_inputs(
    device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V] in ``dtype`` (scale 3: a peaked softmax) of the shard [VOCAB_START,
    VOCAB_START + V); labels int64 [N], 1 in 16 a token below the shard and 1 in 16 the ignore
    index -100; a float32 loss scale [N]."""
    g = generator(device)
    logits = (3 * torch.randn(CE_ROWS, VOCAB, device=device, generator=g)).to(dtype)
    labels = torch.randint(VOCAB_START, VOCAB_START + VOCAB, (CE_ROWS,), device=device, generator=g)
    row = torch.arange(CE_ROWS, device=device)
    labels = torch.where(row % 16 == 0, labels % VOCAB_START, labels)
    labels = torch.where(row % 16 == 8, torch.full_like(labels, -100), labels)
    scale = 0.5 + torch.rand(CE_ROWS, device=device, generator=g)
    return logits, labels, scale


def ce_stats_ref(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum_exp, target) in float64."""
    x = logits.to(F64)
    top = x.max(-1).values
    sum_exp = (x - top[:, None]).exp().sum(-1)
    column = labels - vocab_start
    inside = (column >= 0) & (column < x.shape[1])
    target = x.gather(1, column.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
    return top, sum_exp, torch.where(inside, target, torch.zeros_like(target))


def ce_grad_ref(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    scale: torch.Tensor | None,
) -> torch.Tensor:
    """(exp(logits - lse) - onehot(label)) * scale in float64."""
    grad = (logits.to(F64) - lse.to(F64)[:, None]).exp()
    column = labels - vocab_start
    inside = (column >= 0) & (column < logits.shape[1])
    rows = torch.arange(logits.shape[0], device=logits.device)[inside]
    grad[rows, column[inside]] -= 1.0
    return grad if scale is None else grad * scale.to(F64)[:, None]


def lse_of(top: torch.Tensor, sum_exp: torch.Tensor) -> torch.Tensor:
    return top + sum_exp.log()


def bytes_moved(*tensors: torch.Tensor) -> int:
    """Bytes of the given tensors (each read or written once)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def table_bytes(cos: torch.Tensor, seq: int, offset: int) -> int:
    """Bytes of the cos and sin rows the positions [offset, offset + seq) read."""
    rows = min(cos.shape[0], offset + seq) - offset
    return 2 * max(rows, 0) * cos.shape[1] * cos.element_size()


def gigabytes_per_second(nbytes: int, milliseconds: float) -> float:
    return nbytes / (milliseconds * 1e-3) / 1e9 if milliseconds > 0 else math.inf
