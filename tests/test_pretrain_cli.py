"""End to end through ``pretrain_llama.py`` in subprocesses: exact resume, SIGTERM, bad input."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from unittest import mock

import numpy as np
import pytest

from megatron_het import errors
from megatron_het.checkpoint.io import (
    load_checkpoint_metadata,
    read_latest_iteration,
    save_checkpoint,
)
from megatron_het.checkpoint.reader import load_train_state
from megatron_het.config import model_preset
from megatron_het.data import IndexedDatasetBuilder
from megatron_het.training.entry import main

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "pretrain_llama.py")
DATA_VOCAB = 300  # ids in the data files are < 300; NullTokenizer adds eod = 300
TRAIN_ITERS = 12


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny .bin/.idx: 120 eod-terminated documents of random ids below 300 (eod is 300)."""
    prefix = str(tmp_path_factory.mktemp("data") / "corpus")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in range(120):
        tokens = rng.integers(0, DATA_VOCAB, int(rng.integers(20, 80)))
        if doc == 0:
            tokens[0] = DATA_VOCAB - 1
        builder.add_document(np.append(tokens, DATA_VOCAB))  # eod-terminated
    builder.finalize(prefix + ".idx")
    return prefix


def base_args(data_prefix: str) -> list[str]:
    return [
        "--model",
        "tiny",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        str(TRAIN_ITERS),
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
        "1.0",
        "--seed",
        "7",
        "--data-path",
        data_prefix,
        "--split",
        "90,10,0",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(DATA_VOCAB),
        "--eval-interval",
        "4",
        "--eval-iters",
        "2",
        "--log-interval",
        "3",
    ]


# The runs here are CPU runs, on a GPU host too: the children see no GPU, and the in-process
# runs take this machine's kind as "cpu".
CPU_ONLY_ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def run_cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=CPU_ONLY_ENV,
    )


def run_in_process(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """``pretrain_llama.py args`` in this process: (exit status, stdout, stderr)."""
    try:
        with mock.patch("megatron_het.launcher.rank_device.local_accelerator", return_value="cpu"):
            errors.run_cli(lambda: main(args, {}))
        status = 0
    except SystemExit as exit_:
        status = int(exit_.code or 0)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def records(path: pathlib.Path, split: str = "train") -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in lines if r["split"] == split]


