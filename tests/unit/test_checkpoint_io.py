"""Checkpoint files: round trip, sharded assembly, atomic commit and damaged checkpoints."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from megatron_het.checkpoint import io
from megatron_het.checkpoint.io import (
    TensorPiece,
    begin_checkpoint,
    commit_checkpoint,
    load_checkpoint_metadata,
    read_latest_iteration,
    resolve_checkpoint_dir,
    save_checkpoint,
    write_model_shard,
)
from megatron_het.checkpoint.reader import load_model_state, load_train_state
from megatron_het.config import model_preset
from megatron_het.errors import UserError

CONFIG = model_preset("tiny")


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embedding.weight": torch.randn(10, 4, generator=generator),
        "layers.0.attention.qkv.weight": torch.randn(12, 4, generator=generator),
        "final_norm.weight": torch.randn(4, generator=generator),
    }


def assert_state_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_round_trip_and_layout(tmp_path: pathlib.Path) -> None:
    train_state = {
        "iteration": 5,
        "consumed_samples": 40,
        "moments": {"w": torch.ones(3)},
        "rng": (3, tuple(range(5)), None),
    }
    path = save_checkpoint(tmp_path, 5, CONFIG, state(0), train_state, {"argv": ["--x"]})
    assert path == tmp_path / "iter_0000005"
    assert sorted(p.name for p in path.iterdir()) == [
        "metadata.json",
        "model_shard_00000.pt",
        "train_state_00000.pt",
    ]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert read_latest_iteration(tmp_path) == 5
    metadata = load_checkpoint_metadata(tmp_path)
    assert metadata["iteration"] == 5 and metadata["argv"] == ["--x"]
    assert metadata["model_config"] == CONFIG.to_dict()
    config, tensors = load_model_state(tmp_path)
    assert config == CONFIG
    assert_state_equal(tensors, state(0))
    loaded = load_train_state(path)  # an iteration directory works as well as the save dir
    assert loaded["consumed_samples"] == 40 and torch.equal(loaded["moments"]["w"], torch.ones(3))
    assert loaded["rng"] == (3, tuple(range(5)), None)


def test_latest_and_explicit_iterations(tmp_path: pathlib.Path) -> None:
    save_checkpoint(tmp_path, 2, CONFIG, state(2))
    save_checkpoint(tmp_path, 4, CONFIG, state(4))
    assert read_latest_iteration(tmp_path) == 4
    assert_state_equal(load_model_state(tmp_path)[1], state(4))
    assert_state_equal(load_model_state(tmp_path, iteration=2)[1], state(2))
    assert resolve_checkpoint_dir(tmp_path / "iter_0000002") == tmp_path / "iter_0000002"
    assert load_train_state(tmp_path) is None  # model-only checkpoint
    with pytest.raises(
        UserError,
        match="iter_0000003/metadata.json is missing; the newest intact older checkpoint "
        "is .*iter_0000002",
    ):
        resolve_checkpoint_dir(tmp_path, iteration=3)


def test_resaving_an_iteration_replaces_it(tmp_path: pathlib.Path) -> None:
    save_checkpoint(tmp_path, 3, CONFIG, state(0), {"iteration": 3})
    save_checkpoint(tmp_path, 3, CONFIG, state(1))
    assert_state_equal(load_model_state(tmp_path)[1], state(1))
    assert load_train_state(tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]


def test_assembles_tensors_from_several_shards(tmp_path: pathlib.Path) -> None:
    full = state(7)
    emb, qkv, norm = (
        full[n] for n in ("embedding.weight", "layers.0.attention.qkv.weight", "final_norm.weight")
    )
    staging = begin_checkpoint(tmp_path, 9)
    # Rank 0: rows 0..5 of the embedding, columns 0..1 of qkv, the (replicated) norm.
    write_model_shard(
        staging,
        0,
        {
            "embedding.weight": TensorPiece(emb[:6], (10, 4), (0, 0)),
            "layers.0.attention.qkv.weight": TensorPiece(qkv[:, :2], (12, 4), (0, 0)),
            "final_norm.weight": TensorPiece.full(norm),
        },
    )
    write_model_shard(
        staging,
        1,
        {
            "embedding.weight": TensorPiece(emb[6:], (10, 4), (6, 0)),
            "layers.0.attention.qkv.weight": TensorPiece(qkv[:, 2:], (12, 4), (0, 2)),
            "final_norm.weight": TensorPiece.full(norm),
        },
    )
    commit_checkpoint(
        staging,
        tmp_path,
        9,
        {
            "format_version": io.FORMAT_VERSION,
            "iteration": 9,
            "model_config": CONFIG.to_dict(),
            "num_model_shards": 2,
            "num_train_state_shards": 0,
        },
    )
    assert_state_equal(load_model_state(tmp_path)[1], full)


def test_a_missing_piece_is_reported(tmp_path: pathlib.Path) -> None:
    emb = state(0)["embedding.weight"]
    staging = begin_checkpoint(tmp_path, 1)
    write_model_shard(staging, 0, {"embedding.weight": TensorPiece(emb[:6], (10, 4), (0, 0))})
    commit_checkpoint(
        staging,
        tmp_path,
        1,
        {
            "format_version": io.FORMAT_VERSION,
            "iteration": 1,
            "model_config": CONFIG.to_dict(),
            "num_model_shards": 1,
            "num_train_state_shards": 0,
        },
    )
    with pytest.raises(UserError, match="embedding.weight is only partly covered"):
        load_model_state(tmp_path)


def test_failed_save_keeps_the_previous_checkpoint(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(tmp_path, 1, CONFIG, state(1), {"iteration": 1})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(io, "write_train_state", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, CONFIG, state(2), {"iteration": 2})
    assert read_latest_iteration(tmp_path) == 1
    assert_state_equal(load_model_state(tmp_path)[1], state(1))
    assert load_train_state(tmp_path) == {"iteration": 1}
    assert not (tmp_path / "iter_0000002").exists()


def test_killed_save_leaves_nothing_loadable_and_is_cleaned(tmp_path: pathlib.Path) -> None:
    save_checkpoint(tmp_path, 1, CONFIG, state(1))
    # A process killed mid-save: a half-written staging directory, tracker untouched.
    staging = begin_checkpoint(tmp_path, 2)
    write_model_shard(staging, 0, {n: TensorPiece.full(t) for n, t in state(2).items()})
    assert read_latest_iteration(tmp_path) == 1
    assert_state_equal(load_model_state(tmp_path)[1], state(1))
    save_checkpoint(tmp_path, 3, CONFIG, state(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001",
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "latest_checkpointed_iteration.txt").write_text("soon"), "holds 'soon'"),
        (
            lambda d: (d / "iter_0000001" / "model_shard_00000.pt").write_bytes(b"garbage"),
            r"model_shard_00000.pt is damaged \(truncated: 7 of",
        ),
        (lambda d: (d / "iter_0000001" / "model_shard_00000.pt").unlink(), "is missing"),
        (
            lambda d: (d / "iter_0000001" / "metadata.json").write_text("{"),
            r"metadata.json is damaged \(unreadable: .*; no older checkpoint in",
        ),
    ],
)
def test_damaged_checkpoints_raise_user_errors(tmp_path: pathlib.Path, damage, message) -> None:
    save_checkpoint(tmp_path, 1, CONFIG, state(1))
    damage(tmp_path)
    with pytest.raises(UserError, match=message):
        load_model_state(tmp_path)


def test_paths_without_checkpoints(tmp_path: pathlib.Path) -> None:
    assert read_latest_iteration(tmp_path) is None
    with pytest.raises(UserError, match="no checkpoint in"):
        resolve_checkpoint_dir(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        resolve_checkpoint_dir(tmp_path / "nope")


def test_metadata_is_json_with_unserialisable_values_as_text(tmp_path: pathlib.Path) -> None:
    path = save_checkpoint(tmp_path, 1, CONFIG, state(1), metadata={"where": pathlib.Path("/x")})
    assert json.loads((path / "metadata.json").read_text())["where"] == "/x"
