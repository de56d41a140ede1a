"""The LR schedule against torch's own schedulers (LinearLR, CosineAnnealingLR)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_het.config import OptimizerConfig
from megatron_het.errors import UserError
from megatron_het.optim.lr_schedule import LRSchedule

MAX_LR, MIN_LR, WARMUP, DECAY = 3e-4, 3e-5, 10, 110


def torch_lrs(make_scheduler, steps: int) -> list[float]:
    """The LR torch's scheduler gives after 0, 1, ..., steps-1 scheduler steps."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=MAX_LR)
    scheduler = make_scheduler(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_warmup_matches_torch_linear_lr() -> None:
    schedule = LRSchedule(MAX_LR, MIN_LR, WARMUP, DECAY, "cosine")
    expected = torch_lrs(
        lambda o: torch.optim.lr_scheduler.LinearLR(
            o, start_factor=1 / WARMUP, end_factor=1.0, total_iters=WARMUP - 1
        ),
        WARMUP,
    )
    got = [schedule.lr_at(k) for k in range(1, WARMUP + 1)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[-1] == pytest.approx(MAX_LR)


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_decay_matches_torch(style: str) -> None:
    schedule = LRSchedule(MAX_LR, MIN_LR, WARMUP, DECAY, style)
    span = DECAY - WARMUP
    if style == "cosine":

        def make(o):
            return torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=span, eta_min=MIN_LR)
    else:

        def make(o):
            return torch.optim.lr_scheduler.LinearLR(
                o, start_factor=1.0, end_factor=MIN_LR / MAX_LR, total_iters=span
            )

    expected = torch_lrs(make, span + 1)  # after j steps <-> iteration WARMUP + j
    got = [schedule.lr_at(WARMUP + j) for j in range(span + 1)]
    assert got == pytest.approx(expected, rel=1e-9)
    assert schedule.lr_at((WARMUP + DECAY) // 2) == pytest.approx(
        (MAX_LR + MIN_LR) / 2 if style == "cosine" else MIN_LR + (MAX_LR - MIN_LR) / 2
    )


def test_floor_after_decay_and_constant_style() -> None:
    schedule = LRSchedule(MAX_LR, MIN_LR, WARMUP, DECAY, "cosine")
    assert [schedule.lr_at(k) for k in (DECAY, DECAY + 1, 10 * DECAY)] == [MIN_LR] * 3
    constant = LRSchedule(MAX_LR, MIN_LR, WARMUP, DECAY, "constant")
    assert constant.lr_at(WARMUP // 2) == pytest.approx(MAX_LR / 2)
    assert [constant.lr_at(k) for k in (WARMUP, DECAY, 10 * DECAY)] == [MAX_LR] * 3


def test_no_warmup_starts_at_max_and_cosine_is_monotone() -> None:
    schedule = LRSchedule(MAX_LR, 0.0, 0, 50, "cosine")
    lrs = [schedule.lr_at(k) for k in range(0, 51)]
    assert lrs[0] == MAX_LR and lrs[-1] == 0.0
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lrs[1] == pytest.approx(MAX_LR * 0.5 * (1 + math.cos(math.pi / 50)))


def test_from_config_defaults_decay_to_train_iters() -> None:
    config = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_style="linear")
    schedule = LRSchedule.from_config(config, train_iters=12)
    assert schedule.decay_iters == 12 and schedule.lr_at(12) == pytest.approx(0.1)
    assert schedule.state_dict()["decay_style"] == "linear"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_lr=1e-4, min_lr=1e-3, warmup_iters=0, decay_iters=10), "--min-lr"),
        (dict(max_lr=1e-3, min_lr=0.0, warmup_iters=10, decay_iters=10), "--lr-decay-iters 10"),
        (
            dict(max_lr=1e-3, min_lr=0.0, warmup_iters=0, decay_iters=10, decay_style="step"),
            "--lr-decay-style",
        ),
    ],
)
def test_bad_schedules_raise_user_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        LRSchedule(**kwargs)
