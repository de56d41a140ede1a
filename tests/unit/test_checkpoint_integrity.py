"""File sizes and checksums in metadata.json, and loads that refuse damaged files."""

from __future__ import annotations

import hashlib
import io as stdio
import json
import pathlib

import pytest
import torch

from megatron_het.checkpoint import integrity
from megatron_het.checkpoint.integrity import HashingWriter, file_problem
from megatron_het.checkpoint.io import METADATA_FILE, save_checkpoint
from megatron_het.checkpoint.reader import CheckpointReader, load_model_state, load_train_state
from megatron_het.checkpoint.reshard import take_slice, target_slice
from megatron_het.checkpoint.sharded import reshard_checkpoint
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.model.llama import build_model
from megatron_het.parallel.plan import ParallelPlan

CONFIG = ModelConfig(
    num_layers=2,
    hidden_size=16,
    ffn_hidden_size=32,
    num_attention_heads=2,
    num_query_groups=1,
    vocab_size=23,
    name="integrity",
)


def pp2_plan(first: str = "cpu", second: str = "cpu") -> ParallelPlan:
    """Two stages of one layer each, on kinds ``first`` and ``second``."""
    return ParallelPlan.from_dict(
        {
            "format": "megatron_het.plan/1",
            "micro_batch_size": 1,
            "pipelines": [
                {
                    "micro_batches": 2,
                    "stages": [
                        {"accelerator": first, "tp": 1, "layers": [0, 1], "ranks": [0]},
                        {"accelerator": second, "tp": 1, "layers": [1, 2], "ranks": [1]},
                    ],
                }
            ],
        }
    )


PLAN_PP2 = pp2_plan()


def weights(seed: int) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in build_model(CONFIG, seed=seed).named_parameters()}


