"""Fused output projection + cross-entropy that never holds the full ``[N, V]`` logits.

Tokens are processed in chunks: each chunk's logits are computed, turned into its loss and,
when gradients are needed, straight into the gradients of the hidden states and of the output
weight, then dropped. Peak extra memory is one chunk of logits instead of all of them (the
logits of a 128k vocabulary dominate activation memory otherwise), and the softmax gradient is
formed in place instead of by separate log-softmax and NLL backward passes.

Precision: GEMM operands are in the compute dtype (the autocast dtype, else the inputs'),
logits, softmax and loss in float32, and the weight gradient is summed over chunks in float32
(:mod:`megatron_het.kernels.gemm`); the token weights enter both gradients as a float32 scale
applied at the end (:func:`split_token_weights`), so with the default mean loss the only
rounding is that of the softmax gradient to the operand dtype. The hidden gradient is kept
unscaled (the weights' 0/1 units only) and multiplied by that scale and the incoming gradient
in backward, in float32 for fp16: a mean over thousands of tokens would otherwise push it into
fp16's subnormals before the loss scale reaches it, and a loss scale over 65504 rounded to
fp16 is infinite. That float32 gradient is never rounded to a bf16
weight's dtype: when the weight carries a ``main_grad`` (:mod:`megatron_het.kernels.main_grad`),
backward adds it, times the incoming scale, into ``main_grad`` and returns no gradient for the
weight; otherwise the gradient goes to autograd in the weight's dtype, as for any layer.

Chunks hold a fixed number of BYTES of float32 logits (:func:`default_chunk_tokens`), so the
GEMMs keep a useful M whatever the vocabulary. The chunk loop does no host synchronisation: no
boolean-mask indexing, no ``.item()``, no data-dependent shapes.

Where liger-kernel is installed, a CUDA head with the default mean loss and a weight without a
``main_grad`` runs liger's fused linear cross-entropy instead (it rounds the weight gradient
to the weight's dtype, so a ``main_grad`` weight keeps ours).

Shape legend: N tokens, Nc tokens of a chunk, H hidden, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_het.kernels.autocast import autocast_dtype, autocast_off
from megatron_het.kernels.csrc_ops import cross_entropy_fused_, cross_entropy_stats
from megatron_het.kernels.extension import EXTENSION, KernelExtension
from megatron_het.kernels.gemm import addmm_fp32_out_, gemm_operand_dtype, mm_fp32_out
from megatron_het.kernels.liger import LIGER, LigerKernels
from megatron_het.kernels.main_grad import add_to_main_grad, has_main_grad
from megatron_het.kernels.selection import ALL_FUSED, KernelChoice

IGNORE_INDEX = -100

# Chunk budgets, in bytes of float32 logits (4 bytes per logit). On an accelerator a chunk's
# tokens are the M of the three GEMMs of the head (logits, and the two gradient products):
# 256 MiB gives M = 2048 at a 32k vocabulary and 512 at 128k, enough for full tensor-core
# tiles, while the chunk's transient memory (its float32 logits and a low-precision copy of the
# softmax gradient, ~1.5x the budget) stays small next to a layer's activations.
CHUNK_LOGIT_BYTES_ACCELERATOR = 256 << 20
# On CPU the chunk is written by the GEMM and read back by the softmax passes and both gradient
# GEMMs, so it should stay in the last-level cache: 8 MiB does on typical hosts (L3 of 16 MB and
# more) and still gives M = 64 at a 32k vocabulary.
CHUNK_LOGIT_BYTES_CPU = 8 << 20
# Chunks of at least this many tokens are rounded down to a multiple of it (whole GEMM tiles).
_TILE_TOKENS = 64


def default_chunk_tokens(vocab_rows: int, device_type: str) -> int:
    """Tokens per chunk so that a chunk's float32 logits ``[Nc, vocab_rows]`` fill the
    device's budget (:data:`CHUNK_LOGIT_BYTES_CPU` on CPU, else
    :data:`CHUNK_LOGIT_BYTES_ACCELERATOR`); ``vocab_rows`` is V, or one rank's Vr under TP."""
    budget = CHUNK_LOGIT_BYTES_CPU if device_type == "cpu" else CHUNK_LOGIT_BYTES_ACCELERATOR
    tokens = max(1, budget // (4 * max(1, vocab_rows)))
    return tokens - tokens % _TILE_TOKENS if tokens >= _TILE_TOKENS else tokens


@dataclasses.dataclass(frozen=True)
class HeadSettings:
    """How a fused head runs: ``chunk_tokens`` per chunk, which gradients autograd needs,
    ``compute_dtype`` (the autocast dtype when autocast is on, else the inputs' common dtype),
    and ``csrc_softmax``: each chunk's softmax, loss and gradient by our compiled kernels
    (``csrc/cross_entropy``) rather than torch's ops."""

    chunk_tokens: int
    hidden_grad: bool
    weight_grad: bool
    compute_dtype: torch.dtype
    csrc_softmax: bool = False

    @property
    def need_grads(self) -> bool:
        return self.hidden_grad or self.weight_grad


def use_csrc_cross_entropy(
    device_type: str, choice: KernelChoice = ALL_FUSED, extension: KernelExtension = EXTENSION
) -> bool:
    """Whether a head's softmax runs our compiled kernels now (eager mode only)."""
    return (
        choice.cross_entropy
        and not torch.compiler.is_compiling()
        and extension.supports("cross_entropy", device_type)
    )


def fused_head_settings(
    hidden: torch.Tensor,
    weight_VH: torch.Tensor,
    chunk_tokens: int | None = None,
    choice: KernelChoice = ALL_FUSED,
) -> HeadSettings:
    """:class:`HeadSettings` of a fused output layer + loss over the ``[V, H]`` (or one rank's
    ``[Vr, H]``) ``weight_VH``: ``chunk_tokens`` when given, else :func:`default_chunk_tokens`;
    the softmax by our kernels where ``choice`` allows and they are built for the device."""
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight_VH.shape[0], hidden.device.type)
    grad_on = torch.is_grad_enabled()
    compute_dtype = autocast_dtype(hidden.device.type) or torch.promote_types(
        hidden.dtype, weight_VH.dtype
    )
    return HeadSettings(
        max(1, chunk_tokens),
        grad_on and hidden.requires_grad,
        grad_on and weight_VH.requires_grad,
        compute_dtype,
        use_csrc_cross_entropy(hidden.device.type, choice),
    )


