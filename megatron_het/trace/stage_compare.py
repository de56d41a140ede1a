"""Measured against predicted, per stage, from a run's trace (:mod:`megatron_het.trace.chrome`).

For every profiled rank and every recorded iteration, the measured track is cut into:

- ``compute``: its forwards and backwards (TP collectives inside them included);
- ``wait``: the rest of its pipeline schedule, from the iteration's first forward to its last
  backward (blocked in transfer posts and waits: slow links, and the fill-and-drain bubble a
  rank cannot tell from a slow peer), plus the tied-embedding sum;
- ``dp_sync``: the DP gradient sync and ZeRO-1's parameter all-gather (recorded inside the
  optimizer step, counted here as the predictor counts it), and ``optimizer``: the rest of
  the optimizer step;
- ``iteration``: the whole iteration span (``other`` = what the four leave: batches, the
  metrics gather where a fast rank waits for the slowest, bookkeeping).

The predicted track of the same rank is cut alike (its schedule's compute, its idle time to the
pipeline's end, its DP sync and optimizer step; its iteration is the prediction's). Ranks of
one device group (a stage's TP ranks) are averaged into one row; a row is a pipeline's device
group with its stages, kind and TP degree.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from megatron_het.trace.chrome import tracks_of

PARTS = ("compute", "wait", "dp_sync", "optimizer", "other", "iteration")
_STEP_PARTS = {"DP gradient sync": "dp_sync", "optimizer step": "optimizer"}
_PARAMETER_GATHER = "parameter all-gather"


@dataclass(frozen=True)
class StageRow:
    """One device group's figures per iteration, seconds: ``measured[part]`` and
    ``predicted[part]`` (None without predicted tracks) for :data:`PARTS`."""

    label: str
    ranks: tuple[int, ...]
    measured: dict[str, float]
    predicted: dict[str, float] | None

    def difference(self, part: str) -> float | None:
        """Measured minus predicted, seconds (None without a prediction)."""
        if self.predicted is None:
            return None
        return self.measured[part] - self.predicted[part]


def _top_level(events: list[dict[str, Any]], category: str) -> list[dict[str, Any]]:
    return [e for e in events if e["cat"] == category]


def _sum_us(events: Iterable[dict[str, Any]]) -> float:
    return sum(float(e["dur"]) for e in events)


def split_iteration(events: list[dict[str, Any]], iteration_us: float | None = None) -> dict:
    """One rank's events of one iteration cut into :data:`PARTS`, seconds. ``iteration_us``
    overrides the iteration's length (the predicted side has no iteration span)."""
    compute = _top_level(events, "compute")
    parts = dict.fromkeys(PARTS, 0.0)
    parts["compute"] = _sum_us(compute) / 1e6
    if compute:
        first = min(e["ts"] for e in compute)
        last = max(e["ts"] + e["dur"] for e in compute)
        tied = _sum_us(e for e in events if e["name"] == "tied-embedding sync")
        parts["wait"] = max(0.0, last - first - _sum_us(compute) + tied) / 1e6
    for event in events:
        if event["cat"] != "step":
            continue
        part = _STEP_PARTS.get(event["name"])
        if part is not None:
            parts[part] += float(event["dur"]) / 1e6
        elif event["name"] == _PARAMETER_GATHER:  # inside the optimizer step
            parts["dp_sync"] += float(event["dur"]) / 1e6
            parts["optimizer"] -= float(event["dur"]) / 1e6
    spans = _top_level(events, "iteration")
    if iteration_us is None:
        iteration_us = _sum_us(spans)
    parts["iteration"] = iteration_us / 1e6
    used = sum(parts[p] for p in ("compute", "wait", "dp_sync", "optimizer"))
    parts["other"] = max(0.0, parts["iteration"] - used)
    return parts


