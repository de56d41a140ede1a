"""Megatron-LM ``--ckpt-format torch_dist`` checkpoints against megatron-core itself: a GPTModel
(local spec, GQA, tied and untied) saved by megatron-core's ``dist_checkpointing.save`` as
Megatron-LM's trainer calls it converts to a model of ours with the same logits; ours written as
torch_dist loads through ``dist_checkpointing.load`` (strict) into a fresh GPTModel with the same
logits, from an index of the same keys and global shapes megatron-core writes; ours -> torch_dist
-> ours is bitwise; torn, truncated and hostile directories are refused with one line, with
nothing written.

megatron-core 0.16's torch_dist saver writes through an asynchronous writer that calls
``torch.cuda.synchronize`` and forks writer processes that need psutil, so on CPU
:class:`SyncTorchDistSave` keeps everything else of the saver (its ShardedTensor translation
and MCoreSavePlanner) and writes with torch's synchronous FileSystemWriter: the same files and
index.
"""

from __future__ import annotations

import argparse
import pathlib
import pickle
import shutil

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (requirements.txt)")
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from megatron.core.dist_checkpointing.validation import StrictHandling

from megatron_het import load_pretrained
from megatron_het.checkpoint.io import save_checkpoint
from megatron_het.checkpoint.reader import load_model_state
from megatron_het.errors import UserError
from megatron_het.model.llama import build_model
from tests.unit.test_megatron_lm_parity import (
    TOKENS,
    VOCAB,
    H,
    cpu_forward,
    megatron_args,
    megatron_model,
    our_config,
)
from tests.unit.test_megatron_lm_parity import megatron_world as megatron_world  # a fixture
from tools import convert_checkpoint

pytestmark = pytest.mark.slow  # megatron-core takes seconds to import


class SyncTorchDistSave(TorchDistSaveShardedStrategy):
    """megatron-core's torch_dist saver with torch's synchronous file writer (see above)."""

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        dcp.save(
            mcore_to_pyt_state_dict(flat, False),
            storage_writer=dcp.FileSystemWriter(checkpoint_dir),
            planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
        )


def mcore_save(state: dict, directory: pathlib.Path) -> pathlib.Path:
    """``state`` saved by every rank of the world into ``directory`` (made by rank 0)."""
    if dist.get_rank() == 0:
        directory.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(
        state,
        str(directory),
        sharded_strategy=SyncTorchDistSave("torch_dist", 1),
        content_metadata={"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
    )
    return directory


def megatron_save(model, root: pathlib.Path, iteration: int, tied: bool) -> pathlib.Path:
    """``model`` saved as Megatron-LM's trainer saves torch_dist (megatron/training/
    checkpointing.py): args, iteration and scheduler in common.pt, the model's sharded state,
    an RNG ShardedObject and optimizer tensors next to it, then the tracker."""
    args = megatron_args(tied)
    args.ckpt_format = "torch_dist"
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model.sharded_state_dict(),
        "opt_param_scheduler": {"num_steps": iteration},
        "rng_state": ShardedObject("rng_state", [{"seed": 1}], (1, 1), (0, 0), replica_id=0),
        "optimizer": {
            "exp_avg": ShardedTensor.from_rank_offsets(
                "optimizer.state.exp_avg.decoder.final_layernorm.weight", torch.ones(H)
            )
        },
        "num_floating_point_operations_so_far": 0,
    }
    directory = mcore_save(state, root / f"iter_{iteration:07d}")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return directory


def convert(source: str, target: str, load: pathlib.Path, save: pathlib.Path, *flags: str):
    convert_checkpoint.main(
        ["--source-format", source, "--target-format", target]
        + ["--load-dir", str(load), "--save-dir", str(save), *flags]
    )


def save_ours(root: pathlib.Path, tied: bool):
    ours = build_model(our_config(tied), seed=11).eval()
    save_checkpoint(root / "ours", 4, ours.config, ours.state_dict())
    return ours


