"""Learning-rate schedule: linear warmup, then cosine or linear decay to a floor.

The schedule is a pure function of the iteration number, so resuming from a checkpoint only needs
the iteration to reproduce the learning rate exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from megatron_het.config import OptimizerConfig
from megatron_het.errors import UserError

DECAY_STYLES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate of iteration ``k`` (1-based, the k-th optimizer step).

    - ``k <= warmup_iters``: ``max_lr * k / warmup_iters`` (the first step already moves).
    - ``constant``: ``max_lr`` after warmup.
    - ``cosine`` / ``linear``: decays from ``max_lr`` just after warmup to ``min_lr`` at
      ``decay_iters``, then stays at ``min_lr``.
    """

    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    decay_style: str = "cosine"

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise UserError(
                f"unknown --lr-decay-style {self.decay_style!r}; "
                f"use one of {', '.join(DECAY_STYLES)}"
            )
        if self.max_lr < 0 or self.min_lr < 0:
            raise UserError(f"--lr {self.max_lr} and --min-lr {self.min_lr} must be >= 0")
        if self.min_lr > self.max_lr:
            raise UserError(
                f"--min-lr {self.min_lr} is larger than --lr {self.max_lr}; lower --min-lr"
            )
        if self.warmup_iters < 0:
            raise UserError(f"--lr-warmup-iters must be >= 0, got {self.warmup_iters}")
        if self.decay_style != "constant" and self.decay_iters <= self.warmup_iters:
            raise UserError(
                f"--lr-decay-iters {self.decay_iters} must be larger than "
                f"--lr-warmup-iters {self.warmup_iters}"
            )

    @classmethod
    def from_config(cls, config: OptimizerConfig, train_iters: int) -> LRSchedule:
        """Build from the optimizer config; ``lr_decay_iters`` defaults to ``train_iters``."""
        decay_iters: int | None = config.lr_decay_iters
        return cls(
            max_lr=config.lr,
            min_lr=config.min_lr,
            warmup_iters=config.lr_warmup_iters,
            decay_iters=train_iters if decay_iters is None else decay_iters,
            decay_style=config.lr_decay_style,
        )

    def lr_at(self, iteration: int) -> float:
        """Learning rate used by optimizer step number ``iteration`` (1-based)."""
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.max_lr * iteration / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if iteration >= self.decay_iters:
            return self.min_lr
        ratio = (iteration - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def state_dict(self) -> dict[str, Any]:
        """The schedule's parameters, stored in checkpoints for the record."""
        return asdict(self)
