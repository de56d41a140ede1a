"""Cross-entropy and logits over a vocabulary split across a tensor-parallel group.

Rank r holds logits for token ids ``[vocab_start, vocab_start + Vr)`` only. The loss needs the
log-sum-exp over the whole vocabulary and the target's logit, which come from two all-reduces of
per-token statistics (never of logits): the max over ranks of each rank's local max, then the sum
of each rank's ``sum(exp(logit - local max))`` rescaled to the global max together with the
target logit (zero on ranks that do not hold the target). All of it runs in float32.

Labels equal to -100 (``IGNORE_INDEX``) carry no loss and no gradient, as in ``F.cross_entropy``.

Shape legend: N tokens, H hidden, V vocabulary, Vr this rank's vocabulary rows.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from megatron_het.comm.groups import UnifiedGroup
from megatron_het.model.loss import IGNORE_INDEX, fused_head_settings, token_loss_weights
from megatron_het.tensor_parallel.mappings import copy_to_tp, gather_from_tp


def _local_stats(logits_NV: torch.Tensor, labels_N: torch.Tensor, vocab_start: int
                 ) -> tuple[torch.Tensor, ...]:
    """``(max, sumexp about max, target logit or 0, holds target, local label)`` per token."""
    logits_NV = logits_NV.float()
    local_max = logits_NV.max(dim=-1).values
    sum_exp = torch.exp(logits_NV - local_max[:, None]).sum(dim=-1)
    local = labels_N - vocab_start
    here = (local >= 0) & (local < logits_NV.shape[-1])
    local = torch.where(here, local, 0)
    target = logits_NV.gather(1, local[:, None]).squeeze(1) * here
    return local_max, sum_exp, target, here, local


def _global_lse(local_max: torch.Tensor, sum_exp: torch.Tensor, target: torch.Tensor,
                group: UnifiedGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp over the whole vocabulary, target logit)`` per token; two all-reduces."""
    global_max = local_max.clone()
    group.all_reduce(global_max, op="max")
    both = torch.stack((sum_exp * torch.exp(local_max - global_max), target))
    group.all_reduce(both, op="sum")
    return global_max + torch.log(both[0]), both[1]


def _softmax_minus_onehot(logits_NV: torch.Tensor, lse_N: torch.Tensor, here_N: torch.Tensor,
                          local_N: torch.Tensor) -> torch.Tensor:
    """``d CE / d logits`` for this rank's columns, float32 ``[N, Vr]``."""
    grad = torch.exp(logits_NV.float() - lse_N[:, None])
    rows = torch.arange(grad.shape[0], device=grad.device)
    grad[rows[here_N], local_N[here_N]] -= 1.0
    return grad


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits_NV: torch.Tensor, labels_N: torch.Tensor, group: UnifiedGroup,
                vocab_start: int) -> torch.Tensor:
        local_max, sum_exp, target, here, local = _local_stats(logits_NV, labels_N, vocab_start)
        lse, target = _global_lse(local_max, sum_exp, target, group)
        valid = labels_N != IGNORE_INDEX
        ctx.save_for_backward(logits_NV, lse, here, local, valid)
        return (lse - target) * valid

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        logits_NV, lse, here, local, valid = ctx.saved_tensors
        grad = _softmax_minus_onehot(logits_NV, lse, here, local)
        grad *= (grad_loss.float() * valid)[:, None]
        return grad.to(logits_NV.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                                 group: UnifiedGroup, vocab_start: int) -> torch.Tensor:
    """Per-token cross-entropy from vocabulary-sharded logits.

    Args:
        logits: ``[..., Vr]``, this rank's columns ``[vocab_start, vocab_start + Vr)``.
        labels: ``[...]`` global token ids (same on every rank), -100 for no loss.
        group: the tensor-parallel group (two all-reduces of ``[2, N]`` float32 in forward).
        vocab_start: first token id of this rank's columns.

    Returns float32 ``[...]``, equal on every rank to ``F.cross_entropy(full_logits, labels,
    reduction="none")`` (0 where the label is -100). The gradient of ``logits`` is this rank's
    columns of the single-process gradient; backward communicates nothing.
    """
    shape = labels.shape
    loss = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), group, vocab_start)
    return loss.view(shape)


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, when asked, both gradients; backward only scales them."""

    @staticmethod
    def forward(ctx: Any, hidden_NH: torch.Tensor, weight_VH: torch.Tensor,
                labels_N: torch.Tensor, weights_N: torch.Tensor, group: UnifiedGroup,
                vocab_start: int, chunk_tokens: int, need_grads: bool,
                compute_dtype: torch.dtype) -> torch.Tensor:
        with torch.autocast(hidden_NH.device.type, enabled=False):
            hidden = hidden_NH.to(compute_dtype)
            weight = weight_VH.to(compute_dtype)
            chunks = range(0, hidden.shape[0], chunk_tokens)
            stats, kept = [], []
            for start in chunks:
                logits = hidden[start:start + chunk_tokens] @ weight.t()
                stats.append(_local_stats(logits, labels_N[start:start + chunk_tokens],
                                          vocab_start))
                if need_grads:  # reused for the gradients once the global lse is known
                    kept.append(logits)
            local_max, sum_exp, target, here, local = (torch.cat(s) for s in zip(*stats))
            lse, target = _global_lse(local_max, sum_exp, target, group)
            total = ((lse - target) * weights_N).sum()
            if need_grads:
                grad_hidden, grad_weight = _head_grads(kept, hidden, weight, weights_N, lse,
                                                       here, local, chunk_tokens)
                ctx.save_for_backward(grad_hidden.to(hidden_NH.dtype),
                                      grad_weight.to(weight_VH.dtype))
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_total.to(grad_hidden.dtype),
                grad_weight * grad_total.to(grad_weight.dtype),
                None, None, None, None, None, None, None)


def _head_grads(kept: Sequence[torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor,
                weights_N: torch.Tensor, lse: torch.Tensor, here: torch.Tensor,
                local: torch.Tensor, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_hidden [N, H] partial over this rank's vocabulary, grad_weight [Vr, H] fp32)``."""
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for i, logits in enumerate(kept):
        part = slice(i * chunk_tokens, i * chunk_tokens + logits.shape[0])
        probs = _softmax_minus_onehot(logits, lse[part], here[part], local[part]).to(weight.dtype)
        w = weights_N[part, None].to(weight.dtype)
        # Token weights scale the thin [Nc, H] operands, not the [Nc, Vr] logits.
        grad_hidden[part] = (probs @ weight) * w
        grad_weight.add_(probs.t() @ (hidden[part] * w))
    return grad_hidden, grad_weight