def index(directory: pathlib.Path) -> dict[str, tuple[int, ...] | None]:
    """Key -> global shape (None for an object) of a torch_dist directory, as megatron-core
    reads it."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    return {
        k: tuple(getattr(v, "size", ()) or ()) or None
        for k, v in metadata.state_dict_metadata.items()
    }


@pytest.mark.parametrize("tied", [False, True])
def test_megatron_core_torch_dist_to_ours(tmp_path, megatron_world, tied: bool) -> None:
    torch.manual_seed(5)
    model = megatron_model(tied)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    megatron_save(model, tmp_path / "mlm", 20, tied)
    convert("megatron", "megatron_het", tmp_path / "mlm", tmp_path / "ours")
    ours = load_pretrained(str(tmp_path / "ours"))
    assert ours.config.vocab_size == VOCAB and ours.config.tie_embeddings == tied
    with torch.no_grad():
        got = ours(TOKENS)
    want = cpu_forward(model, TOKENS)[..., :VOCAB]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_ours_to_megatron_core_torch_dist(tmp_path, megatron_world, tied: bool) -> None:
    ours = save_ours(tmp_path, tied)
    convert(
        "megatron_het",
        "megatron",
        tmp_path / "ours",
        tmp_path / "mlm",
        "--ckpt-format",
        "torch_dist",
    )
    directory = tmp_path / "mlm/iter_0000004"
    # The same keys and global shapes as megatron-core's own save of this model, so every TP/PP
    # degree megatron-core loads its own saves at loads ours.
    model = megatron_model(tied)
    reference = mcore_save({"model": model.sharded_state_dict()}, tmp_path / "reference")
    assert index(directory) == index(reference)
    with torch.serialization.safe_globals([argparse.Namespace]):
        loaded = dist_checkpointing.load(
            {"model": model.sharded_state_dict()}, str(directory), strict=StrictHandling.RAISE_ALL
        )
    model.load_state_dict(loaded["model"], strict=True)
    assert loaded["iteration"] == 4 and loaded["args"].ckpt_format == "torch_dist"
    with torch.no_grad():
        want = ours(TOKENS)
    got = cpu_forward(model, TOKENS)
    torch.testing.assert_close(got[..., :VOCAB], want, rtol=0, atol=1e-4)


def test_ours_torch_dist_ours_is_bitwise(tmp_path) -> None:
    save_ours(tmp_path, tied=False)
    convert(
        "megatron_het",
        "megatron",
        tmp_path / "ours",
        tmp_path / "mlm",
        "--ckpt-format",
        "torch_dist",
    )
    convert("megatron", "megatron_het", tmp_path / "mlm", tmp_path / "back")
    config, state = load_model_state(tmp_path / "ours")
    config_back, back = load_model_state(tmp_path / "back")
    assert config_back.replace(name=config.name) == config
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


class _Hostile:
    def __reduce__(self):
        return (print, ("this ran",))


def _truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[:-512])


def _torn_cases():
    """(how an iteration directory is broken, words its one-line error must hold)."""
    yield lambda d: _truncate(d / "__0_0.distcp"), "is truncated"
    yield lambda d: (d / "__0_0.distcp").unlink(), "is missing"
    yield lambda d: _truncate(d / ".metadata"), "damaged or truncated"
    yield lambda d: (d / ".metadata").write_bytes(pickle.dumps(_Hostile())), "could run code"
    yield lambda d: (d / ".metadata").unlink(), "save did not finish"
    yield lambda d: (d / "metadata.json").unlink(), "unfinished torch_dist save"
    yield lambda d: _truncate(d / "common.pt"), "damaged or truncated"


def test_torn_torch_dist_is_refused_in_one_line(tmp_path, capsys) -> None:
    save_ours(tmp_path, tied=True)
    to_dist = ("--ckpt-format", "torch_dist")
    convert("megatron_het", "megatron", tmp_path / "ours", tmp_path / "pristine", *to_dist)
    for case, (breaks, words) in enumerate(_torn_cases()):
        shutil.copytree(tmp_path / "pristine", tmp_path / f"mlm{case}")
        breaks(tmp_path / f"mlm{case}/iter_0000004")
        with pytest.raises(UserError, match=words) as caught:
            convert("megatron", "megatron_het", tmp_path / f"mlm{case}", tmp_path / f"out{case}")
        assert "\n" not in str(caught.value)
        assert not (tmp_path / f"out{case}").exists()
    assert "this ran" not in capsys.readouterr().out


def test_ckpt_format_applies_to_megatron_target_only(tmp_path) -> None:
    save_ours(tmp_path, tied=True)
    with pytest.raises(UserError, match="--ckpt-format applies to --target-format megatron"):
        convert(
            "megatron_het", "hf", tmp_path / "ours", tmp_path / "hf", "--ckpt-format", "torch_dist"
        )
    assert not (tmp_path / "hf").exists()
