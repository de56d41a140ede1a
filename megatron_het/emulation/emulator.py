"""The emulator of a slower accelerator kind: a CPU rank's compute regions padded to its time.

An emulated kind is a CPU rank with a slowdown factor: each timed compute region is made to last
``slowdown`` times what it would take on a core of its own. With a single-threaded rank that time
is the thread's CPU time, and the :class:`Emulator` waits until ``slowdown x CPU time`` has passed
since the region began: a region slowed by other processes sharing the host (more emulated ranks
than cores) still lasts what the emulated device would take, as long as the sharing costs less
than the slowdown (regions where it costs more are counted as ``late``). Regions given the same
``key`` do the same work (a pipeline stage's forward of one micro-batch, say); they are all
padded to one reference CPU time, the least CPU time of the key's last ``reference_window``
(128) regions (``reference_quantile`` > 0 takes that quantile of them instead), since what a
host adds to the CPU time (caches a rank finds cold after waiting while other ranks ran,
preemption) is a property of the host and not of the kind, whose data would stay in its own
memory. The window keeps the reference from drifting: the least of all regions so far keeps
falling as their number grows (by 7-9% over a 700-region run on a 2-core host), so an emulated
kind would speed up the longer it ran and a long run would look faster than a short one of the
same work. With several threads per rank the basis is the region's wall time and the wait
``(slowdown - 1)`` times it.

Keys given a fixed reference (``fixed_reference_s``, for instance a stage's forward and backward
from a profile of this host, see ``--emulation-profile``) skip the measurement: such a region
lasts ``slowdown x`` its fixed CPU time whatever the host does meanwhile, so the emulated kind
keeps one speed while the host's own speed drifts (by 4-12% over minutes on a shared 2-core
host), as a real device would. A region whose own time already exceeds that (the host stalled
it: preemption, or CPU time inflated by a busy sibling core, up to 4x for single regions on a
shared 2-core host) is counted late, and its overrun is made up by padding the following
fixed regions that much less: the kind's schedule, not each region, is what is kept. What is
still owed at the end (``behind_s``) is how much slower than the kind the rank's figures are.

The emulator keeps its own counters (no global state) and takes ``clock``/``sleep``/``cpu_clock``
callables so tests can drive it with a fake clock. It is the pipeline executor's region timer
(:class:`~megatron_het.pipeline.executor.RegionTimer`).

Everything here is emulation; callers label its results as such.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from megatron_het.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from megatron_het.cluster.accelerators import AcceleratorSpec

T = TypeVar("T")
GIB = 1024**3


# Keyed regions are padded to this quantile (0: the least) of the CPU times of the key's last
# REFERENCE_WINDOW regions (see the module docstring).
REFERENCE_WINDOW = 128
REFERENCE_QUANTILE = 0.0


class _KeyHistory:
    """The CPU times of one key's last ``window`` regions, in arrival order and sorted."""

    def __init__(self, window: int, quantile: float) -> None:
        self.window, self.quantile = window, quantile
        self.recent: deque[float] = deque()
        self.ordered: list[float] = []

    def add(self, cpu_s: float) -> float:
        """Record one region's CPU time; return the key's reference CPU time now."""
        self.recent.append(cpu_s)
        bisect.insort(self.ordered, cpu_s)
        if len(self.recent) > self.window:
            oldest = self.recent.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, oldest)]
        return self.ordered[int(self.quantile * len(self.ordered))]


class EmulatedOutOfMemory(UserError):
    """An emulated device's memory cap would be exceeded: the plan does not fit that kind."""


@dataclass(frozen=True)
class EmulationStats:
    """Accounted time of an Emulator: ``measured_s`` really ran (wall), ``injected_s`` was
    waited; ``cpu_s`` is the regions' CPU time on the CPU basis (else their wall time) and
    ``late`` counts regions that already took longer than the length they were to be padded to
    (the host was too busy to emulate the kind there); ``behind_s`` of the fixed regions'
    overrun was not made up by shorter padding after it, out of ``scheduled_s``."""

    regions: int
    measured_s: float
    injected_s: float
    cpu_s: float = 0.0
    late: int = 0
    behind_s: float = 0.0  # fixed regions' overrun not made up by the regions after them
    scheduled_s: float = 0.0  # what the fixed regions were to last on the emulated kind

    @property
    def emulated_s(self) -> float:
        """The time the regions would take on the emulated kind."""
        return self.measured_s + self.injected_s


