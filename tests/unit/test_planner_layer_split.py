"""What layer bounds cost a plan: the busiest device group against layers divisible at will,
by hand on predicted rows, and the report lines that carry it."""

from __future__ import annotations

import json
import pathlib

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import predict
from megatron_het.planner.evaluate import evaluate_plan
from megatron_het.planner.layer_split import layer_split
from megatron_het.planner.report import markdown_report, summary_dict, text_summary

REPO = pathlib.Path(__file__).resolve().parents[2]
SMALL = model_preset("small")


@pytest.fixture(scope="module")
def cluster():
    return ClusterSpec.load(REPO / "scripts/clusters/cpu_emulated.yaml")


def _plan(name: str) -> ParallelPlan:
    return ParallelPlan.load(REPO / "scripts/plans" / f"{name}.json")


@pytest.mark.parametrize("model, every_group_works", [(model_preset("tiny"), True), (SMALL, False)])
def test_three_stages_by_hand(cluster, model, every_group_works) -> None:
    # emu-fast tp=2 [0, 1) with the embedding; emu-slow [1, 3); emu-slow [3, 4) with the head.
    plan = _plan("cpu_emulated_3stage")
    rows = predict(
        model, plan, cluster, 256, options=RunOptions.from_plan(plan, dtype="fp32")
    ).stages
    busy = [r.forward_s + r.backward_s for r in rows]
    slow = busy[1] / 2  # an emu-slow layer (the middle stage has no end)
    head = busy[2] - slow
    fast = busy[0]  # no plain emu-fast chunk: its one layer carries the embedding
    split = layer_split(
        predict(model, plan, cluster, 256, options=RunOptions.from_plan(plan, dtype="fp32")), plan
    )
    assert split.busiest_s == pytest.approx(max(busy))
    # Water-filling of 4 layers: T = fast x a = slow x b = head + slow x c, a + b + c = 4,
    # unless the head alone takes longer than the other two groups need for all 4 layers:
    # then the head's group holds none and T is the head's.
    all_three = (4 + head / slow) / (1 / fast + 2 / slow)
    time_s = all_three if all_three >= head else max(head, 4 / (1 / fast + 1 / slow))
    # (small's head outweighs its layers at this length; tiny's does not)
    assert (time_s == all_three) is every_group_works
    assert split.divisible_s == pytest.approx(time_s, rel=1e-9)
    assert split.loss == pytest.approx(max(busy) / time_s - 1)


def test_balanced_groups_lose_nothing_and_the_loss_is_never_negative(cluster) -> None:
    # One kind, the same layers everywhere but for the ends: only the ends' groups can give.
    plan = _plan("cpu_emulated_pp4")
    split = layer_split(
        predict(SMALL, plan, cluster, 256, options=RunOptions.from_plan(plan, dtype="fp32")), plan
    )
    assert split.loss >= 0
    rows = predict(
        SMALL, plan, cluster, 256, options=RunOptions.from_plan(plan, dtype="fp32")
    ).stages
    assert split.busiest_s == pytest.approx(max(r.forward_s + r.backward_s for r in rows))


def test_none_for_one_group_or_pipelines_of_different_layouts(cluster) -> None:
    hetero = _plan("cpu_emulated_hetero_dp")
    assert (
        layer_split(
            predict(
                SMALL, hetero, cluster, 256, options=RunOptions.from_plan(hetero, dtype="fp32")
            ),
            hetero,
        )
        is None
    )
    one = ParallelPlan.from_dict(
        {
            "format": "megatron_het.plan/1",
            "micro_batch_size": 2,
            "pipelines": [
                {
                    "micro_batches": 2,
                    "stages": [
                        {"accelerator": "emu-fast", "tp": 2, "layers": [0, 4], "ranks": [0, 1]}
                    ],
                },
                {
                    "micro_batches": 2,
                    "stages": [
                        {"accelerator": "emu-slow", "tp": 2, "layers": [0, 4], "ranks": [2, 3]}
                    ],
                },
            ],
        }
    )
    assert (
        layer_split(
            predict(SMALL, one, cluster, 256, options=RunOptions.from_plan(one, dtype="fp32")), one
        )
        is None
    )


def test_the_reports_carry_it(cluster) -> None:
    plan = _plan("cpu_emulated_3stage")
    result = evaluate_plan(
        SMALL,
        cluster,
        plan,
        256,
        options=RunOptions.from_plan(plan, dtype="fp32"),
        with_baseline=False,
    )
    split = layer_split(result.prediction, result.plan)
    summary = json.loads(json.dumps(summary_dict(result, cluster)))
    assert summary["layer_split_loss"] == pytest.approx(split.loss)
    assert split.describe() in text_summary(result, cluster)
    assert "| layer split | the busiest device group computes" in markdown_report(result, cluster)
