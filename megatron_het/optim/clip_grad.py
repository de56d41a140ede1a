"""Global-norm gradient clipping that reports the norm measured before clipping."""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

# Added to the norm before dividing, as Megatron-LM and torch do, so a zero norm never divides.
_EPS = 1.0e-6


def grad_norm_squared(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradient entries over ``parameters`` (float32 scalar on the grads' device).

    Parameters without a gradient are skipped. This is the local part of the global norm: a
    sharded run sums it across the ranks holding different shards before taking the square root.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(grads, 2.0)
    return torch.stack([n.float() for n in norms]).square().sum()


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float,
                   reduce_squared: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                   ) -> float:
    """Scale all gradients in place so their global L2 norm is at most ``max_norm``.

    Returns the norm BEFORE clipping (what training logs report). ``max_norm <= 0`` only
    measures. ``reduce_squared`` (optional) turns the local squared norm into the global one, e.g.
    a sum over tensor/pipeline-parallel ranks; a single process passes nothing. Non-finite norms
    are returned as is and leave the gradients untouched.
    """
    params = [p for p in parameters if p.grad is not None]
    squared = grad_norm_squared(params)
    if reduce_squared is not None:
        squared = reduce_squared(squared)
    total_norm = float(squared.sqrt())
    if max_norm > 0 and total_norm == total_norm and total_norm != float("inf"):
        clip_coeff = max_norm / (total_norm + _EPS)
        if clip_coeff < 1.0:
            torch._foreach_mul_([p.grad for p in params], clip_coeff)
    return total_norm
