"""Megatron's mixed precision on one process: bf16 weights, fp32 main grads, masters and Adam."""

from __future__ import annotations

import io
import json
import math
import pathlib

import pytest
import torch

from megatron_het.arguments import parse_run_config
from megatron_het.checkpoint.reader import load_model_state
from megatron_het.errors import UserError
from megatron_het.launcher.world import init_world, shutdown_world
from megatron_het.training import pretrain
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
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-warmup-iters",
    "2",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "1.0",
    "--seed",
    "3",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
]


def _losses(path: pathlib.Path) -> list[float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("split") == "train"]


def _figures(path: pathlib.Path) -> list[tuple]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        (
            r["iteration"],
            r["loss"],
            r["grad_norm"],
            r["lr"],
            r.get("loss_scale"),
            r.get("skipped_iterations"),
        )
        for r in rows
        if r.get("split") == "train"
    ]


def _train(tmp_path: pathlib.Path, name: str, *extra: str) -> pathlib.Path:
    metrics = tmp_path / f"{name}.jsonl"
    pretrain(parse_run_config([*FLAGS, *extra, "--metrics-file", str(metrics)]), out=io.StringIO())
    return metrics


def test_bf16_losses_follow_fp32_over_20_iterations(tmp_path: pathlib.Path) -> None:
    fp32 = _losses(_train(tmp_path, "fp32", "--train-iters", "20"))
    bf16 = _losses(_train(tmp_path, "bf16", "--train-iters", "20", "--bf16"))
    assert len(fp32) == len(bf16) == 20
    assert fp32[-1] < fp32[0] - 0.1, "the run should learn something"
    for step, (a, b) in enumerate(zip(fp32, bf16), start=1):
        assert abs(a - b) <= 2e-2 * a, (step, a, b)
    assert fp32 != bf16  # really two precisions


@pytest.mark.parametrize(
    "precision",
    [["--bf16"], ["--fp16", "--initial-loss-scale", str(2**19), "--hysteresis", "1"]],
    ids=["bf16", "fp16"],
)
def test_low_precision_resume_is_bitwise_exact(
    tmp_path: pathlib.Path, precision: list[str]
) -> None:
    whole = _train(tmp_path, "whole", "--train-iters", "6", *precision)
    save = str(tmp_path / "ckpt")
    common = ["--train-iters", "6", *precision, "--save", save, "--load", save]
    resumed = tmp_path / "resumed.jsonl"
    first = parse_run_config(
        [*FLAGS, *common, "--exit-interval", "3", "--metrics-file", str(resumed)]
    )
    assert pretrain(first, out=io.StringIO()).iteration == 3
    rest = parse_run_config([*FLAGS, *common, "--metrics-file", str(resumed)])
    assert pretrain(rest, out=io.StringIO()).iteration == 6
    assert _figures(resumed) == _figures(whole)  # exact floats
    # The checkpoint keeps the float32 masters, not the bf16 weights the model computes with.
    _, weights = load_model_state(save)
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert any(not torch.equal(t, t.bfloat16().float()) for t in weights.values())


def _trainer(*extra: str):
    from megatron_het.comm import UnifiedCommunicator
    from megatron_het.training.trainer import build_trainer

    setup = prepare_run(parse_run_config([*FLAGS, "--train-iters", "4", *extra]))
    init_world(None)
    comm = UnifiedCommunicator.from_cluster(setup.cluster)
    return build_trainer(setup, comm)


def test_the_optimizer_keeps_fp32_masters_and_main_grads_of_bf16_weights() -> None:
    from megatron_het.training.trainer import train_step

    try:
        trainer = _trainer("--bf16")
        params = dict(trainer.stage.named_parameters())
        assert {p.dtype for p in params.values()} == {torch.bfloat16}
        masters = trainer.optimizer.master_weights()
        assert {m.dtype for m in masters.values()} == {torch.float32}
        for name, param in params.items():  # every parameter is its master, rounded
            assert torch.equal(param.detach().cpu(), masters[name].bfloat16()), name
        assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())
        train_step(trainer, stop_requested=False)
        masters = trainer.optimizer.master_weights()
        for name, param in params.items():
            assert param.grad is None, name  # the bf16 gradient went into main_grad
            assert param.main_grad.dtype == torch.float32 and param.main_grad.abs().sum() > 0
            assert torch.equal(param.detach(), masters[name].bfloat16()), name
        states = trainer.optimizer.state_dict()
        assert all(s["exp_avg"].dtype == torch.float32 and s["step"] == 1 for s in states.values())
        trainer.optimizer.close()
    finally:
        shutdown_world()


