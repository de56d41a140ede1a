"""Non-finite iterations in a single-process trainer: a NaN loss or gradient norm stops the run
with one line naming the iteration (no checkpoint for it), or, with --skip-nonfinite-steps, the
iteration steps nothing and the run goes on as if that step had not been taken.

NaNs are injected by a forward hook on the stage's first decoder layer, active during one
iteration: "loss" multiplies the layer's output by NaN (the loss is NaN), "grad" leaves the
output alone and makes the gradient flowing back into it NaN (the loss stays finite, the
gradient norm is NaN).
"""

from __future__ import annotations

import io
import json
import math
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from megatron_het.arguments import parse_run_config
from megatron_het.checkpoint.io import read_latest_iteration
from megatron_het.errors import UserError
from megatron_het.training.setup import prepare_run

FLAGS = [
    "--model",
    "tiny",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "300",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "4",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--clip-grad",
    "1.0",
    "--seed",
    "7",
    "--eval-iters",
    "0",
    "--log-interval",
    "2",
]


def poison(trainer: Any, iteration: int, what: str) -> Callable[[], None]:
    """Make ``iteration`` of ``trainer`` non-finite (``what``: "loss" or "grad", see the module
    docstring) through a hook on its stage's first decoder layer; returns the remover."""
    layer = next(iter(trainer.stage.layers.values()))

    def hook(_module: Any, _inputs: Any, output: torch.Tensor) -> Any:
        if trainer.progress.iteration + 1 != iteration or not torch.is_grad_enabled():
            return None
        if what == "loss":
            return output * float("nan")
        output.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        return None

    return layer.register_forward_hook(hook).remove


def snapshot(trainer: Any) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(parameters, optimizer state by name) of a trainer, as CPU copies."""
    params = {n: p.detach().cpu().clone() for n, p in trainer.stage.named_parameters()}
    return params, trainer.optimizer.state_dict()


def assert_same_state(a: tuple, b: tuple) -> None:
    (params_a, opt_a), (params_b, opt_b) = a, b
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name
        assert opt_a[name]["step"] == opt_b[name]["step"], name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_a[name][key], opt_b[name][key]), (name, key)


def build(argv: list[str], world_size: int = 1) -> Any:
    """A trainer of ``argv`` on the initialised world (no emulation, no logger)."""
    from megatron_het.comm import UnifiedCommunicator
    from megatron_het.training.trainer import build_trainer

    setup = prepare_run(parse_run_config(argv), world_size)
    return build_trainer(setup, UnifiedCommunicator.from_cluster(setup.cluster))


def skip_by_hand(trainer: Any) -> None:
    """The reference for a skipped step: advance the iteration and the data, step nothing."""
    trainer.progress.iteration += 1
    trainer.progress.consumed_samples += trainer.setup.train.global_batch_size


def train_with_poison(
    argv: list[str], poisoned: dict[int, str], world_size: int = 1
) -> tuple[Any, list]:
    """Train ``argv``'s iterations with ``poisoned`` {iteration: "loss" | "grad"}; returns the
    trainer and the state snapshots after every iteration."""
    from megatron_het.training.trainer import train_step

    trainer = build(argv, world_size)
    removers = [poison(trainer, it, what) for it, what in poisoned.items()]
    states = []
    try:
        while trainer.progress.iteration < trainer.setup.train.train_iters:
            train_step(trainer, False)
            states.append(snapshot(trainer))
    finally:
        for remove in removers:
            remove()
        trainer.optimizer.close()
    return trainer, states


def reference_skipping(argv: list[str], skipped: set[int], world_size: int = 1) -> list:
    """The same run with the ``skipped`` iterations' steps left out by hand."""
    from megatron_het.training.trainer import train_step

    trainer = build(argv, world_size)
    states = []
    try:
        while trainer.progress.iteration < trainer.setup.train.train_iters:
            if trainer.progress.iteration + 1 in skipped:
                skip_by_hand(trainer)
            else:
                train_step(trainer, False)
            states.append(snapshot(trainer))
    finally:
        trainer.optimizer.close()
    return states


@pytest.fixture
def world():
    from megatron_het.launcher.world import init_world, shutdown_world

    init_world(None)
    yield
    shutdown_world()


