"""Non-finite iterations in a 2-rank run (pipeline or data parallel, gloo): every rank makes the
same decision although the NaN appears on one rank only (the loss travels in the world gather,
the gradient norm in a world all-reduce). Without --skip-nonfinite-steps every rank stops at the
poisoned iteration with the same line and no checkpoint is written for it; with it every rank
skips that step and ends as a run that never took it. The poisoning is the single-process
tests' (:func:`tests.unit.test_nonfinite_steps.poison`)."""

from __future__ import annotations

import io
import pathlib
from typing import Any

import pytest

from megatron_het.checkpoint.io import read_latest_iteration
from tests.distributed.harness import run_ranks
from tests.unit.test_nonfinite_steps import (
    FLAGS,
    assert_same_state,
    poison,
    reference_skipping,
    train_with_poison,
)

LAYOUTS = {"pp2": ["--pipeline-model-parallel-size", "2"], "dp2": []}


def _skip_worker(
    rank: int, world_size: int, argv: list[str], poisoned_rank: int, what: str
) -> tuple[int, int]:
    poisoned = {2: what} if rank == poisoned_rank else {}
    trainer, states = train_with_poison(argv, poisoned, world_size)
    expected = reference_skipping(argv, {2}, world_size)
    assert len(states) == len(expected) == 4
    for got, want in zip(states, expected):
        assert_same_state(got, want)
    return trainer.skipped_nonfinite, trainer.progress.iteration


@pytest.mark.parametrize(
    "layout, poisoned_rank, what",
    [
        ("pp2", 0, "grad"),  # the first stage's gradients: the loss (last stage) stays finite
        ("pp2", 0, "loss"),  # the first stage's output: the last stage's loss is NaN
        ("dp2", 1, "grad"),  # one replica's gradients
    ],
)
def test_every_rank_skips_the_same_step(layout: str, poisoned_rank: int, what: str) -> None:
    argv = [*FLAGS, *LAYOUTS[layout], "--skip-nonfinite-steps"]
    results = run_ranks(_skip_worker, 2, argv, poisoned_rank, what, timeout=120)
    assert results == [(1, 4), (1, 4)]


def _stop_worker(rank: int, world_size: int, argv: list[str]) -> str:
    from megatron_het.arguments import parse_run_config
    from megatron_het.errors import UserError
    from megatron_het.training import pretrain_on_world
    from megatron_het.training import run as run_module

    original = run_module.build_trainer

    def build_poisoned(*args: Any, **kwargs: Any) -> Any:
        trainer = original(*args, **kwargs)
        if rank == 0:
            poison(trainer, 3, "grad")
        return trainer

    run_module.build_trainer = build_poisoned  # this forked worker's copy only
    try:
        pretrain_on_world(parse_run_config(argv), world_size, out=io.StringIO())
    except UserError as error:
        return str(error)
    return "no error"


def test_every_rank_stops_at_the_poisoned_iteration_without_its_checkpoint(
    tmp_path: pathlib.Path,
) -> None:
    save = tmp_path / "ckpt"
    argv = [*FLAGS, *LAYOUTS["pp2"], "--save", str(save), "--save-interval", "1"]
    messages = run_ranks(_stop_worker, 2, argv, timeout=120)
    assert messages[0] == messages[1]
    assert messages[0].startswith("iteration 3: the gradient norm is nan; lower --lr")
    assert "\n" not in messages[0]
    assert read_latest_iteration(save) == 2
    assert not (save / "iter_0000003").exists()