def assert_same_trajectory(
    expected: list[dict],
    got: list[dict],
    keys: tuple[str, ...] = ("loss", "grad_norm", "lr", "consumed_samples"),
) -> None:
    assert [r["iteration"] for r in got] == [r["iteration"] for r in expected]
    for key in keys:
        assert [r[key] for r in got] == [r[key] for r in expected], key


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory, data_prefix: str) -> pathlib.Path:
    """The uninterrupted 12-iteration run; returns its directory (metrics.jsonl, tb/)."""
    out = tmp_path_factory.mktemp("reference")
    proc = run_cli(
        base_args(data_prefix)
        + ["--metrics-file", str(out / "metrics.jsonl"), "--tensorboard-dir", str(out / "tb")]
    )
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
def test_reference_run_logs(reference_run: pathlib.Path) -> None:
    train = records(reference_run / "metrics.jsonl")
    assert [r["iteration"] for r in train] == list(range(1, TRAIN_ITERS + 1))
    assert [r["consumed_samples"] for r in train] == [4 * k for k in range(1, 13)]
    assert train[-1]["loss"] < train[0]["loss"]  # it learns the unigram distribution at least
    for r in train:
        assert r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0 and r["grad_norm"] > 0
    valid = records(reference_run / "metrics.jsonl", "valid")
    assert [r["iteration"] for r in valid] == [4, 8, 12]
    assert list((reference_run / "tb").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_exit_interval_then_resume_is_exact(
    tmp_path: pathlib.Path,
    data_prefix: str,
    reference_run: pathlib.Path,
    capsys: pytest.CaptureFixture,
) -> None:
    """In this process (the subprocess runs are the reference and the SIGTERM test)."""
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    common = base_args(data_prefix) + ["--save", str(save), "--metrics-file", str(metrics)]
    status, _, stderr = run_in_process(common + ["--exit-interval", "6"], capsys)
    assert status == 0, stderr
    assert read_latest_iteration(save) == 6
    assert load_train_state(save)["consumed_samples"] == 24
    status, stdout, stderr = run_in_process(common + ["--load", str(save)], capsys)
    assert status == 0, stderr
    assert "loaded" in stdout and read_latest_iteration(save) == TRAIN_ITERS
    reference = reference_run / "metrics.jsonl"
    assert_same_trajectory(records(reference), records(metrics))
    assert_same_trajectory(records(reference, "valid"), records(metrics, "valid"), ("loss",))


@pytest.mark.slow
def test_sigterm_saves_then_resumes_exactly(
    tmp_path: pathlib.Path, data_prefix: str, reference_run: pathlib.Path
) -> None:
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    # Evaluating 15 batches after every iteration slows iterations without changing training.
    slow = base_args(data_prefix) + [
        "--save",
        str(save),
        "--metrics-file",
        str(metrics),
        "--eval-interval",
        "1",
        "--eval-iters",
        "15",
    ]
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, *slow],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=CPU_ONLY_ENV,
    )
    deadline = time.monotonic() + 60
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, "no metrics line appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    stopped_at = read_latest_iteration(save)
    assert stopped_at is not None and 1 <= stopped_at < TRAIN_ITERS, stdout
    assert "SIGTERM" in stdout
    assert load_checkpoint_metadata(save)["iteration"] == stopped_at
    assert load_train_state(save)["consumed_samples"] == 4 * stopped_at
    resumed = run_cli(
        base_args(data_prefix)
        + ["--save", str(save), "--load", str(save), "--metrics-file", str(metrics)]
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_same_trajectory(records(reference_run / "metrics.jsonl"), records(metrics))


def _without(args: list[str], flag: str, values: int = 1) -> list[str]:
    i = args.index(flag)
    return args[:i] + args[i + 1 + values :]


def _other_checkpoint(tmp_path: pathlib.Path) -> str:
    """A checkpoint of a 2-layer, 128-wide model (only its metadata is read before failing)."""
    config = model_preset("tiny").replace(num_layers=2, hidden_size=128)
    save_checkpoint(tmp_path / "other", 3, config, {})
    return str(tmp_path / "other")


BAD_INPUTS = {
    "unknown flag": (lambda a, t: a + ["--foo"], "unrecognized arguments: --foo"),
    "bad value": (lambda a, t: a + ["--micro-batch-size", "two"], "invalid int value: 'two'"),
    "heads do not divide hidden": (
        lambda a, t: a + ["--num-attention-heads", "5"],
        "--num-attention-heads 5 does not divide --hidden-size 64",
    ),
    "global batch not divisible": (
        lambda a, t: a + ["--global-batch-size", "5"],
        "--global-batch-size 5 is not divisible by --micro-batch-size",
    ),
    "no data path": (lambda a, t: _without(a, "--data-path"), "no training data"),
    "missing data file": (
        lambda a, t: a + ["--data-path", str(t / "nothing")],
        "nothing.idx does not exist",
    ),
    "no tokenizer model": (
        lambda a, t: a + ["--tokenizer-type", "SentencePieceTokenizer"],
        "needs --tokenizer-model",
    ),
    "tokenizer model missing": (
        lambda a, t: (
            a
            + [
                "--tokenizer-type",
                "SentencePieceTokenizer",
                "--tokenizer-model",
                str(t / "none.model"),
            ]
        ),
        "does not exist",
    ),
    "tokenizer smaller than data": (
        lambda a, t: a + ["--vocab-size", "100"],
        "holds token id 300 but the tokenizer has 101 tokens",
    ),
    "preset vocab smaller than tokenizer": (
        lambda a, t: a + ["--vocab-size", "1000"],
        "512-token model vocabulary but the tokenizer has",
    ),
    "seq beyond positions": (
        lambda a, t: a + ["--seq-length", "300"],
        "--seq-length 300 exceeds the model's --max-position-embeddings",
    ),
    "fp16 and bf16": (
        lambda a, t: a + ["--fp16", "--bf16"],
        "--fp16 and --bf16 both set the training dtype",
    ),
    "load of another shape": (
        lambda a, t: a + ["--load", _other_checkpoint(t)],
        "differs from the configured one in num_layers (checkpoint 2, configured 4), "
        "hidden_size (checkpoint 128, configured 64)",
    ),
    "load without checkpoint": (lambda a, t: a + ["--load", str(t / "empty")], "does not exist"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_with_one_line(
    case: str, tmp_path: pathlib.Path, data_prefix: str, capsys: pytest.CaptureFixture
) -> None:
    edit, expected = BAD_INPUTS[case]
    save, metrics = tmp_path / "save", tmp_path / "metrics.jsonl"
    save.mkdir()
    (save / "keep.txt").write_text("untouched")
    metrics.write_text('{"old": true}\n')
    args = edit(
        base_args(data_prefix)
        + [
            "--save",
            str(save),
            "--metrics-file",
            str(metrics),
            "--tensorboard-dir",
            str(tmp_path / "tb"),
        ],
        tmp_path,
    )
    status, stdout, stderr = run_in_process(args, capsys)
    assert status == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert expected in lines[0]
    assert sorted(p.name for p in save.iterdir()) == ["keep.txt"]
    assert metrics.read_text() == '{"old": true}\n'
    assert not (tmp_path / "tb").exists()