def save(directory: pathlib.Path, iteration: int) -> pathlib.Path:
    return save_checkpoint(
        directory,
        iteration,
        CONFIG,
        weights(iteration),
        {"iteration": iteration, "consumed_samples": 4 * iteration},
    )


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte(path: pathlib.Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_hashing_writer_digest_is_the_files() -> None:
    buffer = stdio.BytesIO()
    writer = HashingWriter(buffer)
    torch.save({"w": torch.arange(1000.0), "n": 3}, writer)
    data = buffer.getvalue()
    assert writer.bytes == len(data) > 4000
    assert writer.hexdigest() == hashlib.sha256(data).hexdigest()


def test_every_file_is_recorded_with_its_size_and_checksum(tmp_path: pathlib.Path) -> None:
    path = save(tmp_path, 3)
    files = json.loads((path / METADATA_FILE).read_text())["files"]
    assert sorted(files) == ["model_shard_00000.pt", "train_state_00000.pt"]
    for name, entry in files.items():
        assert entry["bytes"] == (path / name).stat().st_size
        assert entry["sha256"] == sha256(path / name)
    # Each tensor's digest too (their values: test_checkpoint_pieces.py); none in this state.
    assert sorted(files["model_shard_00000.pt"]["tensors"]) == sorted(weights(3))
    assert files["train_state_00000.pt"]["tensors"] == {}


def test_file_problem_names_what_is_wrong(tmp_path: pathlib.Path) -> None:
    path = save(tmp_path, 1) / "model_shard_00000.pt"
    entry = {"bytes": path.stat().st_size, "sha256": sha256(path)}
    assert file_problem(path, entry) is None
    flip_byte(path)
    assert file_problem(path, entry, checksum=False) is None  # same size
    assert file_problem(path, entry).startswith("checksum mismatch")
    path.write_bytes(path.read_bytes()[:10])
    assert file_problem(path, entry) == f"truncated: 10 of {entry['bytes']} bytes"
    path.unlink()
    assert file_problem(path, entry) == "missing"


def test_a_damaged_file_names_the_newest_intact_older_checkpoint(tmp_path: pathlib.Path) -> None:
    for iteration in (2, 4, 6, 8):
        save(tmp_path, iteration)
    # 8 is truncated, 6 has a flipped byte: the newest intact one before 8 is 4.
    shard = tmp_path / "iter_0000008" / "model_shard_00000.pt"
    shard.write_bytes(shard.read_bytes()[:-5])
    flip_byte(tmp_path / "iter_0000006" / "train_state_00000.pt")
    with pytest.raises(UserError) as info:
        load_model_state(tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert f"{shard} is damaged (truncated" in message
    assert f"newest intact older checkpoint is {tmp_path / 'iter_0000004'}" in message
    assert "--load" in message
    with pytest.raises(UserError, match=r"train_state_00000.pt is damaged \(its archive"):
        load_train_state(tmp_path, iteration=6)
    assert load_train_state(tmp_path, iteration=4)["consumed_samples"] == 16


def test_no_intact_older_checkpoint_is_said(tmp_path: pathlib.Path) -> None:
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / "iter_0000001" / "model_shard_00000.pt").unlink()
    flip_byte(tmp_path / "iter_0000002" / "model_shard_00000.pt")
    with pytest.raises(UserError, match=f"no older checkpoint in {tmp_path} is intact"):
        load_model_state(tmp_path)
    with pytest.raises(UserError, match="model_shard_00000.pt is missing; no older"):
        load_model_state(tmp_path, iteration=1)


def test_a_damaged_or_missing_metadata_file_names_the_intact_older_checkpoint(
    tmp_path: pathlib.Path,
) -> None:
    for iteration in (2, 4):
        save(tmp_path, iteration)
    metadata = tmp_path / "iter_0000004" / METADATA_FILE
    metadata.write_text(metadata.read_text()[:50])  # cut short mid-write by another tool
    for path in (tmp_path, tmp_path / "iter_0000004"):
        with pytest.raises(UserError) as info:
            load_model_state(path)
        message = str(info.value)
        assert "\n" not in message
        assert f"{metadata} is damaged (unreadable:" in message
        assert f"newest intact older checkpoint is {tmp_path / 'iter_0000002'}" in message
    metadata.write_text("[1, 2]")
    with pytest.raises(UserError, match=r"is damaged \(not a JSON object\); the newest intact"):
        load_model_state(tmp_path)
    metadata.unlink()  # the tracker still points at 4
    with pytest.raises(
        UserError,
        match=f"{metadata} is missing; the newest intact older "
        f"checkpoint is {tmp_path / 'iter_0000002'}",
    ):
        load_model_state(tmp_path)
    assert load_train_state(tmp_path, iteration=2)["consumed_samples"] == 8


def test_checkpoints_without_records_still_load_unverified(tmp_path: pathlib.Path) -> None:
    path = save(tmp_path, 5)
    metadata = json.loads((path / METADATA_FILE).read_text())
    del metadata["files"]
    (path / METADATA_FILE).write_text(json.dumps(metadata))
    flip_byte(path / "model_shard_00000.pt", offset=-1)  # the zip's end: no checksum notices
    config, state = load_model_state(tmp_path)
    assert config == CONFIG
    for name, value in weights(5).items():
        assert torch.equal(state[name], value), name
    # The older message for a file that cannot be read at all.
    (path / "model_shard_00000.pt").write_bytes(b"garbage")
    with pytest.raises(UserError, match="cannot read checkpoint file"):
        load_model_state(tmp_path)


def test_no_file_is_hashed_whole_and_each_piece_once(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save(tmp_path, 1)
    hashed = []
    real = integrity.file_sha256
    monkeypatch.setattr(integrity, "file_sha256", lambda p: hashed.append(p.name) or real(p))
    reader = CheckpointReader(path)
    for _ in range(2):
        for name, value in weights(1).items():
            box = ((0,) * value.dim(), tuple(value.shape))
            assert torch.equal(reader.model_slice(name, box), value)
    reader.train_state(0)
    assert hashed == []
    assert reader.stats.files == 2
    tensor_bytes = sum(v.numel() * v.element_size() for v in weights(1).values())
    assert reader.stats.bytes == reader.stats.verified_bytes == tensor_bytes
    assert tensor_bytes < (path / "model_shard_00000.pt").stat().st_size  # less its pickle


def test_resharded_checkpoint_records_files_and_reads_only_needed_ones(
    tmp_path: pathlib.Path,
) -> None:
    save(tmp_path / "single", 3)
    target = reshard_checkpoint(tmp_path / "single", tmp_path / "pp2", PLAN_PP2)
    files = json.loads((target / METADATA_FILE).read_text())["files"]
    assert sorted(files) == [
        f"{kind}_{rank:05d}.pt" for kind in ("model_shard", "train_state") for rank in (0, 1)
    ]
    for name, entry in files.items():
        assert entry["sha256"] == sha256(target / name), name
    # Rank 0's shard is damaged; a rank that needs layer 1 only (stage 1) never opens it.
    flip_byte(target / "model_shard_00000.pt")
    reader = CheckpointReader(target)
    name = "layers.1.mlp.up.weight"
    box = target_slice(name, CONFIG, 1, 0)
    assert torch.equal(reader.model_slice(name, box), take_slice(weights(3)[name], *box))
    assert reader.opened_files == [("model", 1)]
    with pytest.raises(UserError, match="model_shard_00000.pt is damaged"):
        reader.model_slice(
            "layers.0.mlp.up.weight", target_slice("layers.0.mlp.up.weight", CONFIG, 1, 0)
        )
