"""The single-device reference that the trainer is compared against: the plain ``LlamaModel``
with torch's AdamW, gradient accumulation over micro-batches, global-norm clipping.

This is deliberately not the product's training path (which runs every plan, one process
included, through the pipeline executor and the parallel optimizer): it is the independent
computation those runs must equal.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megatron_het.config import TrainConfig
from megatron_het.data.mock_dataset import SampleDataset
from megatron_het.errors import UserError
from megatron_het.optim.clip_grad import clip_grad_norm
from megatron_het.optim.lr_schedule import LRSchedule
from megatron_het.optim.optimizer import load_optimizer_state_by_name, optimizer_state_by_name
from megatron_het.training.batches import MicroBatch, get_micro_batches
from megatron_het.training.state import Progress, rng_state, set_rng_state


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean over every token of the global batch
    grad_norm: float  # before clipping
    lr: float


def _autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def forward_backward(
    model: nn.Module,
    micro_batches: Sequence[MicroBatch],
    bf16: bool = False,
    forward_only: bool = False,
) -> torch.Tensor:
    """Every micro-batch forward (and backward unless ``forward_only``), each token-mean loss
    divided by the number of micro-batches: ``.grad`` accumulates the gradient of the mean loss
    over the global batch. Returns that mean loss (detached)."""
    device = next(model.parameters()).device
    count = len(micro_batches)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for tokens, labels in micro_batches:
        with _autocast(device, bf16):
            loss = model(tokens, labels=labels)
        if not forward_only:
            (loss / count).backward()
        total += loss.detach()
    return total / count


def optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, lr: float, clip_grad: float, iteration: int
) -> float:
    """Clip the accumulated gradients, set ``lr`` and step; returns the pre-clip norm."""
    grad_norm = clip_grad_norm(model.parameters(), clip_grad)
    if not math.isfinite(grad_norm):
        raise UserError(f"iteration {iteration}: the gradient norm is {grad_norm}")
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return grad_norm


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[MicroBatch],
    lr: float,
    clip_grad: float,
    bf16: bool,
    iteration: int,
) -> StepResult:
    """Zero grads, :func:`forward_backward`, :func:`optimizer_step`."""
    optimizer.zero_grad(set_to_none=True)
    loss = float(forward_backward(model, micro_batches, bf16=bf16))
    if not math.isfinite(loss):
        raise UserError(f"iteration {iteration}: the loss is {loss}")
    grad_norm = optimizer_step(model, optimizer, lr, clip_grad, iteration)
    return StepResult(loss=loss, grad_norm=grad_norm, lr=lr)


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset: SampleDataset, train: TrainConfig, device: torch.device
) -> float:
    """Mean loss over the first ``eval_iters`` global batches of ``dataset``."""
    model.eval()
    losses = []
    for step in range(train.eval_iters):
        batches = get_micro_batches(
            dataset,
            step * train.global_batch_size,
            train.global_batch_size,
            train.micro_batch_size,
            device,
        )
        losses.append(float(forward_backward(model, batches, bf16=train.bf16, forward_only=True)))
    model.train()
    return sum(losses) / len(losses)


def capture_train_state(
    optimizer: torch.optim.Optimizer, schedule: LRSchedule, progress: Progress
) -> dict:
    """The training state in the single-process format checkpoints had before every run
    became a plan (optimizer state by parameter name): what old checkpoints hold."""
    return {
        "version": 1,
        "iteration": progress.iteration,
        "consumed_samples": progress.consumed_samples,
        "optimizer": optimizer_state_by_name(optimizer),
        "lr_schedule": schedule.state_dict(),
        "rng": rng_state("cpu"),
    }


def restore_train_state(state: dict, optimizer: torch.optim.Optimizer) -> Progress:
    """Load a :func:`capture_train_state`-shaped state into ``optimizer``; the saved progress."""
    load_optimizer_state_by_name(optimizer, state["optimizer"])
    set_rng_state(state["rng"], "cpu")
    return Progress(
        iteration=int(state["iteration"]), consumed_samples=int(state["consumed_samples"])
    )
