"""Cross-entropy and logits over a vocabulary split across a tensor-parallel group.

Rank r holds logits for token ids ``[vocab_start, vocab_start + Vr)`` only. The loss needs the
log-sum-exp over the whole vocabulary and the target's logit, which come from two all-reduces of
per-token statistics (never of logits): the max over ranks of each rank's local max, then the sum
of each rank's ``sum(exp(logit - local max))`` rescaled to the global max together with the
target logit (zero on ranks that do not hold the target). All of it runs in float32.

Labels equal to -100 (``IGNORE_INDEX``) carry no loss and no gradient, as in ``F.cross_entropy``.
Nothing here synchronises with the host: the target is found by masked arithmetic, gather and
scatter (no boolean-mask indexing, no ``.item()``, no data-dependent shapes), so the only waits
are the collectives themselves.

Shape legend: N tokens, H hidden, V vocabulary, Vr this rank's vocabulary rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from megatron_het.kernels.autocast import autocast_off
from megatron_het.kernels.csrc_ops import cross_entropy_grad_, cross_entropy_stats
from megatron_het.kernels.selection import ALL_FUSED, KernelChoice
from megatron_het.model.loss import (
    IGNORE_INDEX,
    HeadSettings,
    chunk_logits,
    fused_head_settings,
    head_backward,
    head_operands,
    project_logit_grads,
    save_head_grads,
    split_token_weights,
    token_loss_weights,
)
from megatron_het.tensor_parallel.mappings import copy_to_tp, gather_from_tp
from megatron_het.tensor_parallel.tp_group import TPGroup


def _local_stats(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, vocab_start: int, csrc: bool = False
) -> tuple[torch.Tensor, ...]:
    """``(max, sumexp about max, target logit or 0, holds target, local label)`` per token;
    ``csrc``: the first three in one pass of our compiled kernel."""
    local = labels_N - vocab_start
    here = (local >= 0) & (local < logits_NV.shape[-1])
    local = torch.where(here, local, 0)
    if csrc:
        return (*cross_entropy_stats(logits_NV, labels_N, vocab_start), here, local)
    logits_NV = logits_NV.float()
    local_max = logits_NV.max(dim=-1).values
    sum_exp = torch.exp(logits_NV - local_max[:, None]).sum(dim=-1)
    target = logits_NV.gather(1, local[:, None]).squeeze(1) * here
    return local_max, sum_exp, target, here, local


def _global_lse(
    local_max: torch.Tensor, sum_exp: torch.Tensor, target: torch.Tensor, group: TPGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp over the whole vocabulary, target logit)`` per token; two all-reduces."""
    global_max = local_max.clone()
    group.all_reduce(global_max, op="max")
    both = torch.stack((sum_exp * torch.exp(local_max - global_max), target))
    group.all_reduce(both, op="sum")
    return global_max + torch.log(both[0]), both[1]


def _softmax_minus_onehot(
    logits_NV: torch.Tensor, lse_N: torch.Tensor, here_N: torch.Tensor, local_N: torch.Tensor
) -> torch.Tensor:
    """``d CE / d logits`` for this rank's columns, float32 ``[N, Vr]``.

    The one-hot is subtracted by a scatter of ``-here`` (0 on ranks without the target,
    whose ``local`` is a dummy 0), not by boolean-mask indexing, which would synchronise with
    the host to size its result."""
    grad = torch.exp(logits_NV.float() - lse_N[:, None])
    grad.scatter_add_(1, local_N[:, None], -here_N[:, None].to(grad.dtype))
    return grad


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits_NV: torch.Tensor,
        labels_N: torch.Tensor,
        group: TPGroup,
        vocab_start: int,
    ) -> torch.Tensor:
        local_max, sum_exp, target, here, local = _local_stats(logits_NV, labels_N, vocab_start)
        lse, target = _global_lse(local_max, sum_exp, target, group)
        valid = labels_N != IGNORE_INDEX
        ctx.save_for_backward(logits_NV, lse, here, local, valid)
        return (lse - target) * valid

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits_NV, lse, here, local, valid = ctx.saved_tensors
        grad = _softmax_minus_onehot(logits_NV, lse, here, local)
        grad *= (grad_loss.float() * valid)[:, None]
        return grad.to(logits_NV.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group: TPGroup, vocab_start: int
) -> torch.Tensor:
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
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), group, vocab_start
    )
    return loss.view(shape)


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, when asked, both gradients; backward only scales them."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        labels_N: torch.Tensor,
        weights_N: torch.Tensor,
        group: TPGroup,
        vocab_start: int,
        settings: HeadSettings,
    ) -> torch.Tensor:
        with autocast_off(hidden_NH.device.type):
            hidden, weight = head_operands(hidden_NH, weight_VH, settings)
            chunk = settings.chunk_tokens
            stats, kept = [], []
            for start in range(0, hidden.shape[0], chunk):
                logits = chunk_logits(hidden[start : start + chunk], weight)  # float32
                labels = labels_N[start : start + chunk]
                stats.append(_local_stats(logits, labels, vocab_start, settings.csrc_softmax))
                if settings.need_grads:  # reused for the gradients once the global lse is known
                    # About the row's local max, where a bf16 copy is exact near the top
                    # logits (which carry the probability) whatever the logits' size.
                    kept.append(logits.sub_(stats[-1][0][:, None]).to(hidden.dtype))
            local_max, sum_exp, target, here, local = (torch.cat(s) for s in zip(*stats))
            lse, target = _global_lse(local_max, sum_exp, target, group)
            total = ((lse - target) * weights_N).sum()
            scale, units_N = split_token_weights(weights_N)
            grad_hidden, grad_weight = (
                _head_grads(
                    kept,
                    hidden,
                    weight,
                    units_N,
                    scale,
                    lse - local_max,
                    (here, local, labels_N, vocab_start),
                    settings,
                )
                if settings.need_grads
                else (None, None)
            )
        save_head_grads(ctx, hidden_NH, weight_VH, grad_hidden, grad_weight, scale)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*head_backward(ctx, grad_total), None, None, None, None, None)


