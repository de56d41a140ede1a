"""The start-up note on parameter replicas stepped on different vendors' devices
(training.describe): without ZeRO-1 their optimizer kernels may round differently."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_het.cluster.accelerators import get_accelerator
from megatron_het.config import MODEL_PRESETS, RunOptions
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.training.describe import (
    describe_plan,
    replicas_across_vendors,
    tied_copies_across_vendors,
)

REPO = Path(__file__).resolve().parents[2]
HETERO_DP = json.loads((REPO / "scripts/plans/cpu_emulated_hetero_dp.json").read_text())


def _setup(kinds: list[str], plan: dict, zero: bool = False, tied: bool = False):
    specs = [get_accelerator(k) for k in kinds]
    for pipeline in plan["pipelines"]:
        for stage in pipeline["stages"]:
            stage["accelerator"] = kinds[stage["ranks"][0]]
    model = MODEL_PRESETS["tiny-tied" if tied else "tiny"]
    return SimpleNamespace(
        accelerator=lambda r: specs[r],
        plan=ParallelPlan.from_dict(plan),
        options=RunOptions(use_distributed_optimizer=zero),
        model_config=model,
    )


def _pipeline(stages: list[tuple[list[int], int, int]]) -> dict:
    """A pipeline of (ranks, first layer, end layer) stages: the first holds the embedding,
    the last the head."""
    return {
        "micro_batches": 2,
        "stages": [
            {"accelerator": "", "tp": len(ranks), "layers": [a, b], "ranks": ranks}
            for ranks, a, b in stages
        ],
    }


def test_replicas_of_one_layer_on_two_vendors_get_a_note_without_zero_1() -> None:
    setup = _setup(["H100", "H100", "MI300X", "MI300X"], json.loads(json.dumps(HETERO_DP)))
    assert replicas_across_vendors(setup) == ["amd cuda", "nvidia cuda"]
    assert "note: parameters have replicas on amd cuda and nvidia cuda" in describe_plan(setup)
    setup.options = RunOptions(use_distributed_optimizer=True)
    assert "note:" not in describe_plan(setup)


@pytest.mark.parametrize(
    "kinds",
    [["emu-fast", "emu-fast", "emu-slow", "emu-slow"], ["H100", "H100", "A100-80G", "A100-80G"]],
)
def test_replicas_on_one_vendor_or_emulated_kinds_get_none(kinds: list[str]) -> None:
    setup = _setup(kinds, json.loads(json.dumps(HETERO_DP)))
    assert replicas_across_vendors(setup) == [] and "note:" not in describe_plan(setup)


def test_mixed_pipelines_whose_stages_match_across_replicas_get_none() -> None:
    """Stage 0 of both pipelines on NVIDIA, stage 1 on AMD: every layer's replicas on one."""
    plan = {
        "format": "megatron_het.plan/1",
        "micro_batch_size": 1,
        "pipelines": [_pipeline([([0], 0, 2), ([2], 2, 4)]), _pipeline([([1], 0, 2), ([3], 2, 4)])],
    }
    assert replicas_across_vendors(_setup(["H100", "H100", "MI300X", "MI300X"], plan)) == []
    tied = _setup(["H100", "H100", "MI300X", "MI300X"], plan, tied=True, zero=True)
    assert replicas_across_vendors(tied) == []
    # the tied head steps its own copy of the embedding, ZeRO-1 or not
    assert tied_copies_across_vendors(tied) == ["amd cuda", "nvidia cuda"]
    assert "the tied embedding's copies" in describe_plan(tied)


def test_stages_that_split_a_layer_hold_different_blocks_not_replicas() -> None:
    plan = {
        "format": "megatron_het.plan/1",
        "micro_batch_size": 1,
        "pipelines": [_pipeline([([0], 0, 2.5), ([1], 2.5, 4)])],
    }
    assert replicas_across_vendors(_setup(["H100", "MI300X"], plan)) == []
