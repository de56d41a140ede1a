"""The recorder (off by default, spans while on) and the Chrome trace it is merged into: the
format's rules a viewer relies on, checked on good traces and broken ones."""

from __future__ import annotations

import json
import pathlib

import pytest

from megatron_het.trace.chrome import (
    RankTrack,
    TraceInfo,
    chrome_trace,
    read_trace,
    tracks_of,
    validate_chrome_trace,
    write_trace,
)
from megatron_het.trace.recorder import Recorder, Span


def ticking() -> Recorder:
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    return Recorder(clock=clock)


def test_an_idle_recorder_records_nothing() -> None:
    recorder = ticking()
    with recorder.span("forward mb0", "compute", micro_batch=0):
        pass
    assert recorder.stop() == []


def test_spans_nest_and_a_failed_block_is_recorded_with_its_error() -> None:
    recorder = ticking()
    recorder.start()
    with recorder.span("iteration 1", "iteration", iteration=1):
        with recorder.span("forward mb0", "compute", micro_batch=0):
            pass
        with pytest.raises(KeyError), recorder.span("wait", "p2p"):
            raise KeyError("lost")
    spans = recorder.stop()
    assert [(s.name, s.start_s, s.end_s) for s in spans] == [
        ("iteration 1", 1.0, 6.0),
        ("forward mb0", 2.0, 3.0),
        ("wait", 4.0, 5.0),
    ]
    assert spans[2].args == {"error": "KeyError"} and spans[1].args == {"micro_batch": 0}
    assert not recorder.active


def track(rank: int, spans: list[Span], predicted: list[Span] = ()) -> RankTrack:
    return RankTrack(
        rank=rank,
        node=rank // 2,
        node_label=f"node {rank // 2} (fast)",
        kind="emu-fast (emulated)",
        pipeline=0,
        stages=(rank,),
        tp_rank=0,
        tp=1,
        spans=tuple(spans),
        predicted=tuple(predicted),
    )


def test_a_trace_round_trips_and_keeps_its_threads_apart(tmp_path: pathlib.Path) -> None:
    measured = [
        Span("iteration 1", "iteration", 10.0, 12.0),
        Span("forward mb0", "compute", 10.5, 11.0),
    ]
    predicted = [Span("forward mb0", "compute", 10.0, 10.4), Span("forward p2p", "p2p", 10.2, 10.3)]
    tracks = [track(0, measured, predicted), track(3, measured[:1])]
    trace = chrome_trace(tracks, TraceInfo(iterations=(1,), clock="test"))
    assert validate_chrome_trace(trace) == []
    path = write_trace(trace, tmp_path / "t.json")
    back = read_trace(path)
    sides = tracks_of(back)
    assert [e["name"] for e in sides[0]["measured"]] == ["iteration 1", "forward mb0"]
    assert sides[0]["measured"][0]["ts"] == 0.0 and sides[0]["measured"][1]["ts"] == 500000.0
    assert sorted(e["name"] for e in sides[0]["predicted"]) == ["forward mb0", "forward p2p"]
    assert sides[3]["predicted"] == []
    processes = {
        e["pid"]: e["args"]["name"] for e in back["traceEvents"] if e["name"] == "process_name"
    }
    assert processes == {0: "node 0 (fast)", 1: "node 1 (fast)"}
    assert back["otherData"]["megatron_het"]["tracks"][1]["name"] == (
        "rank 3 · emu-fast (emulated) · stage 3 · tp 0/1"
    )


def test_another_json_file_is_not_taken_for_a_trace(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="is not a megatron_het trace"):
        read_trace(path)


def _named(events: list[dict]) -> dict:
    meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "r0"}}]
    return {"traceEvents": meta + events}


def _x(name: str, ts: float, dur: float, tid: int = 0) -> dict:
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": tid}


@pytest.mark.parametrize(
    ("trace", "problem"),
    [
        ([], "not an object with a traceEvents list"),
        (_named([_x("a", 0, 10), _x("b", 5, 10)]), "'b' at 5.000 us overlaps 'a'"),
        (_named([_x("a", 0, -1)]), "needs finite ts >= 0 and dur >= 0"),
        (_named([_x("a", 0, 1, tid=2)]), "thread (0, 2) has events but no thread_name"),
        (_named([{"name": "a", "ph": "Q", "pid": 0, "tid": 0}]), "unknown phase"),
        (_named([{"name": "thread_name", "ph": "M", "pid": 0, "tid": 1}]), "without args.name"),
    ],
)
def test_broken_traces_are_named(trace: object, problem: str) -> None:
    problems = validate_chrome_trace(trace)
    assert any(problem in p for p in problems), problems


def test_nested_and_back_to_back_spans_are_fine() -> None:
    trace = _named([_x("a", 0, 10), _x("b", 2, 3), _x("c", 5, 5), _x("d", 10, 2)])
    assert validate_chrome_trace(trace) == []


def test_perfetto_reads_the_trace(tmp_path: pathlib.Path) -> None:
    """Where the perfetto package and its trace processor can run (its binary is fetched on
    first use, so hosts without the internet skip)."""
    trace_processor = pytest.importorskip("perfetto.trace_processor")
    spans = [Span("iteration 1", "iteration", 1.0, 2.0), Span("forward mb0", "compute", 1.1, 1.5)]
    path = write_trace(
        chrome_trace([track(0, spans)], TraceInfo((1,), "test")), tmp_path / "t.json"
    )
    try:
        processor = trace_processor.TraceProcessor(trace=str(path))
    except Exception as exc:  # no binary and no way to fetch it
        pytest.skip(f"perfetto's trace processor cannot start here: {exc}")
    rows = list(processor.query("select name from slice order by ts"))
    processor.close()
    assert [r.name for r in rows] == ["iteration 1", "forward mb0"]