def head_operands(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, settings: HeadSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` and ``weight`` in the dtype the head's GEMMs take (see
    :func:`~megatron_het.kernels.gemm.gemm_operand_dtype`)."""
    dtype = gemm_operand_dtype(settings.compute_dtype, hidden_NH.device)
    return hidden_NH.to(dtype), weight_VH.to(dtype)


def chunk_logits(h_NcH: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
    """Float32 logits ``[Nc, V]`` of one chunk (operands from :func:`head_operands`)."""
    return mm_fp32_out(h_NcH, weight_VH.t())


def split_token_weights(weights_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, unit_N)`` with ``weights_N == scale * unit_N``, ``scale = max |weights_N|``
    (a float32 0-dim tensor; 1 when every weight is 0).

    The weight gradient is ``scale * sum_i unit_i * dlogits_i^T h_i``: the GEMM operand is
    ``h * unit``, which for the usual weights (a loss mask over a token count) is ``h`` or 0,
    exact in bf16, and ``scale`` is applied once in float32 at the end. Rounding ``h * w`` to
    bf16 instead would add an error of the size of rounding the whole gradient."""
    scale = weights_N.abs().amax()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, weights_N / scale


def project_logit_grads(
    dlogits_NcV: torch.Tensor,
    h_NcH: torch.Tensor,
    weight_VH: torch.Tensor,
    units_Nc: torch.Tensor,
    grad_hidden_NcH: torch.Tensor | None,
    grad_weight_VH: torch.Tensor | None,
) -> None:
    """From one chunk's float32 ``d CE_i / d logits`` (unweighted), write the chunk's hidden
    gradient into ``grad_hidden_NcH`` and add its weight gradient into the float32
    ``grad_weight_VH``, both scaled by the unit weights of :func:`split_token_weights` (the
    scale is applied later: :func:`head_backward` for the hidden gradient, the caller at the
    end for the weight's). Either output may be None."""
    dlogits = dlogits_NcV.to(weight_VH.dtype)
    # Token weights scale the thin [Nc, H] operands, not the [Nc, V] logits.
    if grad_hidden_NcH is not None:
        grad_hidden_NcH.copy_(mm_fp32_out(dlogits, weight_VH) * units_Nc[:, None])
    if grad_weight_VH is not None:
        scaled_h = (h_NcH * units_Nc[:, None]).to(h_NcH.dtype)
        addmm_fp32_out_(grad_weight_VH, dlogits.t(), scaled_h)


def save_head_grads(
    ctx: Any,
    hidden: torch.Tensor,
    weight_VH: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight_fp32: torch.Tensor | None,
    hidden_scale: torch.Tensor,
) -> None:
    """Keep a head's gradients for :func:`head_backward`: the hidden gradient, still to be
    multiplied by the float32 ``hidden_scale``, in ``hidden``'s dtype; the weight gradient in
    float32 when ``weight_VH`` has a ``main_grad`` (it is added there in backward), else in the
    weight's dtype."""
    ctx.main_grad_weight, ctx.hidden_scale = None, hidden_scale
    if grad_weight_fp32 is not None and has_main_grad(weight_VH):
        ctx.main_grad_weight = weight_VH
    elif grad_weight_fp32 is not None:
        grad_weight_fp32 = grad_weight_fp32.to(weight_VH.dtype)
    ctx.save_for_backward(
        None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight_fp32
    )


def head_backward(
    ctx: Any, grad_total: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_hidden, grad_weight)`` of a head whose gradients :func:`save_head_grads` kept,
    scaled by ``grad_total``; a ``main_grad`` weight gets its float32 gradient added into
    ``main_grad`` here (the optimizer is notified) and None is returned for it."""
    grad_hidden, grad_weight = ctx.saved_tensors
    if grad_hidden is not None:
        factor = ctx.hidden_scale * grad_total.float()
        if grad_hidden.dtype == torch.float16:  # the factor may exceed fp16's range
            grad_hidden = (grad_hidden.float() * factor).to(torch.float16)
        else:
            grad_hidden = grad_hidden * factor.to(grad_hidden.dtype)
    if grad_weight is None:
        return grad_hidden, None
    weight = ctx.main_grad_weight
    if weight is None:
        return grad_hidden, grad_weight * grad_total.to(grad_weight.dtype)
    # In place: the float32 [V, H] gradient is not needed again (a second backward through
    # the same graph fails autograd's saved-tensor version check instead of double-counting).
    scaled = grad_weight.mul_(grad_total.float())
    if add_to_main_grad(weight, scaled):
        return grad_hidden, None
    return grad_hidden, scaled.to(weight.dtype)  # main_grad was removed since forward


def _run_chunks(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_N: torch.Tensor,
    weights_N: torch.Tensor,
    settings: HeadSettings,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(grad_hidden, grad_weight float32, loss, scale)`` of the single-rank head; grads None
    where not needed; ``grad_hidden`` still to be multiplied by ``scale``."""
    h_all, weight = head_operands(hidden_NH, weight_VH, settings)
    N, chunk = h_all.shape[0], settings.chunk_tokens
    total = torch.zeros((), dtype=torch.float32, device=h_all.device)
    grad_hidden = torch.empty_like(hidden_NH) if settings.hidden_grad else None
    grad_weight = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if settings.weight_grad
        else None
    )
    minus_one = torch.full((min(chunk, N), 1), -1.0, dtype=torch.float32, device=h_all.device)
    scale, units_N = split_token_weights(weights_N)
    for start in range(0, N, chunk):
        part = slice(start, start + chunk)
        h, y, w = h_all[part], labels_N[part, None], weights_N[part]
        logits = chunk_logits(h, weight)  # float32 [Nc, V]
        if settings.csrc_softmax:
            total += (_csrc_chunk_loss(logits, labels_N[part], settings.need_grads) * w).sum()
            if settings.need_grads:  # the logits now hold softmax - onehot
                project_logit_grads(
                    logits,
                    h,
                    weight,
                    units_N[part],
                    None if grad_hidden is None else grad_hidden[part],
                    grad_weight,
                )
            continue
        target = logits.gather(1, y)
        top = logits.amax(dim=-1, keepdim=True)
        # One exp pass, in place of the logits, serves both the loss and the softmax:
        # lse - target = log(sum(exp(logits - top))) + top - target.
        exps = logits.sub_(top).exp_()
        sum_exp = exps.sum(dim=-1, keepdim=True)
        total += ((sum_exp.log() + (top - target)).squeeze(1) * w).sum()
        if settings.need_grads:
            probs = exps.div_(sum_exp)  # softmax
            probs.scatter_add_(1, y, minus_one[: h.shape[0]].to(probs.dtype))  # minus one-hot
            project_logit_grads(
                probs,
                h,
                weight,
                units_N[part],
                None if grad_hidden is None else grad_hidden[part],
                grad_weight,
            )
    if grad_weight is not None:
        grad_weight.mul_(scale)
    return grad_hidden, grad_weight, total, scale


def _csrc_chunk_loss(logits: torch.Tensor, labels: torch.Tensor, grads: bool) -> torch.Tensor:
    """Float32 per-token loss of whole-vocabulary float32 logits by our kernels; with
    ``grads`` the logits are replaced by ``softmax - onehot`` in the same call."""
    if grads:
        return cross_entropy_fused_(logits, labels)
    top, sum_exp, target = cross_entropy_stats(logits, labels, 0)
    return sum_exp.log() + top - target


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, when asked, both gradients; backward only scales them."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        labels_N: torch.Tensor,
        weights_N: torch.Tensor,
        settings: HeadSettings,
    ) -> torch.Tensor:
        with autocast_off(hidden_NH.device.type):
            grad_hidden, grad_weight, total, scale = _run_chunks(
                hidden_NH, weight_VH, labels_N, weights_N, settings
            )
        save_head_grads(ctx, hidden_NH, weight_VH, grad_hidden, grad_weight, scale)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*head_backward(ctx, grad_total), None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight_VH: torch.Tensor,
    labels: torch.Tensor,
    loss_weights: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    liger: LigerKernels | None = None,
    choice: KernelChoice = ALL_FUSED,
) -> torch.Tensor:
    """``sum_i loss_weights[i] * CE(hidden[i] @ weight.T, labels[i])`` as a float32 scalar.

    Args:
        hidden: ``[..., H]`` final (normed) hidden states.
        weight_VH: ``[V, H]`` output projection.
        labels: ``[...]`` target ids; ``IGNORE_INDEX`` (-100) marks tokens without a loss.
        loss_weights: ``[...]`` per-token weights (a loss mask divided by the token count, for
            instance). Default: the mean over tokens whose label is not ignored.
        chunk_tokens: tokens per chunk; default :func:`default_chunk_tokens`.
        liger: replaces the installed liger kernels (tests inject fakes).
        choice: the fused kernels allowed (each chunk's softmax by our compiled kernel where
            built for the device; liger's whole head where installed and allowed).

    Gradients of ``hidden`` and ``weight_VH`` are computed during the forward pass (only those
    autograd needs) and kept until backward, so this costs no extra GEMM over the unfused
    computation. See the module docstring for precision and ``main_grad``. Matches
    ``F.cross_entropy`` on the full logits within float rounding. No host synchronisation.
    """
    fused = (
        _liger_head(hidden, weight_VH, loss_weights, chunk_tokens, liger)
        if choice.cross_entropy and choice.libraries
        else None
    )
    if fused is not None:
        return fused(hidden.reshape(-1, hidden.shape[-1]), weight_VH, labels.reshape(-1))
    hidden_NH = hidden.reshape(-1, hidden.shape[-1])
    labels_N = labels.reshape(-1)
    weights_N = token_loss_weights(labels_N, loss_weights)
    labels_N = torch.where(labels_N != IGNORE_INDEX, labels_N, 0)
    settings = fused_head_settings(hidden, weight_VH, chunk_tokens, choice)
    return _LinearCrossEntropy.apply(hidden_NH, weight_VH, labels_N, weights_N, settings)


def _liger_head(
    hidden: torch.Tensor,
    weight_VH: torch.Tensor,
    loss_weights: torch.Tensor | None,
    chunk_tokens: int | None,
    liger: LigerKernels | None,
) -> Any | None:
    """liger's fused linear cross-entropy when it may stand in for ours: installed, on its
    device, the default mean loss, no chunk override and no ``main_grad`` on the weight."""
    kernels = LIGER if liger is None else liger
    if (
        loss_weights is not None
        or chunk_tokens is not None
        or has_main_grad(weight_VH)
        or not kernels.usable(kernels.linear_cross_entropy, hidden.device.type)
    ):
        return None
    return kernels.linear_cross_entropy


def token_loss_weights(
    labels_N: torch.Tensor, loss_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Float32 ``[N]`` weight of each token's loss: ``loss_weights`` (any shape of ``N``
    elements), else the mean over tokens; 0 where ``labels_N`` is ``IGNORE_INDEX``."""
    keep = labels_N != IGNORE_INDEX
    if loss_weights is None:
        return keep.float() / keep.sum().clamp(min=1)
    return loss_weights.reshape(-1).float() * keep
