"""How a CPU host's compute slows down when several of its processes compute at once.

CPU-emulated kinds run every rank as a single-threaded process of one machine, often more
processes than cores. A profile measured by one process alone on an idle core does not describe
that: while ``n`` ranks compute, each gets about ``cores / n`` of a core (less where they also
contend for caches and memory bandwidth). An emulated rank's injected wait (its slowdown) and a
rank blocked in a transfer use no core, so how many ranks compute at once changes along the
schedule. :class:`HostSharing` holds one host's measured figures
(:attr:`~megatron_het.perf.measure.profile_format.Profile.host_sharing`, from
:func:`~megatron_het.emulation.host_measure.measure_host_sharing`) and turns them into the
progress rate of one computing process; :class:`HostCores` is the rate model of a cluster's
hosts for the predictor's simulator (:class:`~megatron_het.perf.schedule.simulator.CoreSharing`).
Everything here is emulation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_het.errors import UserError


@dataclass(frozen=True)
class HostSharing:
    """``slowdown[n - 1]``: how many times longer a compute pass takes with ``n`` processes
    computing at once on the host than the profile's times say (``slowdown[0]`` is 1 when
    measured against the host's own single process; see :func:`measure_host_sharing`)."""

    slowdown: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.slowdown or any(v <= 0 for v in self.slowdown):
            raise UserError(
                f"host sharing figures must be positive numbers, got "
                f"{list(self.slowdown)}; measure them with measure_host_sharing"
            )

    def factor(self, processes: float) -> float:
        """The slowdown with ``processes`` computing (interpolated between whole counts; past
        the measured counts, in proportion to the count, as for full cores)."""
        if processes <= 1.0:
            return self.slowdown[0]
        n = len(self.slowdown)
        if processes >= n:
            return self.slowdown[-1] * processes / n
        low = int(processes)
        w = processes - low
        return (1 - w) * self.slowdown[low - 1] + w * self.slowdown[low]

    def rate(self, processes: float) -> float:
        """Work seconds (as measured alone) one computing process does per wall second."""
        return 1.0 / self.factor(processes)

    def finish_time(self, works: Sequence[float]) -> float:
        """Wall seconds until the last of ``works`` (single-process seconds each, one process
        per work, all starting together) is done, sharing the host (processor sharing)."""
        left = sorted(w for w in works if w > 0)
        now, done = 0.0, 0.0
        for i, w in enumerate(left):  # the smallest remaining work finishes first
            now += (w - done) * self.factor(len(left) - i)
            done = w
        return now


class HostCores:
    """The rate of compute on each node of a cluster whose ranks share host cores
    (:class:`~megatron_het.perf.schedule.simulator.CoreSharing`): ``sharing[node]``'s rate, or a
    core per process on a node without figures."""

    def __init__(self, sharing: Mapping[int, HostSharing]) -> None:
        self.sharing = dict(sharing)

    def rate(self, node: int, computing: int) -> float:
        figures = self.sharing.get(node)
        return 1.0 if figures is None else figures.rate(computing)

    def factor(self, node: int, processes: float) -> float:
        """How many times longer work takes on ``node`` with ``processes`` working at once."""
        figures = self.sharing.get(node)
        return 1.0 if figures is None else figures.factor(processes)


__all__ = ["HostCores", "HostSharing"]