def vocab_parallel_linear_cross_entropy(
        hidden: torch.Tensor, weight_VH: torch.Tensor, labels: torch.Tensor,
        group: UnifiedGroup, vocab_start: int, loss_weights: Optional[torch.Tensor] = None,
        chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """``sum_i loss_weights[i] * CE(hidden[i] @ W.T, labels[i])`` with W split by vocabulary.

    Args:
        hidden: ``[..., H]`` final (normed) hidden states, replicated over ``group``.
        weight_VH: this rank's rows ``[Vr, H]`` of the output projection (token ids
            ``[vocab_start, vocab_start + Vr)``).
        labels: ``[...]`` target ids, -100 for no loss.
        group: the tensor-parallel group.
        vocab_start: first token id of this rank's rows.
        loss_weights: ``[...]`` per-token weights; default the mean over non-ignored tokens.
        chunk_tokens: tokens per GEMM chunk; default keeps a chunk near 1M local logits.

    Returns the float32 scalar loss, equal on every rank to the single-process
    :func:`~megatron_het.model.loss.linear_cross_entropy`. No rank ever holds full-vocabulary
    logits: each computes its ``[N, Vr]`` columns chunk by chunk, keeping them (when gradients
    are needed) only until the gradients are formed at the end of forward. Communication: two
    all-reduces of ``[N]``/``[2, N]`` float32 in forward, and in backward the all-reduce of the
    ``[N, H]`` hidden gradient (the input passes through :func:`copy_to_tp`).
    """
    hidden = copy_to_tp(hidden, group)
    hidden_NH = hidden.reshape(-1, hidden.shape[-1])
    labels_N = labels.reshape(-1)
    weights_N = token_loss_weights(labels_N, loss_weights)
    chunk_tokens, need_grads, compute_dtype = fused_head_settings(hidden, weight_VH, chunk_tokens)
    return _VocabParallelLinearCrossEntropy.apply(
        hidden_NH, weight_VH, labels_N, weights_N, group, vocab_start, chunk_tokens, need_grads,
        compute_dtype)


def gather_vocab_parallel_logits(logits: torch.Tensor, group: UnifiedGroup,
                                 sizes: Sequence[int]) -> torch.Tensor:
    """``[..., Vr]`` per rank -> full ``[..., V]`` on every rank (differentiable).

    ``sizes[r]`` is rank r's column count (they may differ by one: the vocabulary is not
    padded). Uneven slices are padded to the largest for the all-gather and the padding is
    dropped afterwards; backward keeps this rank's columns of the gradient.
    """
    width = max(sizes)
    padded = F.pad(logits, (0, width - logits.shape[-1]))
    full = gather_from_tp(padded, group)
    if all(size == width for size in sizes):
        return full
    blocks = full.unflatten(-1, (len(sizes), width))
    return torch.cat([blocks[..., r, :size] for r, size in enumerate(sizes)], dim=-1)
