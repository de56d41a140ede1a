"""Reading a run's ``--metrics-file`` (JSON lines, see :mod:`megatron_het.training.metrics`) and
comparing the losses of two runs.

A resumed run drops the lines past the loaded iteration and appends its own, so a file holds
each iteration once; a line cut short by a killed run is skipped, and should an iteration
appear twice the later line counts.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def train_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The ``split == "train"`` lines of a metrics file in iteration order (empty if absent)."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    by_iteration: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("split") == "train" and "iteration" in record:
            by_iteration[int(record["iteration"])] = record
    return [by_iteration[i] for i in sorted(by_iteration)]


def losses(path: str | os.PathLike) -> dict[int, float]:
    """Iteration -> training loss of a metrics file."""
    return {int(r["iteration"]): float(r["loss"]) for r in train_records(path)}


@dataclass(frozen=True)
class LossComparison:
    """Per-iteration relative loss differences of a run against a reference.

    ``max_rel`` is the largest ``|a - b| / |b|`` over the iterations both have (inf when they
    share none, or a loss is not finite); ``missing`` lists the reference's iterations the run
    lacks; ``exact`` is True when every shared loss is bitwise equal.
    """

    max_rel: float
    iterations: int
    missing: tuple[int, ...]
    exact: bool
    per_iteration: tuple[tuple[int, float, float], ...]  # (iteration, run, reference)

    def within(self, rtol: float) -> bool:
        return not self.missing and self.iterations > 0 and self.max_rel <= rtol

    def describe(self) -> str:
        if self.iterations == 0:
            return "no iterations to compare"
        text = f"max rel diff {self.max_rel:.2e} over {self.iterations} iterations"
        if self.exact:
            text += " (bitwise equal)"
        if self.missing:
            text += f"; missing iterations {list(self.missing)}"
        return text


def compare_losses(run: dict[int, float], reference: dict[int, float]) -> LossComparison:
    """Compare two iteration -> loss maps (see :class:`LossComparison`)."""
    shared = sorted(set(run) & set(reference))
    missing = tuple(sorted(set(reference) - set(run)))
    worst = 0.0 if shared else math.inf
    for i in shared:
        a, b = run[i], reference[i]
        if not (math.isfinite(a) and math.isfinite(b)):
            worst = math.inf
            continue
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    exact = bool(shared) and all(run[i] == reference[i] for i in shared)
    return LossComparison(
        worst, len(shared), missing, exact, tuple((i, run[i], reference[i]) for i in shared)
    )


def median_field(records: Sequence[dict[str, Any]], name: str, skip_first: int = 0) -> float | None:
    """The median of ``name`` over ``records`` after the first ``skip_first`` (warm-up)
    iterations, or over all of them when there are no more; None when no record has it."""
    values = [float(r[name]) for r in records[skip_first:] if name in r]
    if not values:
        values = [float(r[name]) for r in records if name in r]
    return statistics.median(values) if values else None
