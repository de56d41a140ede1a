"""bench/hetero_plans.py builds valid plans for the mixed emulated cluster (EMULATION)."""

from __future__ import annotations

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import model_preset
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_validation import validate
from megatron_het.parallel.replicas import uniform_layouts

MODEL = model_preset("small").replace(num_layers=11)


@pytest.fixture(scope="module")
def hetero_plans():
    from bench import hetero_plans

    return hetero_plans


def _plan(kind: str, stages: list[tuple[int, int, list[int]]], micro_batches: int) -> dict:
    return {
        "format": "megatron_het.plan/1",
        "micro_batch_size": 2,
        "pipelines": [
            {
                "micro_batches": micro_batches,
                "stages": [
                    {"accelerator": kind, "tp": len(ranks), "layers": [a, b], "ranks": ranks}
                    for a, b, ranks in stages
                ],
            }
        ],
    }


def test_replicas_by_kind_share_the_batch_by_speed(hetero_plans) -> None:
    fast = _plan("emu-fast", [(0, 5, [0]), (5, 11, [1])], 64)
    slow = _plan("emu-slow", [(0, 11, [0, 1])], 64)
    mixed = hetero_plans.replicas_by_kind(fast, slow, 2, 200.0, 100.0)
    plan = ParallelPlan.load(mixed)
    cluster = ClusterSpec.from_dict(hetero_plans.cluster_dicts(2.0)["mixed"])
    validate(plan, MODEL, cluster, 128)
    assert [p.micro_batches for p in plan.pipelines] == [43, 21]  # 2 : 1 of 64
    assert plan.pipelines[1].stages[0].ranks == (2, 3)
    assert not uniform_layouts(plan)  # pp 2 x tp 1 beside one tp 2 stage


def test_interleaved_keeps_each_groups_layers(hetero_plans) -> None:
    planned = _plan("emu-fast", [(0, 4, [0, 1]), (4, 11, [2, 3])], 64)
    planned["pipelines"][0]["stages"][1]["accelerator"] = "emu-slow"
    plan = ParallelPlan.load(hetero_plans.interleaved(planned, 2))
    validate(plan, MODEL, ClusterSpec.from_dict(hetero_plans.cluster_dicts(2.0)["mixed"]), 128)
    assert [s.layers for s in plan.pipelines[0].stages] == [(0, 2), (2, 6), (6, 8), (8, 11)]