class Emulator:
    """Slows compute regions of one CPU rank by ``slowdown`` and enforces an optional memory cap.

    ``clock`` returns wall seconds (default ``time.perf_counter``); ``sleep`` waits seconds
    (default ``time.sleep``); ``cpu_clock`` returns the CPU seconds of the calling thread
    (``time.thread_time``) for the CPU basis, or None for the wall basis (see the module doc).
    ``reference_window`` and ``reference_quantile`` set the reference CPU time of keyed regions;
    ``fixed_reference_s`` maps keys to a fixed reference CPU time instead (CPU basis only).
    The emulator is not thread-safe: use one per rank.
    """

    def __init__(
        self,
        slowdown: float,
        memory_cap_gib: float | None = None,
        name: str = "emulated",
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], Any] = time.sleep,
        cpu_clock: Callable[[], float] | None = None,
        reference_window: int = REFERENCE_WINDOW,
        reference_quantile: float = REFERENCE_QUANTILE,
        fixed_reference_s: Mapping[Hashable, float] | None = None,
    ) -> None:
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or slowdown < 1.0:
            raise UserError(
                f"{name}: slowdown must be a number >= 1.0 (an emulated kind can only "
                f"be slower than the host CPU), got {slowdown!r}"
            )
        if memory_cap_gib is not None and memory_cap_gib <= 0:
            raise UserError(f"{name}: memory_cap_gib must be positive, got {memory_cap_gib!r}")
        self.slowdown = float(slowdown)
        self.memory_cap_gib = memory_cap_gib
        self.name = name
        self._clock = clock
        self._sleep = sleep
        self._cpu_clock = cpu_clock
        if reference_window < 1 or not 0.0 <= reference_quantile < 1.0:
            raise ValueError(
                f"need reference_window >= 1 and 0 <= reference_quantile < 1, got "
                f"{reference_window} and {reference_quantile}"
            )
        self._reference = (reference_window, reference_quantile)
        fixed = dict(fixed_reference_s or {})
        if fixed and cpu_clock is None:
            raise ValueError("fixed reference CPU times need the CPU basis (a cpu_clock)")
        for key, seconds in fixed.items():
            if (
                isinstance(seconds, bool)
                or not isinstance(seconds, (int, float))
                or not seconds > 0
            ):
                raise ValueError(
                    f"fixed reference CPU time of {key!r} must be positive, got {seconds!r}"
                )
        self._fixed = {key: float(seconds) for key, seconds in fixed.items()}
        self.reset()

    @property
    def basis(self) -> str:
        """ "cpu" (the thread's CPU time sets the region's length) or "wall"."""
        return "wall" if self._cpu_clock is None else "cpu"

    @classmethod
    def from_spec(
        cls,
        spec: AcceleratorSpec,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], Any] = time.sleep,
        cpu_clock: Callable[[], float] | None = None,
        threads: int | None = None,
        fixed_reference_s: Mapping[Hashable, float] | None = None,
        extra_slowdown: float = 1.0,
    ) -> Emulator:
        """The emulator of an accelerator kind; a real kind gets slowdown 1 (no waiting).
        Without ``cpu_clock`` the CPU basis (``time.thread_time``) is used when the rank computes
        on one thread (``threads``, default ``torch.get_num_threads()``), else the wall basis.
        ``fixed_reference_s`` (CPU basis only) fixes the reference CPU time of those keys;
        ``extra_slowdown`` makes this rank that many times slower than its kind (a straggler)."""
        if cpu_clock is None:
            if threads is None:
                import torch

                threads = torch.get_num_threads()
            cpu_clock = time.thread_time if threads == 1 else None
        if fixed_reference_s and cpu_clock is None:
            raise UserError(
                f"{spec.label}: device times from a profile need one compute thread "
                f"per rank (OMP_NUM_THREADS=1); this rank has {threads}"
            )
        if isinstance(extra_slowdown, bool) or not extra_slowdown >= 1.0:
            raise UserError(
                f"{spec.label}: an extra slowdown must be >= 1.0, got {extra_slowdown!r}"
            )
        return cls(
            spec.slowdown * extra_slowdown,
            spec.memory_cap_gib,
            name=spec.label,
            clock=clock,
            sleep=sleep,
            cpu_clock=cpu_clock,
            fixed_reference_s=fixed_reference_s,
        )

    @property
    def fixed_reference_s(self) -> dict[Hashable, float]:
        """The keys whose reference CPU time is fixed, and those times."""
        return dict(self._fixed)

    @contextmanager
    def timed_region(self, key: Hashable | None = None) -> Iterator[None]:
        """Time the body, then wait until it has lasted ``slowdown`` x its CPU time (CPU basis;
        with a ``key``, the key's reference CPU time, this region included) or wait
        ``(slowdown - 1)`` x its wall time (wall basis); a key with a fixed reference is padded
        to ``slowdown`` x that. A body that raises is neither accounted nor padded."""
        cpu_start = self._cpu_clock() if self._cpu_clock is not None else 0.0
        start = self._clock()
        yield
        measured = max(0.0, self._clock() - start)
        if self._cpu_clock is None:
            cpu = measured
            injected = (self.slowdown - 1.0) * measured
        else:
            cpu = max(0.0, self._cpu_clock() - cpu_start)
            work, fixed = cpu, key is not None and key in self._fixed
            if fixed:
                work = self._fixed[key]
                self._scheduled_s += self.slowdown * work
            elif key is not None:
                history = self._history.get(key)
                if history is None:
                    history = self._history[key] = _KeyHistory(*self._reference)
                work = history.add(cpu)
            injected = self.slowdown * work - measured
            if injected < 0:
                if self.slowdown > 1.0 or fixed:
                    self._late += 1
                if fixed:  # owed: the next fixed regions are padded that much less
                    self._behind_s -= injected
                injected = 0.0
            elif fixed and self._behind_s > 0:
                repaid = min(self._behind_s, injected)
                self._behind_s -= repaid
                injected -= repaid
        if injected > 0:
            self._sleep(injected)
        self._regions += 1
        self._measured_s += measured
        self._cpu_s += cpu
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
            f"tp or recompute) or raise memory_cap_gib"
        )

    def stats(self) -> EmulationStats:
        return EmulationStats(
            self._regions,
            self._measured_s,
            self._injected_s,
            self._cpu_s,
            self._late,
            self._behind_s,
            self._scheduled_s,
        )

    def reset(self) -> None:
        """Zero the counters and forget every key's reference CPU times."""
        self._regions, self._measured_s, self._injected_s = 0, 0.0, 0.0
        self._cpu_s, self._late = 0.0, 0
        self._behind_s, self._scheduled_s = 0.0, 0.0
        self._history: dict[Hashable, _KeyHistory] = {}


__all__ = [
    "REFERENCE_QUANTILE",
    "REFERENCE_WINDOW",
    "EmulatedOutOfMemory",
    "EmulationStats",
    "Emulator",
]
