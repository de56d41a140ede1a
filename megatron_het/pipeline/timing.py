"""Timing of the executor's regions without exposing launch latency on accelerators.

On CPU a region's time is the host clock around it. On CUDA/ROCm the host only queues kernels,
so a host clock measures launches, and synchronising after every region would expose the launch
latency the queue normally hides. There the clock records a pair of CUDA events around each
region on the current stream and reads them all once, at :meth:`RegionClock.totals`, after one
synchronisation of the last event.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Optional

import torch

EventFactory = Callable[[], Any]  # makes an object with record(), synchronize(), elapsed_time()


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


class RegionClock:
    """Sums region durations per label; ``wall`` spans :meth:`start` to :meth:`totals`.

    ``device``: where the regions' work runs; ``event_factory`` overrides the CUDA event type
    (tests pass a fake), None picks host clocks on CPU and CUDA events on accelerators.
    """

    def __init__(self, device: torch.device, event_factory: Optional[EventFactory] = None) -> None:
        if event_factory is None and device.type == "cuda":
            event_factory = _cuda_event
        self._events = event_factory
        self._pairs: dict[str, list[tuple[Any, Any]]] = {}
        self._host: dict[str, float] = {}
        self._start: Any = None

    @property
    def uses_events(self) -> bool:
        """True when regions are timed by device events (read at :meth:`totals`)."""
        return self._events is not None

    def _mark(self) -> Any:
        if self._events is None:
            return time.perf_counter()
        event = self._events()
        event.record()
        return event

    def start(self) -> None:
        """Begin the wall span (and forget earlier regions)."""
        self._pairs, self._host = {}, {}
        self._start = self._mark()

    @contextlib.contextmanager
    def region(self, label: str) -> Iterator[None]:
        """Time the work queued inside the block under ``label``."""
        begin = self._mark()
        yield
        end = self._mark()
        if self._events is None:
            self._host[label] = self._host.get(label, 0.0) + end - begin
        else:
            self._pairs.setdefault(label, []).append((begin, end))

    def totals(self) -> tuple[dict[str, float], float]:
        """``({label: seconds}, wall seconds)``; with events, one synchronisation on the last
        event, then every pair is read."""
        end = self._mark()
        if self._events is None:
            return dict(self._host), end - self._start
        end.synchronize()
        sums = {label: sum(b.elapsed_time(e) for b, e in pairs) / 1e3
                for label, pairs in self._pairs.items()}
        return sums, self._start.elapsed_time(end) / 1e3
