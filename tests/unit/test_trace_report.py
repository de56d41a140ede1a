"""tools/trace_report.py: a trace cut into compute, wait, DP sync, optimizer and the rest, per
device group, measured beside predicted; the picture; bad input as one line."""

from __future__ import annotations

import io
import json
import pathlib

import pytest

from megatron_het.errors import UserError
from megatron_het.trace.chrome import RankTrack, TraceInfo, chrome_trace, write_trace
from megatron_het.trace.recorder import Span
from megatron_het.trace.stage_compare import format_report, largest_differences, stage_rows
from tools import trace_report


def _track(rank: int, stage: int, spans: list[Span], predicted: list[Span]) -> RankTrack:
    return RankTrack(
        rank=rank,
        node=0,
        node_label="node 0 (fast, slow)",
        kind="emu-fast (emulated)" if stage == 0 else "emu-slow (emulated)",
        pipeline=0,
        stages=(stage,),
        tp_rank=0,
        tp=1,
        spans=tuple(spans),
        predicted=tuple(predicted),
    )


def _iteration(stage: int, base: float) -> list[Span]:
    """One iteration of a 2-stage pipeline, one micro-batch: stage 0 computes 0.1 + 0.2 s and
    waits 0.3 s between; stage 1 waits 0.1 s, computes 0.1 + 0.1 s."""
    it = Span("iteration 1", "iteration", base, base + 1.0, {"iteration": 1})
    if stage == 0:
        work = [
            Span("forward mb0", "compute", base + 0.0, base + 0.1, {"stage": 0}),
            Span("wait recv bwd mb0", "p2p", base + 0.1, base + 0.4),
            Span("backward mb0", "compute", base + 0.4, base + 0.6, {"stage": 0}),
        ]
    else:
        work = [
            Span("wait recv fwd mb0", "p2p", base + 0.0, base + 0.1),
            Span("forward mb0", "compute", base + 0.1, base + 0.2, {"stage": 1}),
            Span("backward mb0", "compute", base + 0.2, base + 0.3, {"stage": 1}),
        ]
    steps = [
        Span("DP gradient sync", "step", base + 0.7, base + 0.75),
        Span("optimizer step", "step", base + 0.8, base + 0.9),
    ]
    if stage == 1:  # ZeRO-1: the parameters' all-gather ends the optimizer step
        steps.append(Span("parameter all-gather", "step", base + 0.86, base + 0.9))
    return [it, *work, *steps]


def _predicted(stage: int, base: float) -> list[Span]:
    spans = [
        Span("forward mb0", "compute", base, base + 0.1, {"iteration": 1}),
        Span("backward mb0", "compute", base + 0.3, base + 0.4, {"iteration": 1}),
        Span("optimizer step", "step", base + 0.5, base + 0.6, {"iteration": 1}),
    ]
    return spans if stage == 0 else spans[:1]


@pytest.fixture
def trace_file(tmp_path: pathlib.Path) -> pathlib.Path:
    tracks = [_track(s, s, _iteration(s, 5.0), _predicted(s, 5.0)) for s in (0, 1)]
    info = TraceInfo((1,), "test", prediction={"iteration_time_s": 0.8})
    return write_trace(chrome_trace(tracks, info), tmp_path / "timeline_iters1-1.json")


def test_each_stage_is_cut_into_its_parts(trace_file: pathlib.Path) -> None:
    trace = json.loads(trace_file.read_text())
    first, second = stage_rows(trace)
    assert first.label == "p0 stage 0 emu-fast (emulated) tp1"
    assert first.measured == pytest.approx(
        {
            "compute": 0.3,
            "wait": 0.3,
            "dp_sync": 0.05,
            "optimizer": 0.1,
            "other": 0.25,
            "iteration": 1.0,
        }  # fmt: skip
    )
    assert second.measured["compute"] == pytest.approx(0.2)
    assert second.measured["wait"] == pytest.approx(0.0)  # its wait came before its forward
    # the parameter all-gather is DP sync, as the predictor counts it, not optimizer time
    assert second.measured["dp_sync"] == pytest.approx(0.09)
    assert second.measured["optimizer"] == pytest.approx(0.06)
    assert second.measured["other"] == pytest.approx(0.65)  # as without the split
    assert first.predicted == pytest.approx(
        {
            "compute": 0.2,
            "wait": 0.2,
            "dp_sync": 0.0,
            "optimizer": 0.1,
            "other": 0.3,
            "iteration": 0.8,
        }  # fmt: skip
    )
    (row, part), *_ = largest_differences([first, second])
    assert (row.label, part) == (second.label, "compute")  # 0.2 measured against 0.1
    text = format_report(trace)
    assert "largest differences (measured - predicted):" in text
    assert "p0 stage 1 emu-slow (emulated) tp1 compute: +0.1000 s (+100%)" in text


def test_the_tool_prints_draws_and_answers_json(trace_file: pathlib.Path) -> None:
    out = io.StringIO()
    picture = trace_file.with_name("timeline.png")
    assert trace_report.main([str(trace_file), "--png", str(picture)], out) == 0
    assert "seconds per iteration, measured / predicted" in out.getvalue()
    assert picture.read_bytes().startswith(b"\x89PNG")
    out = io.StringIO()
    trace_report.main([str(trace_file), "--json"], out)
    rows = json.loads(out.getvalue())["rows"]
    assert [r["ranks"] for r in rows] == [[0], [1]]


def test_a_file_that_is_not_a_trace_is_one_line(tmp_path: pathlib.Path) -> None:
    other = tmp_path / "metrics.json"
    other.write_text("{}")
    with pytest.raises(UserError, match="cannot read a trace"):
        trace_report.main([str(other)])
    with pytest.raises(UserError, match="cannot read a trace"):
        trace_report.main([str(tmp_path / "missing.json")])
