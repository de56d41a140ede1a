"""Timing device work without exposing launch latency: host clocks on CPU, events elsewhere.

On CPU a piece of work is done when the call that issues it returns, so the host clock times
it. On CUDA/ROCm (and Ascend) the host only enqueues kernels: a host clock would time the
launches, and synchronising after every region would expose the launch latency the queue
normally hides. There the marks are device events recorded on the current stream, and they are
read all at once after ONE synchronisation.

:func:`pass_timer` picks the marks for a device (the profiler times its passes with them);
:class:`RegionClock` sums labelled regions with them (the pipeline executor's compute and
transfer regions).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    """Wait for all the device's queued work, on every stream (CUDA and ROCm; a no-op
    elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synchronize_stream(device: torch.device) -> None:
    """Wait for the work queued on the device's current stream (CUDA and ROCm; Ascend with
    torch_npu; a no-op on the CPU): the compute, and the collectives whose handles were waited
    on. Collectives still in flight on the backends' own streams (ZeRO's parameter all-gathers
    under --overlap-param-gather) keep running under the next forward, whose code waits for
    their handles; a whole-device synchronisation would wait for them here."""
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    current_stream = getattr(module, "current_stream", None)
    if current_stream is not None:
        current_stream(device).synchronize()


class HostTimer:
    """Marks of the host clock, for CPU work (done by the time the call that issues it returns).
    ``elapsed_s(start, end)`` is the seconds between two marks."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock

    def mark(self) -> float:
        return self._clock()

    def finish(self) -> None:
        """Nothing to wait for."""

    def elapsed_s(self, start: float, end: float) -> float:
        return end - start


class EventTimer:
    """Marks that are device events, for accelerator work the host only enqueues: ``mark()``
    records a new timing event (``make_event()``) on the current stream, ``finish()`` waits
    once, for the last mark (every earlier one is on the same stream, so done too), after which
    ``elapsed_s(start, end)`` reads the device time between two events (their
    ``elapsed_time``, in ms). Work on other streams is not waited for: the collectives a
    pipeline leaves in flight (overlapped gradient reduce-scatters) go on."""

    def __init__(self, make_event: Callable[[], Any]) -> None:
        self._make_event = make_event
        self._last: Any = None

    def mark(self) -> Any:
        event = self._make_event()
        event.record()
        self._last = event
        return event

    def finish(self) -> None:
        if self._last is not None:
            self._last.synchronize()
            self._last = None

    def elapsed_s(self, start: Any, end: Any) -> float:
        if self._last is not None:
            raise RuntimeError("device events read before finish() waited for them")
        return start.elapsed_time(end) / 1e3


Timer = HostTimer | EventTimer


def pass_timer(device: torch.device) -> Timer:
    """The host clock on the CPU; the device's timing events elsewhere (``torch.cuda`` for CUDA
    and ROCm, ``torch.npu`` with torch_npu: any module of that name with an ``Event``).
    Creates nothing on the device until the first mark."""
    if device.type == "cpu":
        return HostTimer()
    module = getattr(torch, device.type)
    return EventTimer(lambda: module.Event(enable_timing=True))


class RegionClock:
    """Sums region durations per label; the wall time spans :meth:`start` to :meth:`totals`.

    ``timer`` gives the marks (default :func:`pass_timer` of ``device``); with device events
    nothing waits for the device until :meth:`totals`.
    """

    def __init__(self, device: torch.device, timer: Timer | None = None) -> None:
        self.timer = pass_timer(device) if timer is None else timer
        self._regions: dict[str, list[tuple[Any, Any]]] = {}
        self._start: Any = None
        # the host thread's place: (label of the open region, or "outside"; since when)
        self._place: tuple[str, float] = ("outside", time.monotonic())

    def activity(self) -> tuple[str, float]:
        """Where the host thread is and for how many seconds: the label of the region it is
        in, or "outside" (between regions, or outside the pipeline's run). Read from other
        threads (a heartbeat), so a rank stuck in a region can be told from one waiting."""
        label, since = self._place
        return label, time.monotonic() - since

    @property
    def uses_events(self) -> bool:
        """True when regions are timed by device events (read at :meth:`totals`)."""
        return isinstance(self.timer, EventTimer)

    def start(self) -> None:
        """Begin the wall span (and forget earlier regions)."""
        self._regions = {}
        self._start = self.timer.mark()

    @contextlib.contextmanager
    def region(self, label: str) -> Iterator[None]:
        """Time the work queued inside the block under ``label``."""
        begin = self.timer.mark()
        self._place = (label, time.monotonic())
        try:
            yield
        finally:
            self._place = ("outside", time.monotonic())
        self._regions.setdefault(label, []).append((begin, self.timer.mark()))

    def totals(self) -> tuple[dict[str, float], float]:
        """``({label: seconds}, wall seconds)``, after one synchronisation with events."""
        end = self.timer.mark()
        self.timer.finish()
        sums = {
            label: sum(self.timer.elapsed_s(b, e) for b, e in pairs)
            for label, pairs in self._regions.items()
        }
        return sums, self.timer.elapsed_s(self._start, end)
