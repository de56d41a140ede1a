"""forward_backward / train_step against plain single-batch computations on the tiny model."""

from __future__ import annotations

import io
import json
import math
import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_het.arguments import parse_run_config
from megatron_het.checkpoint.io import save_checkpoint
from megatron_het.config import OptimizerConfig, RopeScaling, TrainConfig, model_preset
from megatron_het.data.mock_dataset import MockDataset
from megatron_het.errors import UserError
from megatron_het.model.init import init_weights
from megatron_het.model.llama import LlamaModel
from megatron_het.optim.lr_schedule import LRSchedule
from megatron_het.optim.optimizer import build_optimizer
from megatron_het.training import pretrain
from megatron_het.training.batches import get_micro_batches
from megatron_het.training.setup import check_checkpoint_model, prepare_run
from megatron_het.training.state import Progress
from tests.reference import capture_train_state, evaluate, forward_backward, train_step

CONFIG = model_preset("tiny").replace(num_layers=2)
SEQ = 16


def model() -> LlamaModel:
    m = LlamaModel(CONFIG)
    init_weights(m, seed=3)
    return m


class Rows:
    """Sample ``i`` is ``[i, i + 1, ..., i + SEQ]`` mod vocab: its position is visible."""

    def __getitem__(self, index: int) -> np.ndarray:
        return (np.arange(SEQ + 1, dtype=np.int64) + index) % CONFIG.vocab_size

    def __len__(self) -> int:
        return 1000


def grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def test_micro_batches_follow_consumed_samples() -> None:
    batches = get_micro_batches(
        Rows(), 40, num_samples=6, micro_batch_size=2, device=torch.device("cpu")
    )
    assert len(batches) == 3
    for m, (tokens, labels) in enumerate(batches):
        assert tokens.shape == labels.shape == (2, SEQ)
        assert tokens[:, 0].tolist() == [40 + 2 * m, 40 + 2 * m + 1]
        assert torch.equal(labels[:, :-1], tokens[:, 1:])


def test_accumulation_equals_one_big_batch() -> None:
    data = MockDataset(8, SEQ, CONFIG.vocab_size, seed=1, split_id=0)
    cpu = torch.device("cpu")
    accumulated, single = model(), model()
    loss_acc = forward_backward(accumulated, get_micro_batches(data, 0, 8, 2, cpu))
    ((tokens, labels),) = get_micro_batches(data, 0, 8, 8, cpu)
    reference = F.cross_entropy(single(tokens).flatten(0, 1), labels.flatten())
    reference.backward()
    assert float(loss_acc) == pytest.approx(reference.item(), rel=1e-6)
    expected = grads(single)
    for name, grad in grads(accumulated).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6)


def test_bf16_autocast_is_close_to_fp32() -> None:
    data = MockDataset(4, SEQ, CONFIG.vocab_size, seed=2, split_id=0)
    batches = get_micro_batches(data, 0, 4, 2, torch.device("cpu"))
    fp32 = float(forward_backward(model(), batches, forward_only=True))
    bf16 = float(forward_backward(model(), batches, bf16=True, forward_only=True))
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert fp32 == pytest.approx(math.log(CONFIG.vocab_size), rel=0.05)  # near-uniform at init


def test_train_step_clips_and_steps() -> None:
    m = model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    optimizer = build_optimizer(m, OptimizerConfig(lr=1e-3))
    batches = get_micro_batches(Rows(), 0, 4, 2, torch.device("cpu"))
    result = train_step(m, optimizer, batches, lr=1e-3, clip_grad=1e-3, bf16=False, iteration=1)
    assert result.lr == 1e-3 and result.grad_norm > 1e-3  # the pre-clip norm is reported
    assert all(g["lr"] == 1e-3 for g in optimizer.param_groups)
    assert any(not torch.equal(p, before[n]) for n, p in m.named_parameters())


def test_non_finite_loss_stops_before_stepping() -> None:
    m = model()
    with torch.no_grad():
        m.final_norm.weight.fill_(float("nan"))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    optimizer = build_optimizer(m, OptimizerConfig())
    with pytest.raises(UserError, match="iteration 4: the loss is nan"):  # the reference's own
        train_step(
            m,
            optimizer,
            get_micro_batches(Rows(), 0, 2, 2, torch.device("cpu")),
            lr=1e-3,
            clip_grad=1.0,
            bf16=False,
            iteration=4,
        )
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]) or n == "final_norm.weight"


