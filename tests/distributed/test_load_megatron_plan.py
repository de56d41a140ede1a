"""``--load`` of a Megatron-LM TP 2 x PP 2 checkpoint onto a heterogeneous plan of the emulated
cluster (stages of different kinds, TP degrees and layer counts): every rank reads the Megatron
files itself and the first iteration's loss is that of the same weights converted to ours."""

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


def first_record(path: pathlib.Path) -> dict:
    return json.loads(path.read_text().splitlines()[0])


def test_megatron_checkpoint_onto_heterogeneous_plan(tmp_path: pathlib.Path) -> None:
    from megatron_het.training.run import pretrain

    paths = write_checkpoints(tmp_path)
    continued = MEGATRON_ITERATION + 1
    argv = [*TINY, *BATCH, "--cluster", CLUSTER, "--plan", PLAN, "--no-load-optim"]
    argv += ["--no-load-rng", "--train-iters", str(continued), "--load", str(paths["megatron"])]
    logs = run_ranks(
        _train_worker, 4, [*argv, "--metrics-file", str(tmp_path / "plan.jsonl")], timeout=120
    )
    reference = [*TINY, *BATCH, "--train-iters", "1", "--load", str(paths["converted"])]
    pretrain(parse_run_config([*reference, "--metrics-file", str(tmp_path / "one.jsonl")]))
    got, expected = first_record(tmp_path / "plan.jsonl"), first_record(tmp_path / "one.jsonl")
    assert got["iteration"] == continued and expected["iteration"] == 1
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    text = "".join(logs)
    assert "(Megatron-LM, --ckpt-format torch, iteration 5)" in text
    assert "emu-slow (emulated)" in text
