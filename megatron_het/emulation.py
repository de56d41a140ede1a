"""CPU emulation of slower accelerator kinds and of slow links, for dry runs of a mixed cluster.

An emulated kind is a CPU rank with a slowdown factor: after each timed compute region the
:class:`Emulator` waits ``(slowdown - 1)`` times the region's measured wall time, so the region
appears ``slowdown`` times slower. An :class:`EmulatedLink` delays a transfer to what it would take
on a link of the given bandwidth and latency. Both keep their own counters (no global state) and
take ``clock``/``sleep`` callables so tests can drive them with a fake clock.

Everything here is emulation; callers label its results as such.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, TypeVar

from megatron_het.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from megatron_het.cluster.accelerators import AcceleratorSpec

T = TypeVar("T")
GIB = 1024 ** 3


class EmulatedOutOfMemory(UserError):
    """An emulated device's memory cap would be exceeded: the plan does not fit that kind."""


@dataclass(frozen=True)
class EmulationStats:
    """Accounted time of an Emulator: ``measured_s`` really ran, ``injected_s`` was waited."""

    regions: int
    measured_s: float
    injected_s: float

    @property
    def emulated_s(self) -> float:
        """The time the regions would take on the emulated kind."""
        return self.measured_s + self.injected_s


class Emulator:
    """Slows compute regions of one CPU rank by ``slowdown`` and enforces an optional memory cap.

    ``clock`` returns seconds (default ``time.perf_counter``); ``sleep`` waits seconds (default
    ``time.sleep``). The emulator is not thread-safe: use one per rank.
    """

    def __init__(self, slowdown: float, memory_cap_gib: Optional[float] = None,
                 name: str = "emulated",
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], Any] = time.sleep) -> None:
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or slowdown < 1.0:
            raise UserError(f"{name}: slowdown must be a number >= 1.0 (an emulated kind can only "
                            f"be slower than the host CPU), got {slowdown!r}")
        if memory_cap_gib is not None and memory_cap_gib <= 0:
            raise UserError(f"{name}: memory_cap_gib must be positive, got {memory_cap_gib!r}")
        self.slowdown = float(slowdown)
        self.memory_cap_gib = memory_cap_gib
        self.name = name
        self._clock = clock
        self._sleep = sleep
        self._regions = 0
        self._measured_s = 0.0
        self._injected_s = 0.0

    @classmethod
    def from_spec(cls, spec: "AcceleratorSpec", clock: Callable[[], float] = time.perf_counter,
                  sleep: Callable[[float], Any] = time.sleep) -> "Emulator":
        """The emulator of an accelerator kind; a real kind gets slowdown 1 (no waiting)."""
        return cls(spec.slowdown, spec.memory_cap_gib, name=spec.label, clock=clock, sleep=sleep)

    @contextmanager
    def timed_region(self) -> Iterator[None]:
        """Time the body, then wait ``(slowdown - 1)`` x its time. A body that raises is neither
        accounted nor padded."""
        start = self._clock()
        yield
        measured = max(0.0, self._clock() - start)
        injected = (self.slowdown - 1.0) * measured
        if injected > 0:
            self._sleep(injected)
        self._regions += 1
        self._measured_s += measured
        self._injected_s += injected

    def compute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` inside :meth:`timed_region` and return its result."""
        with self.timed_region():
            return fn(*args, **kwargs)

    def check_memory(self, nbytes: int, what: str = "this plan") -> None:
        """Raise EmulatedOutOfMemory if ``nbytes`` exceed the cap; no cap means no limit."""
        if self.memory_cap_gib is None or nbytes <= self.memory_cap_gib * GIB:
            return
        raise EmulatedOutOfMemory(
            f"{self.name}: {what} needs {nbytes / GIB:.2f} GiB but the emulated memory cap is "
            f"{self.memory_cap_gib:g} GiB; use a plan with less memory per device (more stages, "
            f"tp or recompute) or raise memory_cap_gib")

    def stats(self) -> EmulationStats:
        return EmulationStats(self._regions, self._measured_s, self._injected_s)

    def reset(self) -> None:
        """Zero the counters."""
        self._regions, self._measured_s, self._injected_s = 0, 0.0, 0.0


class EmulatedLink:
    """A link of ``bandwidth_gbps`` GB/s (gigabytes per second) and ``latency_s`` seconds.

    ``delay(nbytes)`` is the modelled transfer time; ``wait(nbytes, elapsed_s)`` sleeps whatever of
    it the real transfer (``elapsed_s``) did not already take, and accounts it.
    """

    def __init__(self, bandwidth_gbps: float, latency_s: float,
                 sleep: Callable[[float], Any] = time.sleep) -> None:
        if isinstance(bandwidth_gbps, bool) or not bandwidth_gbps > 0:
            raise UserError(f"emulated link: bandwidth_gbps must be positive, got "
                            f"{bandwidth_gbps!r}")
        if isinstance(latency_s, bool) or not latency_s >= 0:
            raise UserError(f"emulated link: latency_s must be zero or more, got {latency_s!r}")
        self.bandwidth_gbps = float(bandwidth_gbps)
        self.latency_s = float(latency_s)
        self._sleep = sleep
        self._transfers = 0
        self._bytes = 0
        self._injected_s = 0.0

    def delay(self, nbytes: int) -> float:
        """Seconds a transfer of ``nbytes`` takes on this link."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return self.latency_s + nbytes / (self.bandwidth_gbps * 1e9)

    def wait(self, nbytes: int, elapsed_s: float = 0.0) -> float:
        """Sleep ``delay(nbytes) - elapsed_s`` (if positive) and return the seconds slept."""
        injected = max(0.0, self.delay(nbytes) - max(0.0, elapsed_s))
        if injected > 0:
            self._sleep(injected)
        self._transfers += 1
        self._bytes += nbytes
        self._injected_s += injected
        return injected

    @property
    def injected_s(self) -> float:
        return self._injected_s

    @property
    def bytes_sent(self) -> int:
        return self._bytes

    @property
    def transfers(self) -> int:
        return self._transfers

    def __repr__(self) -> str:
        return (f"EmulatedLink(bandwidth_gbps={self.bandwidth_gbps:g}, "
                f"latency_s={self.latency_s:g}) (emulated)")