def test_evaluate_uses_fixed_batches_and_no_gradients() -> None:
    m = model()
    train = TrainConfig(micro_batch_size=2, global_batch_size=4, eval_iters=2)
    data = MockDataset(8, SEQ, CONFIG.vocab_size, seed=5, split_id=1)
    cpu = torch.device("cpu")
    loss = evaluate(m, data, train, cpu)
    expected = np.mean(
        [
            float(forward_backward(m, get_micro_batches(data, 4 * k, 4, 2, cpu), forward_only=True))
            for k in range(2)
        ]
    )
    assert loss == pytest.approx(expected, rel=1e-6)
    assert m.training and all(p.grad is None for p in m.parameters())


def test_mock_data_is_a_pure_function_of_seed_split_and_index() -> None:
    a, b = MockDataset(10, SEQ, 50, 1, 0), MockDataset(10, SEQ, 50, 1, 0)
    assert np.array_equal(a[7], b[7]) and a[7].dtype == np.int64 and a[7].shape == (SEQ + 1,)
    assert not np.array_equal(a[7], MockDataset(10, SEQ, 50, 1, 1)[7])
    assert a[3].max() < 50
    with pytest.raises(IndexError):
        a[10]


def test_model_only_checkpoint_starts_fresh_from_its_weights(tmp_path: pathlib.Path) -> None:
    source = LlamaModel(model_preset("tiny"))
    init_weights(source, seed=99)  # not the run's seed
    save_checkpoint(tmp_path / "converted", 0, source.config, source.state_dict())
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("stale line from an older run\n")
    run = parse_run_config(
        [
            "--model",
            "tiny",
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "300",
            "--seq-length",
            str(SEQ),
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--train-iters",
            "2",
            "--eval-iters",
            "0",
            "--seed",
            "7",
            "--load",
            str(tmp_path / "converted"),
            "--metrics-file",
            str(metrics),
        ]
    )
    progress = pretrain(run, out=io.StringIO())
    assert (progress.iteration, progress.consumed_samples) == (2, 8)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [1, 2]  # truncated: a fresh start
    batches = get_micro_batches(prepare_run(run).train_data, 0, 4, 2, torch.device("cpu"))
    expected = float(forward_backward(source, batches, forward_only=True))
    assert lines[0]["loss"] == pytest.approx(expected, rel=1e-6)


def test_checkpoint_model_check_names_fields_and_adopts_rope_scaling(
    tmp_path: pathlib.Path,
) -> None:
    scaled = model_preset("tiny").replace(rope_scaling=RopeScaling(factor=4.0))
    save_checkpoint(tmp_path, 1, scaled, {})
    configured = model_preset("tiny").replace(init_method_std=0.01)
    assert check_checkpoint_model(tmp_path, configured) == configured.replace(
        rope_scaling=RopeScaling(factor=4.0)
    )
    with pytest.raises(
        UserError,
        match=r"in num_query_groups \(checkpoint 2, configured 4\), "
        r"rope_theta \(checkpoint 10000.0, configured 5.0\);",
    ):
        check_checkpoint_model(tmp_path, configured.replace(num_query_groups=4, rope_theta=5.0))


RUN_FLAGS = [
    "--model",
    "tiny",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "300",
    "--seq-length",
    str(SEQ),
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "6",
    "--train-iters",
    "6",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-warmup-iters",
    "2",
    "--lr-decay-style",
    "cosine",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "0.5",
    "--seed",
    "7",
    "--eval-interval",
    "3",
    "--eval-iters",
    "1",
    "--log-interval",
    "3",
]


def plain_reference(run) -> tuple:
    """The run's setup, and the plain LlamaModel with torch's AdamW and the run's schedule,
    initialised as the run is (seed 7)."""
    setup = prepare_run(run)
    reference = LlamaModel(setup.model_config)
    init_weights(reference, seed=7)
    optimizer = build_optimizer(reference, run.optimizer)
    return setup, reference, optimizer, LRSchedule.from_config(run.optimizer, run.train.train_iters)


def test_single_process_trainer_equals_the_plain_model_reference(tmp_path: pathlib.Path) -> None:
    """One process runs the one-stage, one-rank plan through the pipeline executor and the
    parallel optimizer; it must train exactly as the plain LlamaModel with torch's AdamW."""
    metrics = tmp_path / "metrics.jsonl"
    run = parse_run_config([*RUN_FLAGS, "--metrics-file", str(metrics)])
    out = io.StringIO()
    pretrain(run, out=out)
    assert "> run on cluster cpu: 1 rank (1 x cpu), fp32, dp=1" in out.getvalue()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    valid_rows = [r for r in rows if r["split"] == "valid"]

    setup, reference, optimizer, schedule = plain_reference(run)
    cpu = torch.device("cpu")
    expected_valid = []
    for iteration in range(1, 7):
        batches = get_micro_batches(setup.train_data, 6 * (iteration - 1), 6, 2, cpu)
        result = train_step(
            reference,
            optimizer,
            batches,
            schedule.lr_at(iteration),
            run.optimizer.clip_grad,
            bf16=False,
            iteration=iteration,
        )
        row = train_rows[iteration - 1]
        assert row["loss"] == pytest.approx(result.loss, rel=1e-6)
        assert row["grad_norm"] == pytest.approx(result.grad_norm, rel=1e-5)
        assert row["lr"] == result.lr
        if iteration % 3 == 0:
            expected_valid.append(evaluate(reference, setup.valid_data, setup.train, cpu))
    assert [r["loss"] for r in valid_rows] == pytest.approx(expected_valid, rel=1e-5)


