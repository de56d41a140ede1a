"""The single-device training loop.

One iteration = :func:`forward_backward` over the iteration's micro-batches (gradient
accumulation), then :func:`optimizer_step` (global-norm clip, LR from the schedule, AdamW). The two
are separate so a pipeline schedule and a data-parallel gradient sync can replace or wrap the
first without touching the second.

Data position: iteration ``k`` (1-based) reads train samples
``[consumed_samples, consumed_samples + global_batch_size)``, micro-batch ``m`` row ``r`` being
sample ``consumed_samples + m * micro_batch_size + r``; resuming only needs ``consumed_samples``.
"""
from __future__ import annotations

import contextlib
import math
import signal
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from megatron_het.config import TrainConfig
from megatron_het.errors import UserError
from megatron_het.optim.clip_grad import clip_grad_norm
from megatron_het.training.setup import SampleDataset

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # tokens [b, s], labels [b, s]


class StopRequest:
    """Set by a signal handler; the loop saves and stops at the end of the current iteration."""

    def __init__(self) -> None:
        self.requested = False
        self.reason = ""

    def request(self, signum: int, _frame: Any = None) -> None:
        """Signal-handler signature: remember that ``signum`` asked the run to stop."""
        self.requested = True
        self.reason = signal.Signals(signum).name

    def install(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        """Route ``signals`` to :meth:`request` (process-wide; call from the entry point)."""
        for signum in signals:
            signal.signal(signum, self.request)


@dataclass(frozen=True)
class StepResult:
    """What one iteration reports."""

    loss: float  # mean over every token of the global batch
    grad_norm: float  # before clipping
    lr: float


def get_micro_batches(dataset: SampleDataset, first_sample: int, global_batch_size: int,
                      micro_batch_size: int, device: torch.device) -> list[MicroBatch]:
    """The ``global_batch_size // micro_batch_size`` micro-batches starting at ``first_sample``."""
    rows = np.stack([np.asarray(dataset[first_sample + i], dtype=np.int64)
                     for i in range(global_batch_size)])
    samples = torch.from_numpy(rows).to(device)
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in samples.split(micro_batch_size)]


def _autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def forward_backward(model: nn.Module, micro_batches: Sequence[MicroBatch], bf16: bool = False,
                     forward_only: bool = False) -> torch.Tensor:
    """Run every micro-batch forward (and backward unless ``forward_only``).

    Each micro-batch's token-mean cross-entropy (computed in fp32 by the model's fused head) is
    divided by the number of
    micro-batches before backward, so the accumulated ``.grad`` is the gradient of the mean loss
    over the whole global batch (all micro-batches hold the same number of tokens). Returns that
    mean loss as a detached scalar tensor. Side effect: adds into the parameters' ``.grad``.
    """
    device = next(model.parameters()).device
    count = len(micro_batches)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for tokens, labels in micro_batches:
        with _autocast(device, bf16):
            # The model's fused head + cross-entropy (fp32, chunked) never holds full logits.
            loss = model(tokens, labels=labels)
        if not forward_only:
            (loss / count).backward()
        total += loss.detach()
    return total / count


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, lr: float,
                   clip_grad: float, iteration: int) -> float:
    """Clip the accumulated gradients, set ``lr`` on every group and step AdamW.

    Returns the pre-clip global gradient norm. Raises UserError, without stepping, when that
    norm is not finite. Does not zero the gradients.
    """
    grad_norm = clip_grad_norm(model.parameters(), clip_grad)
    if not math.isfinite(grad_norm):
        raise UserError(f"iteration {iteration}: the gradient norm is {grad_norm}; lower --lr "
                        "and resume from the last checkpoint")
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return grad_norm


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               micro_batches: Sequence[MicroBatch], lr: float, clip_grad: float, bf16: bool,
               iteration: int) -> StepResult:
    """One iteration: zero grads, :func:`forward_backward`, :func:`optimizer_step`.

    Raises UserError (before stepping) when the loss or the gradient norm is not finite.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = float(forward_backward(model, micro_batches, bf16=bf16))
    if not math.isfinite(loss):
        raise UserError(f"iteration {iteration}: the loss is {loss}; lower --lr (or use "
                        "--clip-grad) and resume from the last checkpoint")
    grad_norm = optimizer_step(model, optimizer, lr, clip_grad, iteration)
    return StepResult(loss=loss, grad_norm=grad_norm, lr=lr)


@torch.no_grad()
def evaluate(model: nn.Module, dataset: SampleDataset, train: TrainConfig,
             device: torch.device) -> float:
    """Mean loss over the first ``eval_iters`` global batches of ``dataset`` (no gradients)."""
    model.eval()
    losses = []
    for step in range(train.eval_iters):
        batches = get_micro_batches(dataset, step * train.global_batch_size,
                                    train.global_batch_size, train.micro_batch_size, device)
        losses.append(float(forward_backward(model, batches, bf16=train.bf16,
                                              forward_only=True)))
    model.train()
    return sum(losses) / len(losses)


def run_iterations(train: TrainConfig, iteration: Callable[[], int], step: Callable[[], str],
                   evaluate: Callable[[], None], save: Callable[[], bool],
                   say: Callable[[str], None]) -> str:
    """The run's cadence, shared by the single-process and the parallel loop.

    Runs ``step()`` (one training iteration; returns a stop reason, "" to go on) until
    ``iteration()`` reaches ``--train-iters``. Evaluates every ``--eval-interval`` and at the end;
    saves (``save()`` returns False without ``--save``) every ``--save-interval``, on
    ``--exit-interval``, on a stop reason and at the end, each iteration at most once. Returns
    why it stopped: "done", "exit-interval" or the step's reason.
    """
    evaluated = saved = -1
    while iteration() < train.train_iters:
        stop_reason = step()
        current = iteration()
        if current % train.eval_interval == 0:
            evaluate()
            evaluated = current
        if train.save_interval and current % train.save_interval == 0:
            save()
            saved = current
        reason = ("exit-interval" if train.exit_interval and current % train.exit_interval == 0
                  else stop_reason)
        if reason:
            if saved != current and not save():
                say(" no --save directory: stopping without a checkpoint")
            say(f" stopping after iteration {current} ({reason})")
            return reason
    if evaluated != iteration():
        evaluate()
    if saved != iteration():
        save()
    return "done"
