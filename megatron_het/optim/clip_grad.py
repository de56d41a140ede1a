"""Global-norm gradient clipping that reports the norm measured before clipping.

The single-process entry point is :func:`clip_grad_norm`. Sharded runs use its pieces:
:func:`tensors_norm_squared` on the gradient elements a rank is responsible for, a sum of those
squares across ranks, then :func:`clip_coefficient` and :func:`scale_` with the same coefficient
on every rank (see :mod:`megatron_het.optim.parallel_optimizer`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

# Added to the norm before dividing, as Megatron-LM and torch do, so a zero norm never divides.
_EPS = 1.0e-6


def tensors_norm_squared(
    tensors: Sequence[torch.Tensor], device: torch.device | None = None
) -> torch.Tensor:
    """Sum of squared entries of ``tensors`` as a float32 scalar.

    The scalar lives on the tensors' device, or on ``device`` (default CPU) when ``tensors`` is
    empty, so a rank without any counted element can still join the cross-rank sum.
    """
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(tensors, 2.0)
    return torch.stack([n.float() for n in norms]).square().sum()


def grad_norm_squared(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradient entries over ``parameters`` (float32 scalar on the grads' device).

    Parameters without a gradient are skipped. This is the local part of the global norm: a
    sharded run sums it across the ranks holding different shards before taking the square root.
    """
    return tensors_norm_squared([p.grad for p in parameters if p.grad is not None])


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor gradients are multiplied by: ``max_norm / (total_norm + 1e-6)`` when that is
    below 1, else 1.0 (also 1.0 when ``max_norm <= 0`` or the norm is not finite)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + _EPS))


def scale_(tensors: Sequence[torch.Tensor], coefficient: float) -> None:
    """Multiply every tensor in place by ``coefficient`` (nothing happens when it is 1.0)."""
    tensors = [t for t in tensors if t.numel() > 0]
    if coefficient != 1.0 and tensors:
        torch._foreach_mul_(tensors, coefficient)


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    reduce_squared: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Scale all gradients in place so their global L2 norm is at most ``max_norm``.

    Returns the norm BEFORE clipping (what training logs report). ``max_norm <= 0`` only
    measures. ``reduce_squared`` (optional) turns the local squared norm into the global one, e.g.
    a sum over tensor/pipeline-parallel ranks; a single process passes nothing. Non-finite norms
    are returned as is and leave the gradients untouched.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    squared = tensors_norm_squared(grads)  # grad_norm_squared of the parameters
    if reduce_squared is not None:
        squared = reduce_squared(squared)
    total_norm = float(squared.sqrt())
    scale_(grads, clip_coefficient(total_norm, max_norm))
    return total_norm