def test_fp32_training_has_no_separate_masters() -> None:
    try:
        trainer = _trainer()
        assert trainer.optimizer.master_weights() is None
        assert trainer.optimizer.flat.master_bytes() == 0
        assert {p.dtype for p in trainer.stage.parameters()} == {torch.float32}
        trainer.optimizer.close()
    finally:
        shutdown_world()


def test_grad_reduce_in_bf16_needs_bf16_training() -> None:
    run = parse_run_config([*FLAGS, "--grad-reduce-in-bf16"])
    with pytest.raises(UserError, match="--grad-reduce-in-bf16 needs bf16"):
        prepare_run(run)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_memory_model_counts_what_the_optimizer_holds(precision: str) -> None:
    from megatron_het.perf.cost.memory import stage_memory, stage_parameters
    from megatron_het.training.trainer import train_step

    try:
        trainer = _trainer(*(["--bf16"] if precision == "bf16" else []))
        train_step(trainer, stop_requested=False)  # Adam creates its moments on the first step
        setup, optimizer = trainer.setup, trainer.optimizer
        stage = setup.plan.pipelines[0].stages[0]
        model = stage_memory(stage_parameters(setup.model_config, stage), precision, 1, 0.0, 1)
        params = sum(b.numel() * b.element_size() for b in optimizer.flat.param_buffers)
        grads = sum(b.grad.numel() * b.grad.element_size() for b in optimizer.buckets.buckets)
        held = optimizer.state_bytes() + optimizer.flat.master_bytes()
        assert (params, grads, held) == (
            model.weights_bytes,
            model.grads_bytes,
            model.optimizer_bytes,
        )
        optimizer.close()
    finally:
        shutdown_world()


def test_fp16_with_loss_scaling_follows_fp32(tmp_path: pathlib.Path) -> None:
    fp32 = _losses(_train(tmp_path, "fp32", "--train-iters", "12"))
    fp16 = _losses(
        _train(tmp_path, "fp16", "--train-iters", "12", "--fp16", "--initial-loss-scale", "4096")
    )
    assert len(fp16) == 12 and fp16 != fp32
    for step, (a, b) in enumerate(zip(fp32, fp16), start=1):
        assert abs(a - b) <= 2e-2 * a, (step, a, b)


def test_fp16_overflow_skips_steps_and_backs_off(tmp_path: pathlib.Path) -> None:
    # This model's scaled gradients first fit fp16 (max 65504) at a loss scale of 2^19.
    path = _train(
        tmp_path,
        "fp16",
        "--train-iters",
        "8",
        "--fp16",
        "--initial-loss-scale",
        str(2**23),
        "--hysteresis",
        "1",
    )
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    scales = [r["loss_scale"] for r in rows]
    skipped = [r["skipped_iterations"] for r in rows]
    assert scales[:5] == [2**22, 2**21, 2**20, 2**19, 2**19]  # halved per overflow
    assert skipped == [1, 2, 3, 4, 4, 4, 4, 4]
    assert [math.isfinite(r["grad_norm"]) for r in rows[:5]] == [False] * 4 + [True]
    assert rows[-1]["loss"] < rows[4]["loss"]  # and it trains once the scale fits


def test_loss_scaler_backs_off_with_hysteresis_and_grows_after_a_window() -> None:
    from megatron_het.optim.loss_scaler import LossScaler

    scaler = LossScaler(scale=64.0, growth_interval=3, hysteresis=2, hysteresis_left=2)
    scaler.update(found_inf=True)
    assert scaler.scale == 64.0  # the first overflow only uses up hysteresis
    scaler.update(found_inf=True)
    assert scaler.scale == 32.0
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 64.0
    state = scaler.state_dict()
    again = LossScaler()
    again.load_state_dict(state)
    assert again.state_dict() == state
    with pytest.raises(UserError, match="overflow fp16 even at loss scale 1"):
        LossScaler(scale=1.0, hysteresis=1, hysteresis_left=1).update(found_inf=True)
    with pytest.raises(UserError, match="--loss-scale 8"):
        LossScaler(scale=8.0, dynamic=False).update(found_inf=True)
