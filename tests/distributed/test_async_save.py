"""--async-save: background writes, collective commits, failures, crashes and exact resumes.

The first tests drive :class:`AsyncCheckpointSaver` over a one-rank stand-in for the world (no
processes). The others run the tiny model on 2 forked gloo ranks (pp=2): a run saving in the
background writes checkpoints byte-identical to a run saving synchronously (its writer is held
until training has moved past the save point, so the snapshot must not follow the live
tensors), a run resumed from the background-written checkpoint has the synchronous run's losses,
a writer's error fails every rank with one line, and a rank killed mid-write leaves the previous
checkpoint the latest.
"""

from __future__ import annotations

import hashlib
import io as stdio
import json
import os
import pathlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from megatron_het.arguments import parse_run_config
from megatron_het.checkpoint.async_save import AsyncCheckpointSaver, PendingCommit
from megatron_het.checkpoint.io import (
    METADATA_FILE,
    TensorPiece,
    begin_checkpoint,
    read_latest_iteration,
    save_checkpoint,
)
from megatron_het.checkpoint.rank_files import RankFiles
from megatron_het.checkpoint.sharded import SHARED_STAGING_TAG
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.training.stop import StopRequest
from tests.distributed.harness import RankFailure, run_ranks
from tools.checkpoint_info import main as checkpoint_info

CONFIG = ModelConfig(
    num_layers=1,
    hidden_size=8,
    ffn_hidden_size=16,
    num_attention_heads=2,
    num_query_groups=1,
    vocab_size=11,
    name="async-unit",
)
ONE_RANK = ParallelPlan.from_dict(
    {
        "format": "megatron_het.plan/1",
        "micro_batch_size": 1,
        "pipelines": [
            {
                "micro_batches": 1,
                "stages": [{"accelerator": "cpu", "tp": 1, "layers": [0, 1], "ranks": [0]}],
            }
        ],
    }
)
BASE = [
    "--model",
    "tiny",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "300",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-warmup-iters",
    "2",
    "--lr-decay-style",
    "cosine",
    "--clip-grad",
    "1.0",
    "--adam-eps",
    "1e-6",
    "--seed",
    "7",
    "--eval-interval",
    "100",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
    "--pipeline-model-parallel-size",
    "2",
]
SAVING = ["--train-iters", "6", "--save-interval", "2"]


# ---- the saver over a one-rank world --------------------------------------------------------
class OneRankWorld:
    """The world of a single rank: every reduction returns its input."""

    rank, size = 0, 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        del tensor, op


def start_save(saver: AsyncCheckpointSaver, save_dir: pathlib.Path, iteration: int) -> None:
    staging = begin_checkpoint(save_dir, iteration, SHARED_STAGING_TAG)
    pieces = {"embedding.weight": TensorPiece.full(torch.full((11, 8), float(iteration)))}
    saver.start(
        RankFiles(staging, 0, pieces, None, {"iteration": iteration}),
        PendingCommit(save_dir, iteration, CONFIG, ONE_RANK, False, True, {"x": 1}),
    )


def test_commit_waits_for_the_writer(tmp_path: pathlib.Path) -> None:
    release = threading.Event()
    saver = AsyncCheckpointSaver(
        OneRankWorld(), torch.device("cpu"), before_file=lambda iteration, name: release.wait(10)
    )
    start_save(saver, tmp_path, 3)
    with pytest.raises(RuntimeError, match="iteration 3 is still pending"):
        saver.start(
            RankFiles(tmp_path, 0, {}, None, None),
            PendingCommit(tmp_path, 4, CONFIG, ONE_RANK, False, False, None),
        )
    assert saver.poll() is None and saver.pending is not None  # still writing
    assert read_latest_iteration(tmp_path) is None
    release.set()
    report = saver.finish()
    assert report.iteration == 3 and report.path == tmp_path / "iter_0000003"
    assert report.bytes == sum(f.stat().st_size for f in report.path.glob("*.pt"))
    assert read_latest_iteration(tmp_path) == 3 and saver.pending is None
    metadata = json.loads((report.path / METADATA_FILE).read_text())
    assert sorted(metadata["files"]) == ["model_shard_00000.pt", "train_state_00000.pt"]
    written = torch.full((11, 8), 3.0)  # the background writer records its pieces' digests
    assert metadata["files"]["model_shard_00000.pt"]["tensors"] == {
        "embedding.weight": hashlib.sha256(written.numpy().tobytes()).hexdigest()
    }
    assert saver.poll() is None and saver.finish() is None  # nothing pending


