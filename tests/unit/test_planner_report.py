"""The planner's outputs: the matplotlib charts, the markdown report, the JSON summary, and
the two references they measure a plan against (homogeneous baseline, compute ceiling)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
import zlib

import numpy as np
import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.planner.baseline import homogeneous_baseline, why_above_baseline
from megatron_het.planner.ceiling import compute_ceiling
from megatron_het.planner.chart import (
    KIND_COLORS,
    STAGE_COLORS,
    save_allocation_chart,
    save_chart,
    save_timeline_chart,
    timeline_title,
)
from megatron_het.planner.evaluate import evaluate_plan
from megatron_het.planner.report import (
    efficiency_line,
    markdown_report,
    plan_summary,
    stage_idle_fractions,
    summary_dict,
    text_summary,
)
from megatron_het.planner.result import HomogeneousBaseline, KindBaseline, SearchResult
from megatron_het.planner.search import search_plan
from megatron_het.planner.space import KindBlock

REPO = pathlib.Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def searched():
    cluster = ClusterSpec.load(REPO / "scripts/clusters/cpu_emulated.yaml")
    model = model_preset("small")
    result = search_plan(model, cluster, 16, 256)
    result = result.with_baseline(homogeneous_baseline(model, cluster, 16, 256))
    return cluster, result.with_ceiling(compute_ceiling(model, cluster, 16, 256))


def scaled_baseline(result: SearchResult, efficiency: float) -> SearchResult:
    """``result`` against its baseline scaled so that its efficiency is ``efficiency``."""
    factor = result.efficiency / efficiency
    kinds = tuple(
        dataclasses.replace(k, tokens_per_s_per_device=k.tokens_per_s_per_device * factor)
        for k in result.baseline.kinds
    )
    return result.with_baseline(HomogeneousBaseline(kinds, result.baseline.search_time_s))


def png_text(path: pathlib.Path) -> dict[str, str]:
    """The tEXt chunks of a PNG (matplotlib writes its name under "Software")."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    pos, out = 8, {}
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        assert zlib.crc32(kind + body) == int.from_bytes(
            data[pos + 8 + length : pos + 12 + length], "big"
        )
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            out[key.decode()] = value.decode("latin-1")
        pos += 12 + length
    return out


def pixels(path: pathlib.Path) -> np.ndarray:
    """The image as uint8 RGB, read back by matplotlib."""
    from matplotlib.image import imread

    return (imread(path)[..., :3] * 255).round().astype(np.uint8)


def has_color(image: np.ndarray, hex_color: str) -> bool:
    rgb = np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.uint8)
    return bool((image == rgb).all(axis=-1).any())


