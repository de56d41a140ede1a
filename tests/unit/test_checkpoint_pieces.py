"""Per-piece digests: loads hash only the pieces they read, and name a damaged tensor.

A checkpoint records the sha256 of every tensor piece's raw bytes; a reader checks a file's size
when it opens it and each piece's digest when it first reads it. The bytes a reader hashes are
counted (``ReadStats.verified_bytes``) and the digests it computes recorded (``verify`` is
patched), so each test says exactly which pieces were hashed.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import struct
import zipfile

import pytest
import torch

from megatron_het.checkpoint import integrity, verify
from megatron_het.checkpoint.integrity import optimizer_key, tensor_sha256
from megatron_het.checkpoint.io import METADATA_FILE, save_checkpoint
from megatron_het.checkpoint.reader import CheckpointReader, load_model_state
from megatron_het.checkpoint.reshard import stage_parameter_names, take_slice, target_slice
from megatron_het.checkpoint.sharded import reshard_checkpoint
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.model.llama import build_model
from megatron_het.parallel.plan import ParallelPlan

CONFIG = ModelConfig(
    num_layers=4,
    hidden_size=16,
    ffn_hidden_size=32,
    num_attention_heads=2,
    num_query_groups=2,
    vocab_size=23,
    name="pieces",
)


def plan(*stages: tuple[int, tuple[int, int], list[int]]) -> ParallelPlan:
    return ParallelPlan.from_dict(
        {
            "format": "megatron_het.plan/1",
            "micro_batch_size": 1,
            "pipelines": [
                {
                    "micro_batches": 2,
                    "stages": [
                        {"accelerator": "cpu", "tp": tp, "layers": list(layers), "ranks": ranks}
                        for tp, layers, ranks in stages
                    ],
                }
            ],
        }
    )


PLAN_PP2 = plan((1, (0, 2), [0]), (1, (2, 4), [1]))
PLAN_TP2 = plan((2, (0, 4), [0, 1]))


def weights(seed: int) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in build_model(CONFIG, seed=seed).named_parameters()}


def optimizer_state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "state": {
            n: {
                "step": torch.tensor(3.0),
                "exp_avg": torch.randn(w.shape, generator=generator),
                "exp_avg_sq": torch.rand(w.shape, generator=generator),
            }
            for n, w in weights(seed).items()
        },
        "param_groups": [],
    }


def save(directory: pathlib.Path, iteration: int, with_optimizer: bool = False) -> pathlib.Path:
    train = {"iteration": iteration, "consumed_samples": 4 * iteration}
    if with_optimizer:
        train["optimizer"] = optimizer_state(iteration)
    return save_checkpoint(directory, iteration, CONFIG, weights(iteration), train)


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte counts of the tensors a reader hashes, in order."""
    seen: list[int] = []

    def counting(tensor: torch.Tensor) -> str:
        seen.append(tensor.numel() * tensor.element_size())
        return tensor_sha256(tensor)

    monkeypatch.setattr(verify, "tensor_sha256", counting)
    return seen


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def flip_tensor_byte(path: pathlib.Path, tensor: torch.Tensor) -> None:
    """Flip one byte in the middle of ``tensor``'s data inside the file at ``path``."""
    data = bytearray(path.read_bytes())
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    start = data.find(raw)
    assert start > 0 and data.find(raw, start + 1) < 0, "the tensor's bytes must be unique"
    data[start + len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def stage_boxes(target: ParallelPlan, rank: int) -> dict[str, tuple]:
    role = target.rank_role(rank)
    return {
        n: target_slice(n, CONFIG, role.stage_plan.tp, role.tp_rank)
        for n in stage_parameter_names(CONFIG, role.stage_plan)
    }


def test_digests_are_the_raw_bytes_of_every_piece(tmp_path: pathlib.Path) -> None:
    path = save(tmp_path / "single", 1, with_optimizer=True)
    files = json.loads((path / METADATA_FILE).read_text())["files"]
    expected = {n: hashlib.sha256(w.numpy().tobytes()).hexdigest() for n, w in weights(1).items()}
    assert files["model_shard_00000.pt"]["tensors"] == expected
    state = optimizer_state(1)["state"]
    assert files["train_state_00000.pt"]["tensors"] == {
        f"optimizer/state/{n}/{key}": hashlib.sha256(e[key].numpy().tobytes()).hexdigest()
        for n, e in state.items()
        for key in ("step", "exp_avg", "exp_avg_sq")
    }
    # The parallel writers (here offline resharding) record the moments too, TP slices alike.
    target = reshard_checkpoint(tmp_path / "single", tmp_path / "tp2", PLAN_TP2)
    files = json.loads((target / METADATA_FILE).read_text())["files"]
    name = "layers.2.mlp.up.weight"
    box = target_slice(name, CONFIG, 2, 1)
    for moment in ("exp_avg", "exp_avg_sq"):
        piece = take_slice(state[name][moment], *box)
        assert files["optim_shard_00001.pt"]["tensors"][optimizer_key(name, moment)] == (
            hashlib.sha256(piece.numpy().tobytes()).hexdigest()
        )
    assert (
        files["model_shard_00001.pt"]["tensors"][name]
        == hashlib.sha256(take_slice(weights(1)[name], *box).numpy().tobytes()).hexdigest()
    )


def test_bf16_pieces_hash_their_stored_bytes() -> None:
    value = torch.randn(5, 3).to(torch.bfloat16)
    assert (
        tensor_sha256(value)
        == hashlib.sha256(value.view(torch.int16).numpy().tobytes()).hexdigest()
    )
    assert tensor_sha256(value.t()) == tensor_sha256(value.t().contiguous())


def test_a_pipeline_stage_hashes_only_its_layers(tmp_path: pathlib.Path, hashed) -> None:
    path = save(tmp_path, 1, with_optimizer=True)
    reader = CheckpointReader(path)
    full, state = weights(1), optimizer_state(1)["state"]
    steps = 4 * len(full)  # the training state's small tensors are checked when it is opened
    assert hashed == [4] * len(full) and reader.stats.verified_bytes == steps
    boxes = stage_boxes(PLAN_PP2, 1)  # layers 2-3 and the head of a 4-layer model
    for name, box in boxes.items():
        assert torch.equal(reader.model_slice(name, box), take_slice(full[name], *box)), name
        reader.model_slice(name, box)  # read again: hashed once
        entry = reader.optimizer_slice(name, box)
        assert torch.equal(entry["exp_avg"], state[name]["exp_avg"]), name
    needed = sum(nbytes(full[n]) for n in boxes)
    files = sum(p.stat().st_size for p in path.glob("*.pt"))
    assert sorted(hashed[len(full) :]) == sorted(nbytes(full[n]) for n in boxes for _ in range(3))
    assert reader.stats.verified_bytes == reader.stats.bytes == 3 * needed + steps
    assert 3 * needed + steps < 0.7 * files
    assert not any(n.startswith(("layers.0.", "layers.1.")) for n in boxes)


def test_a_tp_change_hashes_only_the_overlapping_pieces(tmp_path: pathlib.Path, hashed) -> None:
    save(tmp_path / "single", 1, with_optimizer=True)
    target = reshard_checkpoint(tmp_path / "single", tmp_path / "tp2", PLAN_TP2)
    hashed.clear()  # resharding read (and hashed) the source
    # Loaded as tp=1, stage 1 of pp=2: both TP shards hold a half of each of its matrices, and
    # the halves of layers 0-1 are never read.
    reader = CheckpointReader(target)
    full, state = weights(1), optimizer_state(1)["state"]
    for name, box in stage_boxes(PLAN_PP2, 1).items():
        assert torch.equal(reader.model_slice(name, box), full[name]), name
        entry = reader.optimizer_slice(name, box)
        assert torch.equal(entry["exp_avg_sq"], state[name]["exp_avg_sq"]), name
    assert reader.opened_files == [("model", 0), ("model", 1), ("optim", 0), ("optim", 1)]
    shards = sum(
        (target / f"{kind}_{r:05d}.pt").stat().st_size
        for kind in ("model_shard", "optim_shard")
        for r in (0, 1)
    )
    needed = sum(3 * nbytes(full[n]) for n in stage_boxes(PLAN_PP2, 1))
    assert reader.stats.verified_bytes == sum(hashed) == needed  # each piece once
    assert needed < 0.7 * shards


def test_a_flipped_tensor_byte_names_the_file_and_the_tensor(tmp_path: pathlib.Path) -> None:
    save(tmp_path, 1)
    path = save(tmp_path, 2)
    name = "layers.3.mlp.up.weight"
    shard = path / "model_shard_00000.pt"
    flip_tensor_byte(shard, weights(2)[name])
    reader = CheckpointReader(path)
    other = "layers.0.mlp.up.weight"  # a piece of the same file that is intact still loads
    assert torch.equal(
        reader.model_slice(other, target_slice(other, CONFIG, 1, 0)), weights(2)[other]
    )
    with pytest.raises(UserError) as info:
        reader.model_slice(name, target_slice(name, CONFIG, 1, 0))
    message = str(info.value)
    assert "\n" not in message
    assert f"checkpoint file {shard} is damaged (tensor {name} does not match its sha256" in message
    assert f"newest intact older checkpoint is {tmp_path / 'iter_0000001'}" in message
    with pytest.raises(UserError, match=f"tensor {name} does not match"):  # not skipped later
        reader.model_slice(name, target_slice(name, CONFIG, 1, 0))


def test_a_flipped_moment_byte_names_the_moment(tmp_path: pathlib.Path) -> None:
    save(tmp_path / "single", 1, with_optimizer=True)
    target = reshard_checkpoint(tmp_path / "single", tmp_path / "pp2", PLAN_PP2)
    name = "layers.2.attention.qkv.weight"
    flip_tensor_byte(
        target / "optim_shard_00001.pt", optimizer_state(1)["state"][name]["exp_avg_sq"]
    )
    with pytest.raises(
        UserError,
        match=rf"optim_shard_00001.pt is damaged \(tensor {name}/"
        r"exp_avg_sq does not match its sha256.*no older",
    ):
        CheckpointReader(target).optimizer_slice(name, target_slice(name, CONFIG, 1, 0))


def test_a_damaged_pickle_is_caught_before_loading(tmp_path: pathlib.Path) -> None:
    path = save(tmp_path, 1)
    shard = path / "model_shard_00000.pt"
    data = bytearray(shard.read_bytes())
    with zipfile.ZipFile(shard) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    header = info.header_offset  # a zip local header: 30 bytes, then its name and extra field
    name_len, extra_len = struct.unpack("<HH", data[header + 26 : header + 30])
    data[header + 30 + name_len + extra_len + info.file_size // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(
        UserError,
        match=r"model_shard_00000.pt is damaged \(its archive "
        r"structure is damaged: Bad CRC-32",
    ):
        load_model_state(tmp_path)


def test_truncation_fails_by_size_before_hashing(tmp_path: pathlib.Path, hashed) -> None:
    save(tmp_path / "single", 1, with_optimizer=True)
    target = reshard_checkpoint(tmp_path / "single", tmp_path / "pp2", PLAN_PP2)
    hashed.clear()
    shard = target / "optim_shard_00001.pt"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-64])
    name = "layers.2.mlp.down.weight"
    with pytest.raises(UserError) as info:
        CheckpointReader(target).optimizer_slice(name, target_slice(name, CONFIG, 1, 0))
    assert "\n" not in str(info.value)
    assert f"{shard} is damaged (truncated: {size - 64} of {size} bytes)" in str(info.value)
    assert hashed == []


