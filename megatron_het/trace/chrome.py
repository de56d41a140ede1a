"""The Chrome trace of a run: every profiled rank's spans, and its predicted ones beside them.

The file is the Trace Event Format's JSON object form (``{"traceEvents": [...]}``), which
Perfetto (ui.perfetto.dev and its trace processor), ``chrome://tracing`` and TensorBoard's
trace viewer open:

- one process per node (``pid`` = the cluster's node index, named with its node groups);
- one thread per rank (``tid = 4 * rank``), named ``rank R · KIND · stage S · tp T/N`` (an
  interleaved rank lists its stages; an emulated kind says "(emulated)"), and beside it the
  predictor's simulated schedule of the same iterations: its compute and steps
  (``tid = 4 * rank + 1``) and its transfers (``4 * rank + 2``; a transfer the schedule
  overlaps with compute runs beside it, so it gets a thread of its own);
- a complete event (``ph: "X"``) per span, times in microseconds from the first span, the
  span's category as ``cat`` and its details as ``args``.

What the trace was made of (the tracks, the window, the prediction's per-stage figures) rides
in ``otherData["megatron_het"]`` for :mod:`tools.trace_report`-style readers;
:func:`validate_chrome_trace` checks the format's rules a viewer relies on.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_het.trace.recorder import Span

FORMAT = "megatron_het.trace/1"
THREADS_PER_RANK = 4  # measured, predicted, predicted transfers, one spare
_PHASES = {"X", "M", "B", "E", "i", "I", "C", "s", "t", "f"}
_NEST_TOLERANCE_US = 0.01  # rounding to 3 decimals of a microsecond


@dataclass(frozen=True)
class RankTrack:
    """One profiled rank's place and spans. ``spans`` are on the merged clock (seconds);
    ``predicted`` likewise, placed at the measured iterations' starts."""

    rank: int
    node: int
    node_label: str
    kind: str  # the accelerator's label ("... (emulated)" for emulated kinds)
    pipeline: int
    stages: tuple[int, ...]
    tp_rank: int
    tp: int
    spans: tuple[Span, ...] = ()
    predicted: tuple[Span, ...] = ()

    @property
    def name(self) -> str:
        stages = ",".join(map(str, self.stages))
        word = "stage" if len(self.stages) == 1 else "stages"
        pipeline = f"pipeline {self.pipeline} " if self.pipeline else ""
        return (
            f"rank {self.rank} · {self.kind} · {pipeline}{word} {stages} · "
            f"tp {self.tp_rank}/{self.tp}"
        )

    def describe(self) -> dict[str, Any]:
        """The track's place without its spans (JSON)."""
        return {
            "rank": self.rank,
            "node": self.node,
            "kind": self.kind,
            "pipeline": self.pipeline,
            "stages": list(self.stages),
            "tp_rank": self.tp_rank,
            "tp": self.tp,
            "name": self.name,
        }


@dataclass(frozen=True)
class TraceInfo:
    """What the trace holds beyond its tracks: the iterations recorded, how the clocks were
    aligned, and the prediction's figures (``prediction``: its JSON, or None)."""

    iterations: tuple[int, ...]
    clock: str
    prediction: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


def chrome_trace(tracks: Sequence[RankTrack], info: TraceInfo) -> dict[str, Any]:
    """The trace's JSON object (see the module docstring)."""
    starts = [s.start_s for t in tracks for s in (*t.spans, *t.predicted)]
    origin = min(starts, default=0.0)
    events: list[dict[str, Any]] = []
    nodes = {t.node: t.node_label for t in sorted(tracks, key=lambda t: t.node)}
    for node, label in nodes.items():
        events.append(_meta("process_name", node, 0, {"name": label}))
        events.append(_meta("process_sort_index", node, 0, {"sort_index": node}))
    for track in sorted(tracks, key=lambda t: t.rank):
        tid = THREADS_PER_RANK * track.rank
        threads = {
            tid: (track.name, track.spans),
            tid + 1: (
                f"rank {track.rank} · predicted",
                tuple(s for s in track.predicted if s.category != "p2p"),
            ),
            tid + 2: (
                f"rank {track.rank} · predicted transfers",
                tuple(s for s in track.predicted if s.category == "p2p"),
            ),
        }
        for number, (name, spans) in threads.items():
            if number != tid and not spans:
                continue
            events.append(_meta("thread_name", track.node, number, {"name": name}))
            events.append(_meta("thread_sort_index", track.node, number, {"sort_index": number}))
            events += [_complete(s, track.node, number, origin) for s in spans]
    other = {
        "format": FORMAT,
        "iterations": list(info.iterations),
        "clock": info.clock,
        "origin_s": origin,
        "tracks": [t.describe() for t in sorted(tracks, key=lambda t: t.rank)],
        "prediction": info.prediction,
        "notes": list(info.notes),
        **info.extra,
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"megatron_het": other}}


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _complete(span: Span, pid: int, tid: int, origin: float) -> dict[str, Any]:
    return {
        "name": span.name,
        "cat": span.category,
        "ph": "X",
        "ts": round((span.start_s - origin) * 1e6, 3),
        "dur": round(max(0.0, span.end_s - span.start_s) * 1e6, 3),
        "pid": pid,
        "tid": tid,
        "args": span.args,
    }