def test_importing_the_planner_does_not_load_matplotlib() -> None:
    code = (
        "import sys, megatron_het.planner, megatron_het.planner.chart, "
        "megatron_het.planner.cli, megatron_het.loss_chart; "
        "print('matplotlib' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_chart_is_a_matplotlib_png_with_both_kinds_and_every_stage(searched, tmp_path) -> None:
    cluster, result = searched
    path = save_chart(result.prediction, cluster, tmp_path / "plan.png")
    assert path == tmp_path / "plan.png"
    assert png_text(path)["Software"].startswith("Matplotlib")
    image = pixels(path)
    assert image.shape[0] > 300 and image.shape[1] == 1200
    assert has_color(image, KIND_COLORS[0]) and has_color(image, KIND_COLORS[1])  # backward
    for stage in range(result.plan.pp_size()):
        assert has_color(image, STAGE_COLORS[stage])  # allocation cells


def test_timeline_alone_has_a_time_axis_and_no_allocation(searched, tmp_path) -> None:
    cluster, result = searched
    path = save_timeline_chart(result.prediction, tmp_path / "timeline.png", title="t")
    assert png_text(path)["Software"].startswith("Matplotlib")
    image = pixels(path)
    assert has_color(image, KIND_COLORS[1]) and not has_color(image, STAGE_COLORS[1])
    alone = pixels(save_allocation_chart(result.prediction, cluster, tmp_path / "alloc.png"))
    assert (
        has_color(alone, STAGE_COLORS[1])
        and image.shape[0]
        < pixels(save_chart(result.prediction, cluster, tmp_path / "both.png")).shape[0]
    )


@pytest.mark.slow  # a process start or a 768-device chart: several seconds
def test_chart_of_a_768_device_plan(tmp_path) -> None:
    cluster = ClusterSpec.load(REPO / "scripts/clusters/hethub_llama140b.yaml")
    plan = ParallelPlan.load(REPO / "scripts/hethub_llama140b/plan_140b.json")
    result = evaluate_plan(model_preset("llama-140b"), cluster, plan, 4096, with_baseline=False)
    image = pixels(save_chart(result.prediction, cluster, tmp_path / "hethub.png"))
    assert image.shape[1] == 1200 and image.shape[0] < 2400


def test_report_lists_every_stage_both_references_and_efficiencies(searched) -> None:
    cluster, result = searched
    report = markdown_report(result, cluster)
    stages = result.plan.pipelines[0].stages
    for s, stage in enumerate(stages):
        assert f"| {s} | {result.prediction.stages[s].accelerator} | {stage.tp} |" in report
    assert f"| efficiency | {result.efficiency:.4f} |" in report
    assert f"| ceiling efficiency | {result.ceiling_efficiency:.4f} |" in report
    assert f"| homogeneous baseline | {result.baseline.tokens_per_s:,.0f} tokens/s" in report
    assert f"| compute ceiling | {result.ceiling.tokens_per_s:,.0f} tokens/s" in report
    assert "## Homogeneous baseline" in report and "## Compute ceiling" in report
    assert "memory ignored" in report and "emu-slow" in report and "upper bound" not in report
    for k in result.ceiling.kinds:
        assert f"| {k.kind} | {k.devices} | {1e6 * k.seconds_per_token:,.2f} |" in report
    idle = stage_idle_fractions(result.prediction)
    assert len(idle) == len(stages) and all(0.0 <= f < 1.0 for f in idle)
    text = text_summary(result, cluster)
    assert efficiency_line(result) in text.splitlines()
    assert f"ceiling efficiency {result.ceiling_efficiency:.4f}" in text


def test_summary_is_json_with_the_promised_keys(searched) -> None:
    cluster, result = searched
    summary = json.loads(json.dumps(summary_dict(result, cluster)))
    for key in (
        "efficiency",
        "baseline_tokens_per_s",
        "ceiling_efficiency",
        "ceiling_tokens_per_s",
        "tokens_per_s",
        "iteration_time_s",
        "search_time_s",
        "baseline_search_time_s",
        "peak_memory_gib",
        "plan",
        "baseline",
        "ceiling",
    ):
        assert key in summary
    tps = result.prediction.tokens_per_s
    assert summary["tokens_per_s"] == pytest.approx(tps)
    assert tps == pytest.approx(summary["efficiency"] * summary["baseline_tokens_per_s"])
    assert tps == pytest.approx(summary["ceiling_efficiency"] * summary["ceiling_tokens_per_s"])
    assert summary["ceiling_tokens_per_s"] >= summary["baseline_tokens_per_s"]
    assert summary["ceiling_efficiency"] < 1 and summary["ceiling"]["memory"] == "ignored"
    assert "upper_bound" not in summary and "upper_bound_tokens_per_s" not in summary
    assert len(summary["peak_memory_gib"]) == result.plan.pp_size()
    assert summary["plan"] == plan_summary(result.plan)


def test_ceiling_alone_without_the_baseline_searches(searched) -> None:
    cluster, result = searched
    alone = dataclasses.replace(result, baseline=None)  # --no-baseline
    summary = summary_dict(alone, cluster)
    assert summary["efficiency"] is None and summary["baseline_tokens_per_s"] is None
    assert summary["above_baseline_reason"] is None and summary["baseline"] is None
    assert summary["ceiling_efficiency"] == pytest.approx(result.ceiling_efficiency)
    line = efficiency_line(alone)
    assert line.startswith("ceiling efficiency") and "homogeneous" not in line
    assert "| ceiling efficiency |" in markdown_report(alone, cluster)
    assert "| efficiency |" not in markdown_report(alone, cluster)
    bare = dataclasses.replace(alone, ceiling=None)
    assert efficiency_line(bare) is None and summary_dict(bare, cluster)["ceiling"] is None


@pytest.mark.parametrize("efficiency", [0.9, 1.0, 1.05])
def test_reason_line_appears_exactly_above_one(searched, efficiency: float) -> None:
    cluster, result = searched
    result = scaled_baseline(result, efficiency)
    assert result.efficiency == pytest.approx(efficiency, rel=1e-12)
    text = text_summary(result, cluster).splitlines()
    report = markdown_report(result, cluster)
    reason = summary_dict(result, cluster)["above_baseline_reason"]
    above = [line for line in text if line.startswith("above 1")]
    if efficiency > 1:
        assert reason == why_above_baseline(result) and above == [reason]
        assert f"Efficiency {reason}." in report and f"({efficiency:.4f})" in reason
    else:
        assert reason is None and above == [] and "Efficiency above 1" not in report


def _kind_alone(result: SearchResult, kind: str, **changes) -> KindBaseline:
    """``kind``'s baseline term from ``result``'s, its layout and shares changed."""
    k = next(k for k in result.baseline.kinds if k.kind == kind)
    layout = dataclasses.replace(k.layout, **changes.pop("layout", {}))
    return dataclasses.replace(k, layout=layout, plan_summary=layout.describe(), **changes)


def test_reason_says_what_the_kind_does_differently_alone(searched) -> None:
    _, result = searched  # the mixed plan: tp=1, no recompute, micro-batch 1 on both kinds
    assert result.plan.micro_batch_size == 1
    slow = _kind_alone(
        result,
        "emu-slow",
        layout={"blocks": (KindBlock("emu-slow", 2, 1, recompute=True),)},
        tp_comm_share=0.25,
    )
    fast = _kind_alone(
        result,
        "emu-fast",
        bubble_fraction=result.prediction.bubble_fraction + 0.2,
        dp_sync_share=0.5,
    )
    result = scaled_baseline(result.with_baseline(HomogeneousBaseline((fast, slow))), 1.1)
    reason = why_above_baseline(result)
    assert reason.startswith("above 1 (1.1000): ")
    assert "emu-slow runs tp=1 in the mixed plan against tp=2 alone" in reason
    assert "against 25.0%" in reason and slow.plan_summary in reason
    assert (
        "emu-slow alone recomputes activations to fit its memory; in the mixed plan it "
        "does not" in reason
    )
    assert (
        f"idles {100 * result.prediction.bubble_fraction:.1f}% in its bubble against "
        f"{100 * fast.bubble_fraction:.1f}% for emu-fast alone"
    ) in reason
    assert "against 50.0% for emu-fast alone" in reason  # DP sync
    assert "emu-fast runs" not in reason and "runs micro-batch" not in reason  # same alone
    wider = dataclasses.replace(result, plan=dataclasses.replace(result.plan, micro_batch_size=4))
    assert "the mixed plan runs micro-batch 4 against 1 for emu-fast alone" in why_above_baseline(
        wider
    )


def test_reason_without_a_layout_difference_says_so(searched) -> None:
    _, result = searched
    same = tuple(
        dataclasses.replace(k, bubble_fraction=0.0, dp_sync_share=0.0)
        for k in result.baseline.kinds
    )
    reason = why_above_baseline(
        scaled_baseline(result.with_baseline(HomogeneousBaseline(same)), 1.02)
    )
    assert reason.startswith("above 1 (1.0200): every kind keeps the TP degree")


def test_homogeneous_cluster_is_its_own_baseline_without_a_reason() -> None:
    cluster = ClusterSpec.from_dict(
        {
            "name": "h",
            "node_groups": [
                {
                    "name": "h",
                    "accelerator": "H100",
                    "nodes": 1,
                    "devices_per_node": 4,
                    "nic_bandwidth_gbit_per_s": 400,
                }
            ],
        }
    )
    model = model_preset("small")
    result = search_plan(model, cluster, 8, 256, top_k=1)
    result = result.with_baseline(homogeneous_baseline(model, cluster, 8, 256, top_k=1))
    result = result.with_ceiling(compute_ceiling(model, cluster, 8, 256))
    assert result.efficiency == pytest.approx(1.0, rel=1e-9)
    assert why_above_baseline(result) is None and result.ceiling_efficiency < 1


def test_chart_title_gives_both_efficiencies(searched, tmp_path) -> None:
    cluster, result = searched
    plain = timeline_title(result.prediction)
    title = timeline_title(result.prediction, result)
    assert title.splitlines() == [plain, efficiency_line(result, explain=False)]
    assert f"efficiency {result.efficiency:.4f} of the homogeneous baseline" in title
    assert f"ceiling efficiency {result.ceiling_efficiency:.4f} of the compute ceiling" in title
    with_figures = pixels(save_chart(result.prediction, cluster, tmp_path / "a.png", result))
    without = pixels(save_chart(result.prediction, cluster, tmp_path / "b.png"))
    assert with_figures.shape[0] > without.shape[0]  # room for the second title line


def test_plan_summary_groups_stages_of_a_768_device_plan() -> None:
    plan = ParallelPlan.load(REPO / "scripts/hethub_llama140b/plan_140b.json")
    summary = plan_summary(plan)
    assert summary["dp"] == plan.dp_size and summary["world_size"] == 768
    groups = summary["stage_groups"]
    assert sum(g["ranks"] for g in groups) == 768
    # pipelines agree: one group per stage (an interleaved plan's chunks each count)
    assert len(groups) == plan.pipelines[0].num_stages
    first = plan.pipelines[0].stages[0]
    assert groups[0] == {
        "stage": 0,
        "accelerator": first.accelerator,
        "tp": first.tp,
        "layers": list(first.layers),
        "recompute": first.recompute,
        "micro_batches": plan.pipelines[0].micro_batches,
        "pipelines": plan.dp_size,
        "ranks": plan.dp_size * first.tp,
    }
    # short: a few numbers per stage group, no rank lists (768 ranks)
    assert len(json.dumps(summary)) < 1000 + 200 * len(groups)


def test_plan_summary_keeps_pipelines_that_differ_apart() -> None:
    d = json.loads((REPO / "scripts/plans/cpu_emulated_dp2_fast_heavy.json").read_text())
    same = plan_summary(ParallelPlan.from_dict(d))["stage_groups"]
    assert [(g["stage"], g["accelerator"], g["pipelines"], g["ranks"]) for g in same] == [
        (0, "emu-fast", 2, 2),
        (1, "emu-slow", 2, 2),
    ]
    d["pipelines"][1]["stages"][0]["layers"] = [0, 2]
    d["pipelines"][1]["stages"][1]["layers"] = [2, 4]
    apart = plan_summary(ParallelPlan.from_dict(d))["stage_groups"]
    assert [(g["stage"], g["layers"], g["pipelines"]) for g in apart] == [
        (0, [0, 3], 1),
        (0, [0, 2], 1),
        (1, [3, 4], 1),
        (1, [2, 4], 1),
    ]


def test_plan_summary_counts_an_interleaved_device_group_once() -> None:
    plan = ParallelPlan.load(REPO / "scripts/plans/cpu_emulated_interleaved.json")
    groups = plan_summary(plan)["stage_groups"]
    assert [(g["stage"], g["accelerator"]) for g in groups] == [
        (0, "emu-fast"),
        (1, "emu-slow"),
        (2, "emu-fast"),
        (3, "emu-slow"),
    ]
    # Each device group's ranks count on its first chunk's entry.
    assert [g["ranks"] for g in groups] == [2, 2, 0, 0]
    assert sum(g["ranks"] for g in groups) == plan.world_size == 4


def test_an_interleaved_plans_chart_names_its_schedule(tmp_path) -> None:
    from megatron_het.perf import predict

    cluster = ClusterSpec.load(REPO / "scripts/clusters/cpu_emulated.yaml")
    plan = ParallelPlan.load(REPO / "scripts/plans/cpu_emulated_interleaved.json")
    eight = dataclasses.replace(model_preset("small"), num_layers=8)
    prediction = predict(
        eight, plan, cluster, 256, options=RunOptions.from_plan(plan, dtype="fp32")
    )
    assert timeline_title(prediction).startswith("predicted interleaved 1F1B timeline")
    plain = ParallelPlan.load(REPO / "scripts/plans/cpu_emulated_pp4.json")
    assert timeline_title(
        predict(
            model_preset("small"),
            plain,
            cluster,
            256,
            options=RunOptions.from_plan(plain, dtype="fp32"),
        )
    ).startswith("predicted 1F1B timeline")
    assert pixels(save_chart(prediction, cluster, tmp_path / "interleaved.png")).size
