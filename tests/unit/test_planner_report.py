"""The planner's outputs: the matplotlib charts, the markdown report, the JSON summary."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import zlib

import numpy as np
import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import model_preset
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.planner import evaluate_plan, search_plan, upper_bound
from megatron_het.planner.chart import (KIND_COLORS, STAGE_COLORS, save_allocation_chart,
                                        save_chart, save_timeline_chart)
from megatron_het.planner.report import (markdown_report, plan_summary, stage_idle_fractions,
                                         summary_dict, text_summary)

REPO = pathlib.Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def searched():
    cluster = ClusterSpec.load(REPO / "scripts/clusters/cpu_emulated.yaml")
    model = model_preset("small")
    result = search_plan(model, cluster, 16, 256)
    return cluster, result.with_upper_bound(upper_bound(model, cluster, 16, 256))


def png_text(path: pathlib.Path) -> dict[str, str]:
    """The tEXt chunks of a PNG (matplotlib writes its name under "Software")."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    pos, out = 8, {}
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        assert zlib.crc32(kind + body) == int.from_bytes(data[pos + 8 + length:pos + 12 + length],
                                                         "big")
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
    rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.uint8)
    return bool((image == rgb).all(axis=-1).any())


def test_importing_the_planner_does_not_load_matplotlib() -> None:
    code = ("import sys, megatron_het.planner, megatron_het.planner.chart, "
            "megatron_het.planner.cli, megatron_het.loss_chart; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
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
    assert has_color(alone, STAGE_COLORS[1]) and image.shape[0] < pixels(
        save_chart(result.prediction, cluster, tmp_path / "both.png")).shape[0]


@pytest.mark.slow  # a process start or a 768-device chart: several seconds
def test_chart_of_a_768_device_plan(tmp_path) -> None:
    cluster = ClusterSpec.load(REPO / "scripts/clusters/hethub_llama140b.yaml")
    plan = ParallelPlan.load(REPO / "scripts/hethub_llama140b/plan_140b.json")
    result = evaluate_plan(model_preset("llama-140b"), cluster, plan, 4096,
                           with_upper_bound=False)
    image = pixels(save_chart(result.prediction, cluster, tmp_path / "hethub.png"))
    assert image.shape[1] == 1200 and image.shape[0] < 2400


def test_report_lists_every_stage_bound_and_efficiency(searched) -> None:
    cluster, result = searched
    report = markdown_report(result, cluster)
    stages = result.plan.pipelines[0].stages
    for s, stage in enumerate(stages):
        assert f"| {s} | {result.prediction.stages[s].accelerator} | {stage.tp} |" in report
    assert f"| efficiency | {result.efficiency:.4f} |" in report
    assert "## Upper bound" in report and "emu-slow" in report
    idle = stage_idle_fractions(result.prediction)
    assert len(idle) == len(stages) and all(0.0 <= f < 1.0 for f in idle)
    assert "efficiency" in text_summary(result, cluster)


def test_summary_is_json_with_the_promised_keys(searched) -> None:
    cluster, result = searched
    summary = json.loads(json.dumps(summary_dict(result, cluster)))
    for key in ("efficiency", "upper_bound_tokens_per_s", "tokens_per_s", "iteration_time_s",
                "search_time_s", "peak_memory_gib", "plan"):
        assert key in summary
    assert summary["tokens_per_s"] == pytest.approx(result.prediction.tokens_per_s)
    assert len(summary["peak_memory_gib"]) == result.plan.pp_size()
    assert summary["plan"] == plan_summary(result.plan)


def test_plan_summary_groups_stages_of_a_768_device_plan() -> None:
    plan = ParallelPlan.load(REPO / "scripts/hethub_llama140b/plan_140b.json")
    summary = plan_summary(plan)
    assert summary["dp"] == plan.dp_size and summary["world_size"] == 768
    groups = summary["stage_groups"]
    assert sum(g["ranks"] for g in groups) == 768
    assert len(groups) == sum(p.pp_size for p in plan.pipelines[:1])  # pipelines agree
    first = plan.pipelines[0].stages[0]
    assert groups[0] == {"stage": 0, "accelerator": first.accelerator, "tp": first.tp,
                         "layers": list(first.layers), "recompute": first.recompute,
                         "micro_batches": plan.pipelines[0].micro_batches,
                         "pipelines": plan.dp_size, "ranks": plan.dp_size * first.tp}
    assert len(json.dumps(summary)) < 4000


def test_plan_summary_keeps_pipelines_that_differ_apart() -> None:
    d = json.loads((REPO / "scripts/plans/cpu_emulated_dp2_fast_heavy.json").read_text())
    same = plan_summary(ParallelPlan.from_dict(d))["stage_groups"]
    assert [(g["stage"], g["accelerator"], g["pipelines"], g["ranks"]) for g in same] == [
        (0, "emu-fast", 2, 2), (1, "emu-slow", 2, 2)]
    d["pipelines"][1]["stages"][0]["layers"] = [0, 2]
    d["pipelines"][1]["stages"][1]["layers"] = [2, 4]
    apart = plan_summary(ParallelPlan.from_dict(d))["stage_groups"]
    assert [(g["stage"], g["layers"], g["pipelines"]) for g in apart] == [
        (0, [0, 3], 1), (0, [0, 2], 1), (1, [3, 4], 1), (1, [2, 4], 1)]