def test_skipped_steps_leave_parameters_and_adam_state_as_without_them(world) -> None:
    argv = [*FLAGS, "--skip-nonfinite-steps"]
    trainer, states = train_with_poison(argv, {2: "grad", 3: "loss"})
    assert (trainer.progress.iteration, trainer.progress.consumed_samples) == (4, 16)
    assert trainer.skipped_nonfinite == 2
    # The skipped iterations changed nothing; the last one stepped.
    assert_same_state(states[1], states[0])
    assert_same_state(states[2], states[0])
    assert not torch.equal(states[3][0]["final_norm.weight"], states[0][0]["final_norm.weight"])
    expected = reference_skipping(argv, {2, 3})
    for got, want in zip(states, expected):
        assert_same_state(got, want)
    assert trainer.last_loss is not None and math.isfinite(trainer.last_loss)


def test_a_finite_run_is_unchanged_by_the_flag(world) -> None:
    _, plain = train_with_poison(FLAGS, {})
    trainer, flagged = train_with_poison([*FLAGS, "--skip-nonfinite-steps"], {})
    assert trainer.skipped_nonfinite == 0
    assert_same_state(plain[-1], flagged[-1])


@pytest.mark.parametrize(
    "what, message",
    [
        ("grad", r"^iteration 3: the gradient norm is nan; lower --lr"),  # the loss is finite
        ("loss", r"^iteration 3: the loss is nan; lower --lr"),
    ],
)
def test_without_the_flag_a_nonfinite_iteration_stops_before_stepping(
    world, what: str, message: str
) -> None:
    from megatron_het.training.trainer import train_step

    trainer = build(FLAGS)
    remove = poison(trainer, 3, what)
    try:
        train_step(trainer, False)
        train_step(trainer, False)
        before = snapshot(trainer)
        with pytest.raises(UserError, match=message) as info:
            train_step(trainer, False)
        assert "\n" not in str(info.value)
        assert trainer.progress.iteration == 2
        assert_same_state(snapshot(trainer), before)
    finally:
        remove()
        trainer.optimizer.close()


def patch_build_trainer(monkeypatch: pytest.MonkeyPatch, poisoned: dict[int, str]) -> None:
    """Make every trainer the run builds poison ``poisoned`` iterations."""
    from megatron_het.training import run as run_module

    original = run_module.build_trainer

    def build_poisoned(*args: Any, **kwargs: Any) -> Any:
        trainer = original(*args, **kwargs)
        for iteration, what in poisoned.items():
            poison(trainer, iteration, what)
        return trainer

    monkeypatch.setattr(run_module, "build_trainer", build_poisoned)


def test_the_run_stops_naming_the_iteration_and_keeps_the_last_checkpoint(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_het.training import pretrain

    patch_build_trainer(monkeypatch, {3: "grad"})
    save = tmp_path / "ckpt"
    run = parse_run_config([*FLAGS, "--save", str(save), "--save-interval", "1"])
    with pytest.raises(UserError, match=r"^iteration 3: the gradient norm is nan;"):
        pretrain(run, out=io.StringIO())
    assert read_latest_iteration(save) == 2
    assert not (save / "iter_0000003").exists()


def test_the_run_logs_and_counts_skipped_steps(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_het.training import pretrain

    patch_build_trainer(monkeypatch, {2: "grad"})
    metrics, save = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    out = io.StringIO()
    progress = pretrain(
        parse_run_config(
            [*FLAGS, "--skip-nonfinite-steps", "--metrics-file", str(metrics), "--save", str(save)]
        ),
        out=out,
    )
    assert (progress.iteration, progress.consumed_samples) == (4, 16)
    text = out.getvalue()
    assert (
        " iteration 2: the gradient norm is nan; skipped its step "
        "(--skip-nonfinite-steps; 1 skipped so far)"
    ) in text
    assert text.count("skipped non-finite iterations: 1 (run total 1) |") == 1
    assert text.count("skipped non-finite iterations: 0 (run total 1) |") == 1
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["skipped_step"] for r in rows] == [False, True, False, False]
    assert [r["nonfinite_skipped_iterations"] for r in rows] == [1 - (i < 1) for i in range(4)]
    assert math.isnan(rows[1]["grad_norm"]) and math.isfinite(rows[1]["loss"])
    assert [r["consumed_samples"] for r in rows] == [4, 8, 12, 16]
    # The interval's mean loss leaves the skipped iteration out: iterations 1-2 report 1's.
    assert f"lm loss: {rows[0]['loss']:.6E}" in text
    assert read_latest_iteration(save) == 4