def test_a_writer_error_is_one_line_and_keeps_the_previous_checkpoint(
    tmp_path: pathlib.Path,
) -> None:
    save_checkpoint(tmp_path, 1, CONFIG, {})

    def fail(iteration: int, name: str) -> None:
        raise OSError("No space left on device")

    saver = AsyncCheckpointSaver(OneRankWorld(), torch.device("cpu"), before_file=fail)
    start_save(saver, tmp_path, 2)
    with pytest.raises(UserError) as info:
        saver.finish()
    assert str(info.value) == (
        "writing checkpoint iteration 2 in the background failed on rank 0 (OSError: No space "
        "left on device); the latest checkpoint is still iteration 1"
    )
    assert read_latest_iteration(tmp_path) == 1
    saver.close()
    save_checkpoint(tmp_path, 3, CONFIG, {})  # the next save removes the staging directory
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001",
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]


def test_a_hung_writer_fails_after_the_timeout(tmp_path: pathlib.Path) -> None:
    release = threading.Event()
    saver = AsyncCheckpointSaver(
        OneRankWorld(),
        torch.device("cpu"),
        timeout_s=0.1,
        before_file=lambda iteration, name: release.wait(10),
    )
    start_save(saver, tmp_path, 5)
    with pytest.raises(
        UserError,
        match=r"\(TimeoutError: the writer did not finish within 0.1 "
        r"s\); there is no committed checkpoint yet",
    ):
        saver.finish()
    release.set()
    saver.close()
    assert read_latest_iteration(tmp_path) is None


# ---- whole runs on 2 ranks ------------------------------------------------------------------
def records(path: pathlib.Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for line in path.read_text().splitlines()
        if json.loads(line)["split"] == "train"
    ]


def files_of(directory: pathlib.Path) -> dict[str, dict]:
    return json.loads((directory / METADATA_FILE).read_text())["files"]


def _pretrain_worker(rank: int, world_size: int, argv: list[str]) -> str:
    from megatron_het.training import pretrain_on_world

    out = stdio.StringIO()
    pretrain_on_world(parse_run_config(argv), world_size, out=out)
    return out.getvalue()


def _composed_worker(rank: int, world_size: int, argv: list[str], hook_name: str) -> dict:
    """The run's own steps, with a writer hook: ``hold`` keeps iteration 2's writer until
    training is past iteration 2, ``fail`` raises on rank 1 at iteration 4, ``kill`` ends rank
    0's process while it writes iteration 4."""
    from megatron_het.comm import UnifiedCommunicator
    from megatron_het.training.checkpointing import CheckpointSaver, load
    from megatron_het.training.loop import train
    from megatron_het.training.setup import prepare_run
    from megatron_het.training.trainer import build_trainer

    setup = prepare_run(parse_run_config(argv), world_size)
    comm = UnifiedCommunicator.from_cluster(setup.cluster, bridge=setup.run.parallel.bridge)
    trainer = build_trainer(setup, comm)
    result: dict[str, Any] = {"load": load(trainer) if setup.load_dir is not None else None}

    def hook(iteration: int, name: str) -> None:
        if hook_name == "hold" and iteration == 2 and name.startswith("model_shard"):
            deadline = time.monotonic() + 30
            while trainer.progress.iteration <= 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            result["seen_while_writing_2"] = trainer.progress.iteration
        elif hook_name == "fail" and iteration == 4 and rank == 1:
            raise OSError("No space left on device")
        elif (
            hook_name == "kill" and iteration == 4 and rank == 0 and name.startswith("optim_shard")
        ):
            os._exit(17)  # its model shard is written, the rest is not

    try:
        train(trainer, StopRequest(), saver=CheckpointSaver(trainer, before_file=hook))
    finally:
        trainer.optimizer.close()
    return result


