"""Autograd functions over the compiled ops of ``csrc/`` (see ``csrc/ops.cpp`` for the contract).

Callers check :func:`~megatron_het.kernels.selection.implementation` first: these functions
assume the extension has the op for the tensors' device. Arguments are checked here, with one
line naming the op and what it accepts (:func:`check_float`, :func:`check_shape`); the
implementations' own checks are a second line.

Shape legend: N rows (tokens), H hidden, F FFN width, B batch, S sequence, G head groups, R heads
per group, D head dimension, P table positions, V vocabulary (shard) columns.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_het.kernels.extension import ops

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOAT_NAMES = "float32, bfloat16 or float16"


def check_float(op: str, name: str, tensor: torch.Tensor) -> None:
    """TypeError naming ``op`` unless ``tensor`` is float32, bfloat16 or float16."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be {_FLOAT_NAMES}, got {tensor.dtype}")


def check_shape(op: str, ok: bool, what: str) -> None:
    """ValueError ``"{op}: {what}"`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{op}: {what}")


def csrc_dtypes_ok(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
    """Whether the compiled norm takes these dtypes: weight in x's dtype or float32."""
    return x_dtype in FLOAT_DTYPES and weight_dtype in (x_dtype, torch.float32)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


class CsrcRMSNorm(torch.autograd.Function):
    """``rms_norm(x) * weight`` over the last dimension; saves ``x`` and float32 ``rstd[N]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = _rows(x)
        out, _, rstd = ops().rms_norm_fwd(rows, None, weight.contiguous(), eps)
        ctx.save_for_backward(rows, weight, rstd)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = ops().rms_norm_bwd(
            _rows(grad), None, rows, weight, rstd, ctx.needs_input_grad[1]
        )
        grad_weight = grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x.view(grad.shape), grad_weight, None


class CsrcAddRMSNorm(torch.autograd.Function):
    """``(normed, sum)`` with ``sum = x + residual`` and ``normed = rms_norm(sum) * weight``, in
    one pass; backward adds the gradient reaching ``sum`` directly into the norm's backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, total, rstd = ops().rms_norm_fwd(_rows(x), _rows(residual), weight.contiguous(), eps)
        ctx.save_for_backward(total, weight, rstd)
        return out.view(x.shape), total.view(x.shape)

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor | None, grad_sum: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        total, weight, rstd = ctx.saved_tensors
        if grad_out is None:  # only the sum is used: the norm adds nothing
            return grad_sum, grad_sum, None, None
        grad_x, grad_w = ops().rms_norm_bwd(
            _rows(grad_out),
            None if grad_sum is None else _rows(grad_sum),
            total,
            weight,
            rstd,
            ctx.needs_input_grad[2],
        )
        grad_x = grad_x.view(grad_out.shape)
        grad_weight = grad_w.to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_x, grad_weight, None


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class CsrcRope(torch.autograd.Function):
    """RoPE of ``q[B, S, G, R, D]`` and ``k[B, S, G2, R2, D]`` in one kernel from float32
    ``cos``/``sin[P, D/2]`` at positions ``offset + s``; backward rotates back."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        offset: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q_out, k_out = ops().rope_fwd(
            _last_dim_dense(q), _last_dim_dense(k), cos, sin, offset, False
        )
        ctx.save_for_backward(cos, sin)
        ctx.offset = offset
        return q_out, k_out

    @staticmethod
    def backward(
        ctx: Any, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        if grad_q is not None and grad_k is not None:
            back_q, back_k = ops().rope_fwd(
                _last_dim_dense(grad_q), _last_dim_dense(grad_k), cos, sin, ctx.offset, True
            )
        else:  # one output unused: rotate back the other alone
            back_q, back_k = (
                None
                if grad is None
                else ops().rope_fwd(_last_dim_dense(grad), None, cos, sin, ctx.offset, True)[0]
                for grad in (grad_q, grad_k)
            )
        return back_q, back_k, None, None, None


def check_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int
) -> None:
    """One-line errors for arguments no RoPE implementation takes."""
    op = "rope"
    check_float(op, "q", q)
    check_float(op, "k", k)
    check_shape(
        op,
        q.dim() == 5 and k.dim() == 5,
        f"q and k must be [B, S, G, R, D], got {tuple(q.shape)} and {tuple(k.shape)}",
    )
    check_shape(
        op,
        q.shape[:2] == k.shape[:2] and q.shape[-1] == k.shape[-1] and q.dtype == k.dtype,
        f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} "
        "must share B, S, D and dtype",
    )
    half = q.shape[-1] // 2
    check_shape(op, q.shape[-1] % 2 == 0, f"the head dimension must be even, got {q.shape[-1]}")
    check_shape(
        op,
        cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == half,
        f"cos and sin must be [P, D/2 = {half}], got {tuple(cos.shape)} and {tuple(sin.shape)}",
    )
    check_shape(
        op,
        offset >= 0 and offset + q.shape[1] <= cos.shape[0],
        f"positions [{offset}, {offset + q.shape[1]}) must lie in the tables' {cos.shape[0]}",
    )


def _readable_rows(t: torch.Tensor) -> torch.Tensor:
    """``t [..., F]`` as rows ``[N, F]`` the swiglu ops read without a copy where they can: a
    view when the rows are evenly spaced with stride 1 along ``F`` (a contiguous tensor, or a
    column slice of one such as half of a fused ``[N, 2F]`` projection), else a contiguous
    copy. Empty tensors pass as they are."""
    if t.numel() == 0:
        return t
    rows = t.reshape(-1, t.shape[-1])  # a view where the leading dimensions collapse
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


class CsrcSwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` for ``gate``, ``up [..., F]`` of one dtype; saves only ``gate`` and
    ``up`` (backward recomputes silu inside ``swiglu_bwd``). Outputs and input gradients are
    contiguous, in the inputs' dtype."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = ops().swiglu_fwd(_readable_rows(gate), _readable_rows(up))
        ctx.save_for_backward(gate, up)
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = ops().swiglu_bwd(
            _readable_rows(grad), _readable_rows(gate), _readable_rows(up)
        )
        return grad_gate.view(gate.shape), grad_up.view(gate.shape)


def check_swiglu(gate: torch.Tensor, up: torch.Tensor) -> None:
    """One-line errors for arguments no SwiGLU implementation takes: float dtypes (they may
    differ: the product promotes), one shape, one device."""
    op = "swiglu"
    check_float(op, "gate", gate)
    check_float(op, "up", up)
    check_shape(
        op,
        gate.shape == up.shape and gate.dim() >= 1,
        f"gate and up must have one shape [..., F], got {tuple(gate.shape)} and {tuple(up.shape)}",
    )
    check_shape(
        op,
        gate.device == up.device,
        f"gate and up must be on one device, got {gate.device} and {up.device}",
    )


def check_logits(op: str, logits: torch.Tensor, labels: torch.Tensor) -> None:
    """One-line errors for a cross-entropy chunk no implementation takes."""
    check_float(op, "logits", logits)
    check_shape(op, logits.dim() == 2, f"logits must be [N, V], got {tuple(logits.shape)}")
    check_shape(
        op,
        labels.dtype == torch.int64 and labels.shape == logits.shape[:1],
        f"labels must be int64 [N = {logits.shape[0]}], got {labels.dtype} {tuple(labels.shape)}",
    )


def cross_entropy_stats(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(max, sum_exp, target)`` float32 ``[N]`` of a logits chunk ``[N, V]`` whose columns are
    token ids ``[vocab_start, vocab_start + V)`` (target 0 where the label is elsewhere)."""
    check_logits("cross_entropy_stats", logits, labels)
    return ops().cross_entropy_stats(_last_dim_dense(logits), labels.contiguous(), vocab_start)


def cross_entropy_grad_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """In place: ``logits <- (softmax about lse - onehot) * scale``; returns ``logits``."""
    check_logits("cross_entropy_grad_", logits, labels)
    check_shape(
        "cross_entropy_grad_", logits.stride(-1) == 1, "logits must have unit column stride"
    )
    ops().cross_entropy_grad_(
        logits, labels.contiguous(), vocab_start, lse.float().contiguous(), _scale(scale)
    )
    return logits


def cross_entropy_fused_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int = 0,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 loss ``[N]`` of whole-vocabulary rows; the gradient is written into ``logits``."""
    check_logits("cross_entropy_fused_", logits, labels)
    check_shape(
        "cross_entropy_fused_", logits.stride(-1) == 1, "logits must have unit column stride"
    )
    return ops().cross_entropy_fused_(logits, labels.contiguous(), vocab_start, _scale(scale))


def _scale(scale: torch.Tensor | None) -> torch.Tensor | None:
    return None if scale is None else scale.float().contiguous()
