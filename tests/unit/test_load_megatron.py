"""``pretrain_llama.py --load`` of a Megatron-LM checkpoint (legacy and torch_dist), and Megatron-LM's load flags
(--finetune, --no-load-optim, --no-load-rng) on checkpoints of ours, single-process runs."""

from __future__ import annotations

import io
import json
import pathlib

import pytest
import torch

from megatron_het.arguments import parse_run_config
from megatron_het.checkpoint.io import resolve_checkpoint_dir
from megatron_het.checkpoint.megatron_lm import write_megatron_checkpoint
from megatron_het.checkpoint.megatron_lm_dist import write_dist_checkpoint
from megatron_het.checkpoint.megatron_lm_files import load_pickled, read_dcp_metadata
from megatron_het.checkpoint.reader import (
    full_optimizer_state,
    load_model_state,
    load_train_state,
)
from megatron_het.config import model_preset
from megatron_het.model.llama import build_model
from megatron_het.optim.lr_schedule import LRSchedule
from megatron_het.training.run import pretrain
from tests.test_pretrain_cli import run_in_process
from tools import convert_checkpoint

MEGATRON_ITERATION = 5
LR = (3e-3, 3e-4, 2, 10)  # --lr, --min-lr, --lr-warmup-iters, --lr-decay-iters
BASE = [
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
    "2",
    "--lr",
    str(LR[0]),
    "--min-lr",
    str(LR[1]),
    "--lr-warmup-iters",
    str(LR[2]),
    "--lr-decay-iters",
    str(LR[3]),
    "--seed",
    "7",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
]
TINY = ["--model", "tiny", *BASE]


def lr_at(step: int) -> float:
    return LRSchedule(LR[0], LR[1], LR[2], LR[3]).lr_at(step)


def train(argv: list[str], metrics: pathlib.Path) -> tuple[list[dict], str]:
    """A single-process run of ``argv``: its train metrics lines and its log."""
    out = io.StringIO()
    pretrain(parse_run_config([*argv, "--metrics-file", str(metrics)]), out=out)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in lines if r["split"] == "train"], out.getvalue()


