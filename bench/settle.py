"""When a run's iteration times have settled: the warm-up a benchmark drops.

A run's first iterations are slower (allocations, caches, the host's page faults and, on an
emulated cluster, the emulator's estimates of each region's CPU time), and how many varies
from run to run: a fixed count either keeps some of them or drops good ones. The rule here:

    the warm-up ends at the first iteration k >= ``least`` from which ``run`` consecutive
    iterations all lie within ``tolerance`` of the median of iterations k..n

keeping at least ``keep`` iterations. A run that never settles keeps its last ``keep`` and
says so (``settled`` False), so a report can flag it rather than pass it off as a steady
figure.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Settled:
    """``dropped`` leading iterations are warm-up; ``kept`` are the rest; ``settled`` is False
    when no iteration met the rule (then ``kept`` is the last ``keep``)."""

    dropped: int
    kept: tuple[float, ...]
    settled: bool

    @property
    def median(self) -> float:
        return statistics.median(self.kept)


def settle(
    times: Sequence[float],
    least: int = 1,
    keep: int = 3,
    tolerance: float = 0.05,
    run: int = 3,
) -> Settled:
    """Split ``times`` (one run's iteration times, in order) at the end of its warm-up (see
    the module docstring). ValueError when fewer than ``least + keep`` times are given."""
    if least < 0 or keep < 1 or run < 1 or tolerance <= 0:
        raise ValueError("least >= 0, keep >= 1, run >= 1 and tolerance > 0, please")
    if len(times) < least + keep:
        raise ValueError(
            f"{len(times)} iteration times cannot drop {least} and keep {keep}; run more iterations"
        )
    last_start = len(times) - keep
    for k in range(least, last_start + 1):
        middle = statistics.median(times[k:])
        window = times[k : k + min(run, len(times) - k)]
        if all(abs(t - middle) <= tolerance * middle for t in window):
            return Settled(k, tuple(times[k:]), True)
    return Settled(last_start, tuple(times[last_start:]), False)
