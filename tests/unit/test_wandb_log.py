"""--wandb-project: the run's scalars in wandb (offline here), the same ones tensorboard gets;
its flag mistakes and a missing wandb as one line before training."""

from __future__ import annotations

import os
import pathlib
import struct
import subprocess
import sys
from collections.abc import Iterator

import pytest

from megatron_het.training import wandb_log
from tests.test_pretrain_cli import run_in_process

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny", "--mock-data", "--tokenizer-type", "NullTokenizer"]
TINY += ["--vocab-size", "300", "--seq-length", "16", "--micro-batch-size", "2"]
TINY += ["--global-batch-size", "2", "--train-iters", "3", "--eval-interval", "3"]
TINY += ["--eval-iters", "1"]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--wandb-exp-name", "x"], "--wandb-exp-name applies with --wandb-project; add it"),
        (["--wandb-project", "p"], "--wandb-project needs --wandb-exp-name"),
    ],
)
def test_flag_mistakes_are_one_line(capsys, flags: list[str], words: str) -> None:
    status, out, err = run_in_process([*TINY, *flags], capsys)
    assert status != 0
    (line,) = err.strip().splitlines()
    assert words in line, line
    assert "iteration 1" not in out


def test_without_wandb_the_run_stops_before_training(capsys, monkeypatch) -> None:
    monkeypatch.setattr(wandb_log.importlib.util, "find_spec", lambda name: None)
    status, out, err = run_in_process(
        [*TINY, "--wandb-project", "p", "--wandb-exp-name", "e"], capsys
    )
    assert status != 0
    (line,) = err.strip().splitlines()
    assert "--wandb-project needs the wandb package" in line
    assert "iteration 1" not in out


def wandb_records(path: pathlib.Path) -> Iterator[bytes]:
    """The records of a wandb run file: a 7-byte header, then LevelDB-style log blocks of
    32 KiB (each record: crc32c, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    raw, pos, block, pieces = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            pos += left - 7
        elif kind == 1:
            yield data
        elif kind == 2:
            pieces = data
        elif kind == 3:
            pieces += data
        elif kind == 4:
            yield pieces + data


def test_an_offline_run_logs_what_tensorboard_gets(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed")
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb.proto import wandb_internal_pb2

    board, save = tmp_path / "board", tmp_path / "wb"
    argv = [*TINY, "--tensorboard-dir", str(board), "--wandb-project", "het"]
    argv += ["--wandb-exp-name", "tiny", "--wandb-save-dir", str(save)]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    done = subprocess.run(
        [sys.executable, "pretrain_llama.py", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (run_file,) = save.glob("wandb/offline-run-*/run-*.wandb")
    logged: dict[str, dict[int, float]] = {}
    names = []
    for data in wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "run":
            names.append((record.run.project, record.run.display_name))
        if record.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            for key, value in items.items():
                if not key.startswith("_"):
                    logged.setdefault(key, {})[int(items["_step"])] = value
    assert names == [("het", "tiny")]
    events = EventAccumulator(str(board))
    events.Reload()
    board_scalars = {
        tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]
    }
    assert set(logged) == set(board_scalars)
    assert "lm loss" in logged and "lm loss validation" in logged
    for tag, steps in board_scalars.items():
        assert logged[tag] == pytest.approx(steps, rel=1e-6), tag
