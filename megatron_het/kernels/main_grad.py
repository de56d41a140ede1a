"""Float32 main gradients of low-precision parameters (Megatron's ``main_grad``).

Under bf16/fp16 training the optimizer gives every trainable low-precision parameter a
``main_grad`` attribute: a float32 tensor of the parameter's shape (a view of its gradient
bucket) into which the gradients of all micro-batches are accumulated. Ordinary layers leave
their bf16 gradient in ``param.grad`` and the optimizer's post-accumulate hook adds it into
``main_grad``. A kernel that computes a weight gradient in float32 anyway (the fused output layer
+ cross-entropy, for instance) should not round it to bf16 first: it calls
:func:`add_to_main_grad`, which adds the float32 gradient into ``main_grad`` directly and tells
the optimizer the parameter's gradient for this backward pass is in, and returns None as the
weight's gradient to autograd.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAIN_GRAD = "main_grad"
# Called (no arguments) after a kernel added a backward pass's gradient into main_grad.
ON_MAIN_GRAD_ADDED = "on_main_grad_added"


def has_main_grad(param: torch.Tensor) -> bool:
    """Whether ``param`` accumulates its gradient in a float32 ``main_grad``."""
    return getattr(param, MAIN_GRAD, None) is not None


def add_to_main_grad(param: torch.Tensor, grad: torch.Tensor) -> bool:
    """``param.main_grad += grad`` (in float32) and notify the optimizer; False, doing
    nothing, when ``param`` has no main gradient (the caller then returns ``grad`` to
    autograd as usual)."""
    main: torch.Tensor | None = getattr(param, MAIN_GRAD, None)
    if main is None:
        return False
    main.add_(grad)
    notify_main_grad_added(param)
    return True


def notify_main_grad_added(param: torch.Tensor) -> None:
    """Tell the optimizer (its ``ON_MAIN_GRAD_ADDED`` callback, where set) that a kernel added
    this backward pass's gradient of ``param`` into ``main_grad`` itself."""
    callback: Callable[[], None] | None = getattr(param, ON_MAIN_GRAD_ADDED, None)
    if callback is not None:
        callback()


def accumulated_grad(param: torch.Tensor) -> torch.Tensor | None:
    """Where ``param``'s gradient of the iteration accumulates: ``main_grad`` when it has one,
    else ``.grad`` (None before any backward pass)."""
    main: torch.Tensor | None = getattr(param, MAIN_GRAD, None)
    return main if main is not None else param.grad
