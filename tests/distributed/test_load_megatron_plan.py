"""``--load`` of a Megatron-LM TP 2 x PP 2 checkpoint onto a heterogeneous plan of the emulated
cluster (stages of different kinds, TP degrees and layer counts): every rank reads the Megatron
files itself; the first iteration's loss is that of the same weights converted to ours, and the
run continues with the losses of the same continuation on one process."""

from __future__ import annotations

import io
import json
import pathlib

import pytest

from megatron_het.arguments import parse_run_config
from tests.distributed.harness import run_ranks
from tests.unit.test_load_megatron import MEGATRON_ITERATION, TINY, write_checkpoints

REPO = pathlib.Path(__file__).resolve().parents[2]
CLUSTER = str(REPO / "scripts" / "clusters" / "cpu_emulated.yaml")
PLAN = str(REPO / "scripts" / "plans" / "cpu_emulated_3stage.json")
# The plan's batch: 2 x 4 micro-batches.
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "8"]


def _train_worker(rank: int, world_size: int, argv: list[str]) -> str:
    from megatron_het.training import pretrain_on_world

    out = io.StringIO()
    pretrain_on_world(parse_run_config(argv), world_size, out=out)
    return out.getvalue()


def records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_megatron_checkpoint_onto_heterogeneous_plan(tmp_path: pathlib.Path) -> None:
    from megatron_het.training.run import pretrain

    paths = write_checkpoints(tmp_path)
    continued, last = MEGATRON_ITERATION + 1, MEGATRON_ITERATION + 4
    flags = [*TINY, *BATCH, "--no-load-optim", "--no-load-rng", "--train-iters", str(last)]
    argv = [*flags, "--cluster", CLUSTER, "--plan", PLAN, "--load", str(paths["megatron"])]
    logs = run_ranks(
        _train_worker, 4, [*argv, "--metrics-file", str(tmp_path / "plan.jsonl")], timeout=120
    )
    # the same continuation on one process
    single = [
        *flags,
        "--load",
        str(paths["megatron"]),
        "--metrics-file",
        str(tmp_path / "one.jsonl"),
    ]
    pretrain(parse_run_config(single))
    # the first iteration from our converted checkpoint of the same weights
    reference = [*TINY, *BATCH, "--train-iters", "1", "--load", str(paths["converted"])]
    pretrain(parse_run_config([*reference, "--metrics-file", str(tmp_path / "conv.jsonl")]))
    got, one = records(tmp_path / "plan.jsonl"), records(tmp_path / "one.jsonl")
    assert [r["iteration"] for r in got] == [r["iteration"] for r in one]
    assert [r["iteration"] for r in got] == list(range(continued, last + 1))
    assert got[0]["loss"] == pytest.approx(records(tmp_path / "conv.jsonl")[0]["loss"], abs=1e-6)
    for mine, theirs in zip(got, one, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=2e-4), mine["iteration"]
    text = "".join(logs)
    assert "(Megatron-LM, --ckpt-format torch, iteration 5)" in text
    assert "emu-slow (emulated)" in text


def test_megatron_optimizer_state_onto_heterogeneous_plan(tmp_path: pathlib.Path) -> None:
    """A Megatron-LM torch_dist checkpoint WITH its optimizer state (by parameter) continues on
    the heterogeneous plan with the losses of the same continuation on one process."""
    from megatron_het.training.run import pretrain
    from tools import convert_checkpoint

    saved = [*TINY, *BATCH, "--train-iters", "2", "--save", str(tmp_path / "ours")]
    pretrain(parse_run_config(saved), out=io.StringIO())
    convert_checkpoint.main(
        ["--source-format", "megatron_het", "--target-format", "megatron", "--with-optimizer"]
        + ["--load-dir", str(tmp_path / "ours"), "--save-dir", str(tmp_path / "mlm")]
        + ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"]
    )
    flags = [*TINY, *BATCH, "--train-iters", "5", "--load", str(tmp_path / "mlm")]
    argv = [*flags, "--cluster", CLUSTER, "--plan", PLAN]
    logs = run_ranks(
        _train_worker, 4, [*argv, "--metrics-file", str(tmp_path / "plan.jsonl")], timeout=120
    )
    pretrain(parse_run_config([*flags, "--metrics-file", str(tmp_path / "one.jsonl")]))
    got, one = records(tmp_path / "plan.jsonl"), records(tmp_path / "one.jsonl")
    assert [r["iteration"] for r in got] == [r["iteration"] for r in one] == [3, 4, 5]
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in one])
    for mine, theirs in zip(got, one, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=2e-4), mine["iteration"]
    text = "".join(logs)
    assert "(Megatron-LM, --ckpt-format torch_dist, iteration 2)" in text
    assert "optimizer state, iteration and data position" in text