def _head_grads(
    kept: Sequence[torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    units_N: torch.Tensor,
    scale: torch.Tensor,
    lse: torch.Tensor,
    targets: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
    settings: HeadSettings,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_hidden [N, H] partial over this rank's vocabulary, still to be multiplied by
    ``scale``; grad_weight [Vr, H] fp32)`` from the ``kept`` logits (each row about its local
    max, with ``lse`` about that max too; see :func:`split_token_weights` for ``units_N`` and
    ``scale``); None for a gradient autograd does not need. ``targets``: (holds target,
    local label, labels, vocab_start) per token. Our kernel writes each chunk's softmax
    gradient in place of its kept logits."""
    here, local, labels_N, vocab_start = targets
    grad_hidden = torch.empty_like(hidden) if settings.hidden_grad else None
    grad_weight = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if settings.weight_grad
        else None
    )
    chunk = settings.chunk_tokens
    for i, logits in enumerate(kept):
        part = slice(i * chunk, i * chunk + logits.shape[0])
        if settings.csrc_softmax:
            dlogits = cross_entropy_grad_(logits, labels_N[part], vocab_start, lse[part])
        else:
            dlogits = _softmax_minus_onehot(logits, lse[part], here[part], local[part])
        project_logit_grads(
            dlogits,
            hidden[part],
            weight,
            units_N[part],
            None if grad_hidden is None else grad_hidden[part],
            grad_weight,
        )
    if grad_weight is not None:
        grad_weight.mul_(scale)
    return grad_hidden, grad_weight


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight_VH: torch.Tensor,
    labels: torch.Tensor,
    group: TPGroup,
    vocab_start: int,
    loss_weights: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    copy_input: bool = True,
    choice: KernelChoice = ALL_FUSED,
) -> torch.Tensor:
    """``sum_i loss_weights[i] * CE(hidden[i] @ W.T, labels[i])`` with W split by vocabulary.

    Args:
        hidden: ``[..., H]`` final (normed) hidden states, replicated over ``group``.
        weight_VH: this rank's rows ``[Vr, H]`` of the output projection (token ids
            ``[vocab_start, vocab_start + Vr)``).
        labels: ``[...]`` target ids, -100 for no loss.
        group: the tensor-parallel group.
        vocab_start: first token id of this rank's rows.
        loss_weights: ``[...]`` per-token weights; default the mean over non-ignored tokens.
        chunk_tokens: tokens per GEMM chunk; default
            :func:`~megatron_het.model.loss.default_chunk_tokens` of ``Vr``.
        copy_input: pass ``hidden`` through :func:`copy_to_tp` (off when the caller's own op
            sums the hidden gradient over ``group``, as the sequence-parallel gather does).
        choice: the fused kernels allowed (each chunk's statistics and softmax gradient by our
            compiled kernels where built for the device).

    Returns the float32 scalar loss, equal on every rank to the single-process
    :func:`~megatron_het.model.loss.linear_cross_entropy`. No rank ever holds full-vocabulary
    logits: each computes its ``[N, Vr]`` columns chunk by chunk in float32 and keeps them (in
    the GEMM operand dtype, bf16 in a bf16 run on an accelerator, when gradients are needed)
    only until the gradients are formed at the end of forward. Precision and ``main_grad``
    handling are those of the single-process head; no host synchronisation. Communication: two
    all-reduces of ``[N]``/``[2, N]`` float32 in forward, and in backward the all-reduce of the
    ``[N, H]`` hidden gradient (the input passes through :func:`copy_to_tp`).
    """
    if copy_input:
        hidden = copy_to_tp(hidden, group)
    hidden_NH = hidden.reshape(-1, hidden.shape[-1])
    labels_N = labels.reshape(-1)
    weights_N = token_loss_weights(labels_N, loss_weights)
    settings = fused_head_settings(hidden, weight_VH, chunk_tokens, choice)
    return _VocabParallelLinearCrossEntropy.apply(
        hidden_NH, weight_VH, labels_N, weights_N, group, vocab_start, settings
    )


def gather_vocab_parallel_logits(
    logits: torch.Tensor, group: TPGroup, sizes: Sequence[int]
) -> torch.Tensor:
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