def test_single_process_resume_is_bitwise_exact(tmp_path: pathlib.Path) -> None:
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    pretrain(parse_run_config([*RUN_FLAGS, "--metrics-file", str(whole)]), out=io.StringIO())
    save = str(tmp_path / "ckpt")
    first = parse_run_config(
        [
            *RUN_FLAGS,
            "--save",
            save,
            "--load",
            save,
            "--exit-interval",
            "4",
            "--metrics-file",
            str(resumed),
        ]
    )
    assert pretrain(first, out=io.StringIO()).iteration == 4
    out = io.StringIO()
    rest = parse_run_config(
        [*RUN_FLAGS, "--save", save, "--load", save, "--metrics-file", str(resumed)]
    )
    assert pretrain(rest, out=out).iteration == 6
    assert "> loaded" in out.getvalue()
    assert _figures(resumed) == _figures(whole)  # exact floats: bitwise the same training


def _figures(path: pathlib.Path) -> list[dict]:
    keys = ("split", "iteration", "loss", "grad_norm", "lr", "consumed_samples")
    return [{k: r.get(k) for k in keys} for r in map(json.loads, path.read_text().splitlines())]


def test_non_finite_loss_stops_the_run_with_one_line(tmp_path: pathlib.Path) -> None:
    run = parse_run_config([*RUN_FLAGS, "--lr", "1e30", "--min-lr", "1e29", "--clip-grad", "0"])
    with pytest.raises(UserError, match=r"^iteration \d+: the (loss|gradient norm) is"):
        pretrain(run, out=io.StringIO())


def test_a_checkpoint_in_the_earlier_single_process_format_resumes(tmp_path: pathlib.Path) -> None:
    """Checkpoints written by single-process runs before every run became a plan (full
    tensors, the optimizer state by name inside the training state) load and continue."""
    run = parse_run_config(RUN_FLAGS)
    setup, reference, optimizer, schedule = plain_reference(run)
    cpu = torch.device("cpu")
    results = []
    for iteration in range(1, 7):
        if iteration == 5:
            state = capture_train_state(optimizer, schedule, Progress(4, 24))
            save_checkpoint(
                tmp_path / "old",
                4,
                setup.model_config,
                reference.state_dict(),
                state,
                {"argv": RUN_FLAGS},
            )
        batches = get_micro_batches(setup.train_data, 6 * (iteration - 1), 6, 2, cpu)
        results.append(
            train_step(
                reference,
                optimizer,
                batches,
                schedule.lr_at(iteration),
                run.optimizer.clip_grad,
                bf16=False,
                iteration=iteration,
            )
        )
    metrics = tmp_path / "resumed.jsonl"
    resumed = parse_run_config(
        [*RUN_FLAGS, "--load", str(tmp_path / "old"), "--metrics-file", str(metrics)]
    )
    assert pretrain(resumed, out=io.StringIO()).iteration == 6
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["split"] == "train"]
    assert [r["iteration"] for r in rows] == [5, 6]
    for row, result in zip(rows, results[4:]):
        assert row["loss"] == pytest.approx(result.loss, rel=1e-6)
        assert row["grad_norm"] == pytest.approx(result.grad_norm, rel=1e-5)


def test_ddp_bucket_size_reaches_the_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_het.training import trainer

    built = []
    original = trainer.build_parallel_optimizer

    def capture(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        built.append(len(optimizer.buckets.buckets))
        return optimizer

    monkeypatch.setattr(trainer, "build_parallel_optimizer", capture)
    flags = list(RUN_FLAGS)
    flags[flags.index("--train-iters") + 1] = "3"
    for extra in ([], ["--ddp-bucket-size", "20000"]):
        pretrain(parse_run_config([*flags, *extra]), out=io.StringIO())
    # tiny's ~130k parameters: one bucket by default, several of 20,000 parameters.
    assert built[0] == 1 and built[1] > 3