def write_trace(trace: dict[str, Any], path: pathlib.Path) -> pathlib.Path:
    """Write ``trace`` as JSON, atomically (a reader never sees half a file)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(trace, separators=(",", ":")), encoding="utf-8")
    partial.replace(path)
    return path


def read_trace(path: pathlib.Path) -> dict[str, Any]:
    """A trace this module wrote: its JSON, with ``otherData["megatron_het"]`` checked to be
    ours (ValueError naming the file otherwise)."""
    trace = json.loads(path.read_text(encoding="utf-8"))
    ours = trace.get("otherData", {}).get("megatron_het") if isinstance(trace, dict) else None
    if not isinstance(ours, dict) or ours.get("format") != FORMAT:
        raise ValueError(f"{path} is not a megatron_het trace ({FORMAT})")
    return trace


def tracks_of(trace: dict[str, Any]) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """Per rank, its complete events: ``{rank: {"measured": [...], "predicted": [...]}}`` in
    time order."""
    out: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        rank, side = divmod(int(event["tid"]), THREADS_PER_RANK)
        which = "predicted" if side else "measured"
        out.setdefault(rank, {"measured": [], "predicted": []})[which].append(event)
    for sides in out.values():
        for events in sides.values():
            events.sort(key=lambda e: (e["ts"], -e["dur"]))
    return out


def validate_chrome_trace(trace: Any) -> list[str]:
    """The Trace Event Format's rules a viewer relies on, as a list of problems (empty: none):
    a ``traceEvents`` list; each event's phase known, name a string, pid and tid integers;
    complete events with finite ``ts >= 0`` and ``dur >= 0``; metadata events naming their
    process or thread; every thread with events named; and the complete events of each
    thread nested (a span that starts inside another ends inside it), which is how viewers
    stack them."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["the trace is not an object with a traceEvents list"]
    problems: list[str] = []
    named: set[tuple[int, int]] = set()
    threads: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for i, event in enumerate(trace["traceEvents"]):
        where = f"event {i}"
        if not isinstance(event, dict) or event.get("ph") not in _PHASES:
            problems.append(f"{where}: unknown phase {event!r:.80}")
            continue
        if not isinstance(event.get("name"), str):
            problems.append(f"{where}: name is not a string")
        pid, tid = event.get("pid"), event.get("tid")
        if not isinstance(pid, int) or not isinstance(tid, int):
            problems.append(f"{where}: pid and tid must be integers")
            continue
        if event["ph"] == "M":
            problems += _check_meta(where, event)
            if event["name"] == "thread_name":
                named.add((pid, tid))
        elif event["ph"] == "X":
            ts, dur = _time(event.get("ts")), _time(event.get("dur"))
            if ts is None or dur is None:
                problems.append(f"{where}: complete event needs finite ts >= 0 and dur >= 0")
                continue
            threads.setdefault((pid, tid), []).append((ts, ts + dur, event["name"]))
    for key, spans in threads.items():
        if key not in named:
            problems.append(f"thread {key} has events but no thread_name")
        problems += _check_nesting(key, spans)
    return problems


def _time(value: Any) -> float | None:
    """A finite, non-negative number of microseconds, or None."""
    if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def _check_meta(where: str, event: dict[str, Any]) -> list[str]:
    args = event.get("args")
    if event["name"] in ("process_name", "thread_name"):
        if not isinstance(args, dict) or not isinstance(args.get("name"), str):
            return [f"{where}: {event['name']} without args.name"]
    elif event["name"] in ("process_sort_index", "thread_sort_index"):
        if not isinstance(args, dict) or not isinstance(args.get("sort_index"), int):
            return [f"{where}: {event['name']} without an integer args.sort_index"]
    return []


def _check_nesting(key: tuple[int, int], spans: list[tuple[float, float, str]]) -> list[str]:
    problems: list[str] = []
    stack: list[tuple[float, float, str]] = []
    for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
        while stack and start >= stack[-1][1] - _NEST_TOLERANCE_US:
            stack.pop()
        if stack and end > stack[-1][1] + _NEST_TOLERANCE_US:
            problems.append(
                f"thread {key}: {name!r} at {start:.3f} us overlaps {stack[-1][2]!r} "
                f"without nesting in it"
            )
        stack.append((start, end, name))
    return problems