def write_checkpoints(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """The same tiny weights as a Megatron-LM TP 2 x PP 2 save (iteration 5), as a torch_dist
    save of it and as our model-only checkpoint converted from the first by
    tools/convert_checkpoint.py."""
    config = model_preset("tiny")
    state = {k: v.detach().clone() for k, v in build_model(config, seed=3).state_dict().items()}
    write_megatron_checkpoint(root / "mlm", config, state, MEGATRON_ITERATION, tp_size=2, pp_size=2)
    write_dist_checkpoint(root / "mlm_dist", config, state, MEGATRON_ITERATION, tp_size=2)
    convert_checkpoint.main(
        ["--source-format", "megatron", "--target-format", "megatron_het"]
        + ["--load-dir", str(root / "mlm"), "--save-dir", str(root / "converted")]
    )
    return {
        "megatron": root / "mlm",
        "torch_dist": root / "mlm_dist",
        "converted": root / "converted",
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    return write_checkpoints(tmp_path_factory.mktemp("megatron"))


@pytest.fixture(scope="module")
def converted_run(
    checkpoints: dict[str, pathlib.Path], tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    """Two iterations from our converted checkpoint: the losses to match."""
    path = tmp_path_factory.mktemp("converted") / "metrics.jsonl"
    records, _ = train([*TINY, "--train-iters", "2", "--load", str(checkpoints["converted"])], path)
    return records


def test_megatron_checkpoint_loads_as_finetune(checkpoints, converted_run, tmp_path) -> None:
    # --use-checkpoint-args and no --model: the shape comes from the checkpoint's args.
    argv = [*BASE, "--use-checkpoint-args", "--train-iters", "2"]
    records, log = train([*argv, "--load", str(checkpoints["megatron"])], tmp_path / "m.jsonl")
    assert [r["iteration"] for r in records] == [1, 2]
    assert [r["consumed_samples"] for r in records] == [2, 4]
    assert records[0]["loss"] == pytest.approx(converted_run[0]["loss"], abs=1e-6)
    assert records[1]["loss"] == pytest.approx(converted_run[1]["loss"], abs=1e-6)
    (line,) = [text for text in log.splitlines() if "loaded checkpoint" in text]
    assert "(Megatron-LM, --ckpt-format torch, iteration 5)" in line
    assert "starts at iteration 0" in line and "indexed by position" in line
    assert "pass --no-load-optim to continue" in line


def test_torch_dist_checkpoint_loads(checkpoints, converted_run, tmp_path) -> None:
    argv = [*TINY, "--train-iters", "2", "--load", str(checkpoints["torch_dist"])]
    records, log = train(argv, tmp_path / "m.jsonl")
    assert [r["iteration"] for r in records] == [1, 2]
    assert records[0]["loss"] == pytest.approx(converted_run[0]["loss"], abs=1e-6)
    assert records[1]["loss"] == pytest.approx(converted_run[1]["loss"], abs=1e-6)
    (line,) = [text for text in log.splitlines() if "loaded checkpoint" in text]
    assert "(Megatron-LM, --ckpt-format torch_dist, iteration 5)" in line


def test_megatron_checkpoint_continues_without_optimizer_and_rng(
    checkpoints, converted_run, tmp_path
) -> None:
    argv = [*TINY, "--train-iters", "7", "--no-load-optim"]
    records, log = train([*argv, "--load", str(checkpoints["megatron"])], tmp_path / "m.jsonl")
    assert [r["iteration"] for r in records] == [6, 7]
    # Our exporter records no consumed samples: Megatron-LM then starts the data at 0 too.
    assert [r["consumed_samples"] for r in records] == [2, 4]
    assert records[0]["loss"] == pytest.approx(converted_run[0]["loss"], abs=1e-6)
    # A fresh optimizer's LR schedule starts over at the loaded iteration, as Megatron-LM's.
    assert [r["lr"] for r in records] == pytest.approx([lr_at(1), lr_at(2)])
    (line,) = [text for text in log.splitlines() if "loaded checkpoint" in text]
    assert "loaded model weights, iteration and data position; a fresh optimizer" in line


def test_shape_mismatch_is_one_line(checkpoints, capsys) -> None:
    argv = [*TINY, "--hidden-size", "128", "--train-iters", "2"]
    status, out, err = run_in_process([*argv, "--load", str(checkpoints["megatron"])], capsys)
    assert status != 0 and out == ""
    (line,) = err.strip().splitlines()
    assert "--hidden-size 64 in the checkpoint, 128 from the flags" in line


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Our checkpoint after 2 iterations: optimizer state, RNG, iteration 2, 4 samples."""
    root = tmp_path_factory.mktemp("ours")
    argv = [*TINY, "--train-iters", "2", "--save", str(root / "save")]
    train(argv, root / "metrics.jsonl")
    return root / "save"


# flag -> (iterations, consumed samples, LR steps, Adam steps after, RNG loaded), as Megatron-LM.
FLAG_CASES = {
    "": ([3, 4], [6, 8], [3, 4], 4, True),
    "--finetune": ([1, 2], [2, 4], [1, 2], 2, False),
    "--no-load-optim": ([3, 4], [6, 8], [1, 2], 2, True),
    "--no-load-rng": ([3, 4], [6, 8], [3, 4], 4, False),
}


@pytest.mark.parametrize("flag", list(FLAG_CASES))
def test_load_flags_on_our_checkpoint(flag: str, ours: pathlib.Path, tmp_path) -> None:
    iterations, consumed, lr_steps, adam_steps, rng_loaded = FLAG_CASES[flag]
    # Another seed than the saving run's: the RNG state saved next tells which one was kept.
    argv = [*TINY, "--seed", "8", "--train-iters", str(iterations[-1]), *([flag] if flag else [])]
    argv += ["--load", str(ours), "--save", str(tmp_path / "save")]
    records, _ = train(argv, tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in records] == iterations
    assert [r["consumed_samples"] for r in records] == consumed
    assert [r["lr"] for r in records] == pytest.approx([lr_at(k) for k in lr_steps])
    saved, before = load_train_state(tmp_path / "save"), load_train_state(ours)
    assert saved is not None and before is not None
    steps = {int(entry["step"]) for entry in saved["optimizer"]["state"].values()}
    assert steps == {adam_steps}
    assert (saved["rng"]["python"] == before["rng"]["python"]) == rng_loaded


def test_megatron_optimizer_state_continues_the_run(ours: pathlib.Path, tmp_path) -> None:
    """Our run exported to Megatron-LM's torch_dist with its optimizer and loaded back by
    ``--load`` goes on exactly as the same run continued from our own checkpoint (whose RNG
    state is left aside, as a Megatron-LM one's always is)."""
    convert_checkpoint.main(
        ["--source-format", "megatron_het", "--target-format", "megatron"]
        + ["--load-dir", str(ours), "--save-dir", str(tmp_path / "mlm")]
        + ["--ckpt-format", "torch_dist", "--with-optimizer"]
    )
    argv = [*TINY, "--train-iters", "4"]
    want, _ = train([*argv, "--no-load-rng", "--load", str(ours)], tmp_path / "ours.jsonl")
    argv += ["--save", str(tmp_path / "save"), "--load", str(tmp_path / "mlm")]
    records, log = train(argv, tmp_path / "mlm.jsonl")
    assert [r["iteration"] for r in records] == [3, 4]
    assert [r["consumed_samples"] for r in records] == [6, 8]
    assert [r["lr"] for r in records] == pytest.approx([lr_at(3), lr_at(4)])
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in want], abs=1e-6)
    saved = load_train_state(tmp_path / "save")
    assert saved is not None
    assert {int(e["step"]) for e in saved["optimizer"]["state"].values()} == {4}
    (line,) = [text for text in log.splitlines() if "loaded checkpoint" in text]
    assert "(Megatron-LM, --ckpt-format torch_dist, iteration 2)" in line
    assert "optimizer state, iteration and data position" in line
    assert "Megatron-LM's RNG state is not carried" in line
    # --no-load-optim: the weights and position, a fresh optimizer whose schedule restarts.
    argv = [*TINY, "--train-iters", "4", "--no-load-optim", "--load", str(tmp_path / "mlm")]
    fresh, _ = train(argv, tmp_path / "fresh.jsonl")
    assert [r["lr"] for r in fresh] == pytest.approx([lr_at(1), lr_at(2)])
    assert fresh[0]["loss"] == pytest.approx(records[0]["loss"], abs=1e-6)
    assert fresh[1]["loss"] != pytest.approx(records[1]["loss"], abs=1e-6)


@pytest.mark.parametrize(
    ("dtype", "distributed", "main"),
    [("bf16", False, "fp32_param"), ("fp32", True, "param"), ("bf16", True, "param")],
)
def test_optimizer_round_trip_is_bitwise(
    ours: pathlib.Path, tmp_path, dtype: str, distributed: bool, main: str
) -> None:
    """Ours -> torch_dist with the optimizer (bf16 model weights or not, either optimizer
    layout) -> ours: the float32 weights, Adam's moments and step, the iteration and the data
    position come back bitwise, the float32 weights from the main weights, not the model's."""
    flags = ["--ckpt-format", "torch_dist", "--with-optimizer", "--dtype", dtype]
    flags += ["--use-distributed-optimizer"] if distributed else []
    convert_checkpoint.main(
        ["--source-format", "megatron_het", "--target-format", "megatron"]
        + ["--load-dir", str(ours), "--save-dir", str(tmp_path / "mlm"), *flags]
    )
    directory = tmp_path / "mlm/iter_0000002"
    keys = set(read_dcp_metadata(directory).state_dict_metadata)
    assert f"optimizer.state.{main}.embedding.word_embeddings.weight" in keys
    other = "fp32_param" if distributed else "param"
    assert not any(k.startswith(f"optimizer.state.{other}.") for k in keys)
    common = load_pickled(directory / "common.pt", "test")
    sharding = common["content_metadata"].get("distrib_optim_sharding_type")
    assert sharding == ("fully_reshardable" if distributed else None)
    assert common["args"].bf16 == (dtype == "bf16")
    convert_checkpoint.main(
        ["--source-format", "megatron", "--target-format", "megatron_het", "--with-optimizer"]
        + ["--load-dir", str(tmp_path / "mlm"), "--save-dir", str(tmp_path / "back")]
    )
    _, weights = load_model_state(ours)
    _, back = load_model_state(tmp_path / "back")
    assert set(back) == set(weights)
    for name, tensor in weights.items():
        assert back[name].dtype == torch.float32 and torch.equal(back[name], tensor), name
    before = full_optimizer_state(resolve_checkpoint_dir(ours))["state"]
    after = full_optimizer_state(resolve_checkpoint_dir(tmp_path / "back"))["state"]
    assert set(after) == set(before)
    for name, entry in before.items():
        assert float(after[name]["step"]) == float(entry["step"]) == 2.0
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(after[name][moment], entry[moment]), (name, moment)
    state = load_train_state(tmp_path / "back")
    assert state is not None and (state["iteration"], state["consumed_samples"]) == (2, 4)
