"""Fused output projection + cross-entropy that never holds the full ``[N, V]`` logits.

Tokens are processed in chunks: each chunk's logits are computed, turned into its loss and,
when gradients are needed, straight into the gradients of the hidden states and of the output
weight, then dropped. Peak extra memory is one chunk of logits instead of all of them (the
logits of a 128k vocabulary dominate activation memory otherwise), and the softmax gradient is
formed in place instead of by separate log-softmax and NLL backward passes.

Shape legend: N tokens, H hidden, V vocabulary.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

IGNORE_INDEX = -100

# About 1M logits (4 MB in float32) per chunk: large enough for efficient GEMMs, small enough
# to stay cache- and memory-friendly.
_CHUNK_LOGITS = 1 << 20


def _chunk_grads(logits: torch.Tensor, labels: torch.Tensor, hidden: torch.Tensor,
                 weights: torch.Tensor, weight_VH: torch.Tensor,
                 grad_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss of one chunk; softmax gradient formed in place of ``logits``.

    Returns ``(loss[Nc] float32, grad_hidden[Nc, H])`` and accumulates into ``grad_weight``.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    rows = torch.arange(labels.shape[0], device=labels.device)
    loss = -log_probs[rows, labels]
    probs = log_probs.exp_()
    probs[rows, labels] -= 1.0  # d(CE)/d(logits) = softmax - onehot
    probs = probs.to(weight_VH.dtype)
    # Scaling by the token weights is folded into the thin [Nc, H] operands, not the logits.
    grad_hidden = (probs @ weight_VH) * weights[:, None].to(weight_VH.dtype)
    scaled_hidden = hidden * weights[:, None].to(hidden.dtype)
    if grad_weight.dtype == probs.dtype:
        grad_weight.addmm_(probs.t(), scaled_hidden)
    else:  # low-precision GEMM, float32 accumulation across chunks
        grad_weight.add_(probs.t() @ scaled_hidden)
    return loss, grad_hidden


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, when asked, both gradients; backward only scales them."""

    @staticmethod
    def forward(ctx: Any, hidden_NH: torch.Tensor, weight_VH: torch.Tensor,
                labels_N: torch.Tensor, weights_N: torch.Tensor, chunk_tokens: int,
                need_grads: bool, compute_dtype: torch.dtype) -> torch.Tensor:
        with torch.autocast(hidden_NH.device.type, enabled=False):
            grad_hidden, grad_weight, total = _LinearCrossEntropy._run(
                hidden_NH.to(compute_dtype), weight_VH.to(compute_dtype), labels_N, weights_N,
                chunk_tokens, need_grads)
        if need_grads:
            ctx.save_for_backward(grad_hidden.to(hidden_NH.dtype),
                                  grad_weight.to(weight_VH.dtype))
        return total

    @staticmethod
    def _run(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor,
             weights_N: torch.Tensor, chunk_tokens: int, need_grads: bool
             ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]:
        """``(grad_hidden, grad_weight float32, loss)``; the grads are None without need_grads."""
        total = torch.zeros((), dtype=torch.float32, device=hidden_NH.device)
        grad_hidden = torch.empty_like(hidden_NH) if need_grads else None
        grad_weight = (torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device)
                       if need_grads else None)
        for start in range(0, hidden_NH.shape[0], chunk_tokens):
            h = hidden_NH[start:start + chunk_tokens]
            y = labels_N[start:start + chunk_tokens]
            w = weights_N[start:start + chunk_tokens]
            logits = h @ weight_VH.t()
            if need_grads:
                loss, grad_hidden[start:start + chunk_tokens] = _chunk_grads(
                    logits, y, h, w, weight_VH, grad_weight)
            else:
                loss = torch.logsumexp(logits.float(), dim=-1) - logits.gather(
                    1, y[:, None]).squeeze(1).float()
            total += (loss * w).sum()
        return grad_hidden, grad_weight, total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_total.to(grad_hidden.dtype),
                grad_weight * grad_total.to(grad_weight.dtype), None, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight_VH: torch.Tensor, labels: torch.Tensor,
                         loss_weights: Optional[torch.Tensor] = None,
                         chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """``sum_i loss_weights[i] * CE(hidden[i] @ weight.T, labels[i])`` as a float32 scalar.

    Args:
        hidden: ``[..., H]`` final (normed) hidden states.
        weight_VH: ``[V, H]`` output projection.
        labels: ``[...]`` target ids; ``IGNORE_INDEX`` (-100) marks tokens without a loss.
        loss_weights: ``[...]`` per-token weights (a loss mask divided by the token count, for
            instance). Default: the mean over tokens whose label is not ignored.
        chunk_tokens: tokens per chunk; default keeps a chunk near 1M logits.

    Gradients of ``hidden`` and ``weight_VH`` are computed during the forward pass (only when
    autograd needs them) and kept until backward, so this costs no extra GEMM over the unfused
    computation. GEMMs run in the autocast dtype when autocast is on (else in the inputs'
    common dtype); the softmax, the loss and the weight-gradient accumulation run in float32.
    Matches ``F.cross_entropy`` on the full logits within float rounding.
    """
    hidden_NH = hidden.reshape(-1, hidden.shape[-1])
    labels_N = labels.reshape(-1)
    weights_N = token_loss_weights(labels_N, loss_weights)
    labels_N = torch.where(labels_N != IGNORE_INDEX, labels_N, 0)
    chunk_tokens, need_grads, compute_dtype = fused_head_settings(hidden, weight_VH, chunk_tokens)
    return _LinearCrossEntropy.apply(hidden_NH, weight_VH, labels_N, weights_N, chunk_tokens,
                                     need_grads, compute_dtype)


def token_loss_weights(labels_N: torch.Tensor,
                       loss_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Float32 ``[N]`` weight of each token's loss: ``loss_weights`` (any shape of ``N``
    elements), else the mean over tokens; 0 where ``labels_N`` is ``IGNORE_INDEX``."""
    keep = labels_N != IGNORE_INDEX
    if loss_weights is None:
        return keep.float() / keep.sum().clamp(min=1)
    return loss_weights.reshape(-1).float() * keep


def fused_head_settings(hidden: torch.Tensor, weight_VH: torch.Tensor,
                        chunk_tokens: Optional[int] = None) -> tuple[int, bool, torch.dtype]:
    """``(chunk_tokens, need_grads, compute_dtype)`` of a fused output layer + loss over the
    ``[V, H]`` (or one rank's ``[Vr, H]``) ``weight_VH``: the given chunk, else about 1M logits
    per chunk; whether autograd needs the gradients; the autocast dtype when autocast is on,
    else the inputs' common dtype."""
    if chunk_tokens is None:
        chunk_tokens = max(1, _CHUNK_LOGITS // weight_VH.shape[0])
    need_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight_VH.requires_grad)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight_VH.dtype)
    return chunk_tokens, need_grads, compute_dtype