def _per_iteration(events: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """A measured track's events by the iteration span that holds them."""
    out: dict[int, list[dict[str, Any]]] = {}
    spans = _top_level(events, "iteration")
    for span in spans:
        end = span["ts"] + span["dur"]
        out[int(span["args"]["iteration"])] = [e for e in events if span["ts"] <= e["ts"] <= end]
    return out


def _predicted_per_iteration(events: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        out.setdefault(int(event["args"].get("iteration", 0)), []).append(event)
    return out


def _mean(dicts: list[dict[str, float]]) -> dict[str, float]:
    return {p: statistics.fmean(d[p] for d in dicts) for p in PARTS}


def stage_rows(trace: dict[str, Any]) -> list[StageRow]:
    """The per-device-group rows of a trace, in pipeline and stage order."""
    ours = trace["otherData"]["megatron_het"]
    prediction = ours.get("prediction")
    iteration_s = None if prediction is None else prediction["iteration_time_s"]
    tracks = tracks_of(trace)
    groups: dict[tuple[int, tuple[int, ...]], list[dict[str, Any]]] = {}
    for info in ours["tracks"]:
        groups.setdefault((info["pipeline"], tuple(info["stages"])), []).append(info)
    rows = []
    for (pipeline, stages), infos in sorted(groups.items()):
        measured, predicted = [], []
        for info in infos:
            sides = tracks.get(info["rank"], {"measured": [], "predicted": []})
            measured += [split_iteration(ev) for ev in _per_iteration(sides["measured"]).values()]
            if iteration_s is not None and sides["predicted"]:
                predicted += [
                    split_iteration(ev, iteration_s * 1e6)
                    for ev in _predicted_per_iteration(sides["predicted"]).values()
                ]
        if not measured:
            continue
        first = infos[0]
        word = "stage" if len(stages) == 1 else "stages"
        label = f"p{pipeline} {word} {','.join(map(str, stages))} {first['kind']} tp{first['tp']}"
        ranks = tuple(sorted(i["rank"] for i in infos))
        rows.append(
            StageRow(label, ranks, _mean(measured), _mean(predicted) if predicted else None)
        )
    return rows


def largest_differences(rows: list[StageRow], count: int = 8) -> list[tuple[StageRow, str]]:
    """(row, part) pairs by how far measured is from predicted, largest first (parts other
    than ``iteration`` and ``other``, which the rest explain)."""
    pairs = [
        (row, part)
        for row in rows
        if row.predicted is not None
        for part in ("compute", "wait", "dp_sync", "optimizer")
    ]
    pairs.sort(key=lambda rp: -abs(rp[0].difference(rp[1]) or 0.0))
    return pairs[:count]


def format_report(trace: dict[str, Any]) -> str:
    """The text report: the per-stage table (measured / predicted seconds per iteration) and
    the largest differences, with the trace's iterations and notes."""
    ours = trace["otherData"]["megatron_het"]
    rows = stage_rows(trace)
    iterations = ours["iterations"]
    lines = [
        f"iterations {iterations[0]}-{iterations[-1]}, {len(ours['tracks'])} profiled rank(s); "
        "seconds per iteration, measured / predicted"
    ]
    width = max((len(r.label) for r in rows), default=5)
    header = f"{'stage':<{width}}  " + "  ".join(f"{p:>17}" for p in PARTS)
    lines += [header, "-" * len(header)]
    for row in rows:
        cells = []
        for part in PARTS:
            predicted = "-" if row.predicted is None else f"{row.predicted[part]:.4f}"
            cells.append(f"{row.measured[part]:>8.4f}/{predicted:<8}")
        lines.append(f"{row.label:<{width}}  " + "  ".join(cells))
    differences = largest_differences(rows)
    if differences:
        lines.append("largest differences (measured - predicted):")
        for row, part in differences:
            diff = row.difference(part) or 0.0
            base = row.predicted[part] if row.predicted else 0.0
            share = f" ({100 * diff / base:+.0f}%)" if base > 0 else ""
            lines.append(f"  {row.label} {part}: {diff:+.4f} s{share}")
    for note in ours.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)
