"""tools/checkpoint_info.py: every iteration listed and verified, text and JSON, exit status."""

from __future__ import annotations

import io as stdio
import json
import pathlib
import runpy
import sys

import pytest
import torch

from megatron_het.checkpoint.info import NOT_CHECKSUMMED
from megatron_het.checkpoint.io import (
    METADATA_FILE,
    TRACKER_FILE,
    TensorPiece,
    begin_checkpoint,
    save_checkpoint,
    write_model_shard,
)
from megatron_het.checkpoint.sharded import reshard_checkpoint
from megatron_het.errors import UserError
from tests.unit.test_checkpoint_integrity import CONFIG, pp2_plan
from tests.unit.test_checkpoint_integrity import weights as seeded_weights
from tools.checkpoint_info import main

REPO = pathlib.Path(__file__).resolve().parents[2]
PLAN = pp2_plan("fast", "slow")


def weights() -> dict[str, torch.Tensor]:
    return seeded_weights(0)


def run(*argv: str) -> tuple[int, str]:
    out = stdio.StringIO()
    status = main(list(argv), out=out)
    return status, out.getvalue()


@pytest.fixture
def save_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """Iterations 2 and 4 committed (4 the latest) and an interrupted save of iteration 6."""
    for iteration in (2, 4):
        save_checkpoint(
            tmp_path,
            iteration,
            CONFIG,
            weights(),
            {"iteration": iteration},
            {"consumed_samples": 8 * iteration},
        )
    staging = begin_checkpoint(tmp_path, 6)
    write_model_shard(staging, 0, {n: TensorPiece.full(t) for n, t in weights().items()})
    return tmp_path


def test_text_lists_every_iteration(save_dir: pathlib.Path) -> None:
    status, text = run(str(save_dir))
    assert status == 0
    assert f"{save_dir}: 3 iteration(s); tracker: iteration 4" in text
    assert "iteration 2 (committed): " in text
    assert "iteration 4 (committed) [latest]: " in text
    assert "iteration 6 (uncommitted): " in text
    assert "consumed samples: 16" in text and "consumed samples: 32" in text
    assert "plan: single process" in text
    assert text.count("model_shard_00000.pt") == 3
    assert "not recorded (its write did not finish)" in text
    assert text.strip().endswith("latest committed iteration 4 verifies")


def test_json_has_sizes_and_verification(save_dir: pathlib.Path) -> None:
    status, text = run(str(save_dir), "--json")
    report = json.loads(text)
    assert status == 0 and report["tracker"] == 4 and report["latest_verified"] is True
    by_iteration = {i["iteration"]: i for i in report["iterations"]}
    assert [by_iteration[i]["state"] for i in (2, 4, 6)] == [
        "committed",
        "committed",
        "uncommitted",
    ]
    latest = by_iteration[4]
    assert latest["latest"] and latest["verified"]
    on_disk = sum(f.stat().st_size for f in (save_dir / "iter_0000004").glob("*.pt"))
    assert latest["total_bytes"] == on_disk
    assert {f["name"]: f["status"] for f in latest["files"]} == {
        "model_shard_00000.pt": "OK",
        "train_state_00000.pt": "OK",
    }
    assert not by_iteration[6]["verified"]


def test_a_damaged_latest_fails_and_an_older_one_is_flagged(save_dir: pathlib.Path) -> None:
    older = save_dir / "iter_0000002" / "train_state_00000.pt"
    older.write_bytes(older.read_bytes()[:-1])
    status, text = run(str(save_dir), "--json")
    report = json.loads(text)
    assert status == 0  # only the latest decides
    assert not [i for i in report["iterations"] if i["iteration"] == 2][0]["verified"]
    shard = save_dir / "iter_0000004" / "model_shard_00000.pt"
    data = bytearray(shard.read_bytes())
    data[200] ^= 1
    shard.write_bytes(bytes(data))
    status, text = run(str(save_dir))
    assert status == 1
    assert "model_shard_00000.pt" in text and "checksum mismatch" in text
    assert "latest committed iteration 4 does NOT verify (model_shard_00000.pt: checksum" in text


def test_one_iteration_directory(save_dir: pathlib.Path) -> None:
    status, text = run(str(save_dir / "iter_0000002"), "--json")
    report = json.loads(text)
    assert status == 0 and report["latest_committed"] == 2
    assert [i["iteration"] for i in report["iterations"]] == [2]
    assert report["iterations"][0]["latest"] is False  # the tracker names 4


def test_a_plans_checkpoint_shows_its_stages(tmp_path: pathlib.Path) -> None:
    save_checkpoint(tmp_path / "single", 3, CONFIG, weights(), {"iteration": 3})
    reshard_checkpoint(tmp_path / "single", tmp_path / "pp2", PLAN)
    status, text = run(str(tmp_path / "pp2"))
    assert status == 0
    assert "plan: 2 rank(s), dp=1, micro batch size 1" in text
    assert (
        "pipeline 0: 2 stage(s), 2 micro-batches: fast tp1 layers 0-0 ranks 0 | "
        "slow tp1 layers 1-1 ranks 1"
    ) in text
    assert text.count(" OK") == 4  # two model shards, two training states


def test_checkpoints_without_records_and_missing_latest(tmp_path: pathlib.Path) -> None:
    path = save_checkpoint(tmp_path, 1, CONFIG, weights())
    metadata = json.loads((path / METADATA_FILE).read_text())
    del metadata["files"]
    (path / METADATA_FILE).write_text(json.dumps(metadata))
    status, text = run(str(tmp_path))
    assert status == 0 and "model_shard_00000.pt  " in text and NOT_CHECKSUMMED in text
    (path / "model_shard_00000.pt").unlink()
    assert run(str(tmp_path))[0] == 1
    (tmp_path / TRACKER_FILE).write_text("7\n")  # names a directory that is gone
    status, text = run(str(tmp_path))
    assert status == 1 and "iteration whose directory is missing" in text


def test_nothing_to_list(tmp_path: pathlib.Path) -> None:
    with pytest.raises(UserError, match="no checkpoint in"):
        main([str(tmp_path)])
    with pytest.raises(UserError, match="is not a directory"):
        main([str(tmp_path / "absent")])


def test_the_script_exits_with_mains_status(
    save_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    shard = save_dir / "iter_0000004" / "model_shard_00000.pt"
    shard.write_bytes(b"")
    monkeypatch.setattr(sys, "argv", ["checkpoint_info.py", str(save_dir)])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(REPO / "tools" / "checkpoint_info.py"), run_name="__main__")
    assert info.value.code == 1
    assert "truncated: 0 of" in capsys.readouterr().out
