"""The planner's outputs: the PNG rasterizer and chart, the markdown report, the JSON summary."""
from __future__ import annotations

import json
import pathlib

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import model_preset
from megatron_het.planner import search_plan
from megatron_het.planner.chart import KIND_COLORS, render_chart
from megatron_het.planner.png import Canvas, read_png
from megatron_het.planner.report import (markdown_report, stage_idle_fractions, summary_dict,
                                         text_summary)

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def searched():
    cluster = ClusterSpec.load(REPO / "scripts/clusters/cpu_emulated.yaml")
    return cluster, search_plan(model_preset("small"), cluster, 16, 256)


def test_canvas_round_trips_through_png() -> None:
    canvas = Canvas(20, 10, (255, 255, 255))
    canvas.rect(2, 3, 5, 6, (10, 20, 30))
    canvas.rect(18, 8, 40, 40, (1, 2, 3))  # clipped at the edges
    width, height, rows = read_png(canvas.png_bytes())
    assert (width, height) == (20, 10)
    pixel = lambda x, y: tuple(rows[y][3 * x:3 * x + 3])  # noqa: E731
    assert pixel(2, 3) == pixel(4, 5) == (10, 20, 30)
    assert pixel(5, 5) == pixel(1, 3) == (255, 255, 255)
    assert pixel(19, 9) == (1, 2, 3)


def test_text_draws_the_glyph_bits() -> None:
    canvas = Canvas(12, 7)
    end = canvas.text(0, 0, "1l", (0, 0, 0))  # lower case is drawn as capitals
    assert end == 12
    dark = [[canvas.rows[y][3 * x] == 0 for x in range(5)] for y in range(7)]
    assert [sum(row) for row in dark] == [1, 2, 1, 1, 1, 1, 3]  # the "1" glyph
    assert all(canvas.rows[y][3 * 6] == 0 for y in range(7))  # the "L" stem


def test_chart_shows_forward_backward_and_bubble(searched) -> None:
    cluster, result = searched
    canvas = render_chart(result.prediction, cluster)
    width, height, rows = read_png(canvas.png_bytes())
    assert (width, height) == (canvas.width, canvas.height)
    colors = {tuple(row[i:i + 3]) for row in rows for i in range(0, len(row), 3)}
    assert KIND_COLORS[0] in colors and KIND_COLORS[1] in colors  # backward of both kinds
    # The first stage idles while the first backward comes back: white inside its row.
    stage_row = rows[3 * 14 + 5]
    first_bar = next(i for i in range(0, len(stage_row), 3) if i > 750
                     and tuple(stage_row[i:i + 3]) != (255, 255, 255))
    later = [tuple(stage_row[i:i + 3]) for i in range(first_bar, len(stage_row) - 60, 3)]
    assert (255, 255, 255) in later


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
    assert summary["plan"]["format"] == "megatron_het.plan/1"