def test_checkpoints_without_piece_digests_are_verified_by_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, hashed
) -> None:
    save(tmp_path / "single", 1, with_optimizer=True)
    target = reshard_checkpoint(tmp_path / "single", tmp_path / "pp2", PLAN_PP2)
    metadata = json.loads((target / METADATA_FILE).read_text())
    for entry in metadata["files"].values():  # the format written before pieces were recorded
        entry.pop("tensors", None)
    (target / METADATA_FILE).write_text(json.dumps(metadata))
    hashed.clear()
    whole: list[str] = []
    real = integrity.file_sha256
    monkeypatch.setattr(integrity, "file_sha256", lambda p: whole.append(p.name) or real(p))
    reader = CheckpointReader(target)
    full = weights(1)
    for name, box in stage_boxes(PLAN_PP2, 1).items():
        assert torch.equal(reader.model_slice(name, box), full[name]), name
        reader.optimizer_slice(name, box)
    assert hashed == [] and whole == ["model_shard_00001.pt", "optim_shard_00001.pt"]
    assert (
        reader.stats.verified_bytes
        == reader.stats.bytes
        == sum((target / n).stat().st_size for n in whole)
    )
    flip_tensor_byte(target / "model_shard_00001.pt", full["layers.3.mlp.up.weight"])
    with pytest.raises(UserError, match=r"model_shard_00001.pt is damaged \(checksum mismatch"):
        CheckpointReader(target).model_slice("final_norm.weight", ((0,), (16,)))