def run2(fn: Callable, *args: Any) -> list:
    return run_ranks(fn, 2, *args, timeout=120)


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    """(save directory, metrics file) of a run saving synchronously at iterations 2, 4, 6."""
    root = tmp_path_factory.mktemp("sync")
    logs = run2(
        _pretrain_worker,
        [
            *BASE,
            *SAVING,
            "--save",
            str(root / "save"),
            "--metrics-file",
            str(root / "metrics.jsonl"),
        ],
    )
    text = "".join(logs)
    assert text.count("saved checkpoint at iteration") == 3 and "GB/s)" in text
    return root / "save", root / "metrics.jsonl"


@pytest.mark.slow
def test_background_checkpoints_equal_synchronous_ones(
    tmp_path: pathlib.Path, sync_run: tuple
) -> None:
    sync_dir, sync_metrics = sync_run
    save = tmp_path / "async"
    results = run2(_composed_worker, [*BASE, *SAVING, "--save", str(save), "--async-save"], "hold")
    # Training went on while iteration 2 was written, yet every file is byte-identical.
    assert all(r["seen_while_writing_2"] > 2 for r in results)
    assert read_latest_iteration(save) == 6
    for iteration in ("iter_0000002", "iter_0000004", "iter_0000006"):
        assert files_of(save / iteration) == files_of(sync_dir / iteration), iteration
    # Resumed from the background-written iteration 2: the synchronous run's losses exactly.
    metrics = tmp_path / "resumed.jsonl"
    logs = run2(
        _pretrain_worker,
        [
            *BASE,
            "--train-iters",
            "6",
            "--load",
            str(save / "iter_0000002"),
            "--metrics-file",
            str(metrics),
        ],
    )
    assert [r["iteration"] for r in records(metrics)] == [3, 4, 5, 6]
    assert [r["loss"] for r in records(metrics)] == [r["loss"] for r in records(sync_metrics)][2:]
    assert "> loaded" in "".join(logs)


def test_async_run_logs_blocked_and_background_times(tmp_path: pathlib.Path) -> None:
    logs = run2(
        _pretrain_worker,
        [
            *BASE,
            "--train-iters",
            "4",
            "--save-interval",
            "2",
            "--save",
            str(tmp_path),
            "--async-save",
        ],
    )
    text = "".join(logs)
    assert text.count("training blocked") == 2
    assert text.count("(background write") == 2 and "GB/s; committed" in text
    assert read_latest_iteration(tmp_path) == 4


def test_a_writer_error_fails_every_rank(tmp_path: pathlib.Path) -> None:
    with pytest.raises(RankFailure) as info:
        run2(_composed_worker, [*BASE, *SAVING, "--save", str(tmp_path), "--async-save"], "fail")
    text = str(info.value)
    expected = (
        "UserError: writing checkpoint iteration 4 in the background failed on rank 1 "
        "({}); the latest checkpoint is still iteration 2"
    )
    assert expected.format("OSError: No space left on device") in text  # rank 1's own
    assert expected.format("see its error") in text  # rank 0
    assert read_latest_iteration(tmp_path) == 2


@pytest.mark.slow
def test_a_rank_killed_mid_write_keeps_the_previous_checkpoint(
    tmp_path: pathlib.Path, sync_run: tuple
) -> None:
    save = tmp_path / "save"
    with pytest.raises(RankFailure, match="rank 0 failed:\nworker exited with code 17"):
        run2(_composed_worker, [*BASE, *SAVING, "--save", str(save), "--async-save"], "kill")
    assert read_latest_iteration(save) == 2
    staging = save / f".staging_iter_0000004_{SHARED_STAGING_TAG}"
    assert (staging / "model_shard_00000.pt").is_file()
    assert not (staging / "optim_shard_00000.pt").exists()
    assert checkpoint_info([str(save)], out=stdio.StringIO()) == 0  # iteration 2 verifies
    # Resume in the same directory: the stale staging directory goes at the next save and the
    # checkpoints written after the resume equal the uninterrupted synchronous run's.
    results = run2(
        _composed_worker,
        [*BASE, *SAVING, "--save", str(save), "--load", str(save), "--async-save"],
        "none",
    )
    assert "GB/s" in results[0]["load"] and "loaded checkpoint" in results[0]["load"]
    assert sorted(p.name for p in save.iterdir()) == [
        "iter_0000002",
        "iter_0000004",
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
    ]
    sync_dir = sync_run[0]
    for iteration in ("iter_0000004", "iter_0000006"):
        assert files_of(save / iteration) == files_of(sync_dir / iteration), iteration
