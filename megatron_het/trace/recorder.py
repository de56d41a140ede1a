"""A rank's own timeline: named spans on the host clock, recorded only while switched on.

One :class:`Recorder` per process is shared by everything that records (the communicator hands
it to every group it makes; the pipeline executor and the trainer read it from there). It is
off by default, and then :meth:`Recorder.span` costs one attribute read; ``--profile`` switches
it on for its window of iterations on the profiled ranks
(:mod:`megatron_het.training.timeline`).

Clock: ``time.perf_counter`` (CLOCK_MONOTONIC on Linux), one clock for every process of a host,
so spans of ranks on one host line up without correction; hosts are aligned when the trace is
merged. On an accelerator the host only queues kernels, so a span's ends would time their
launches: with ``synchronize`` given, the recorder waits for the device's current stream at
each end of a span, and the span times the device's work (queued kernels then no longer run
ahead of the host inside the window, which is why only the window records).

Categories: ``compute`` (a forward or backward of one micro-batch and chunk), ``p2p`` (posting
a transfer step, waiting for it), ``collective`` (an op of a process group: TP, DP, the world;
across kinds it crosses the bridge), ``step`` (the trainer's phases: DP gradient sync,
optimizer step, the tied-embedding sum, the metrics gather), ``iteration``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

CATEGORIES = ("iteration", "compute", "p2p", "collective", "step")


@dataclass(frozen=True)
class Span:
    """One recorded span: ``start_s``/``end_s`` on the host clock (seconds); ``args`` are
    JSON-able details (micro-batch, chunk, peers, bytes, group...)."""

    name: str
    category: str
    start_s: float
    end_s: float
    args: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cat": self.category,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "args": self.args,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Span:
        return cls(d["name"], d["cat"], float(d["start_s"]), float(d["end_s"]), d.get("args", {}))


class Recorder:
    """Spans of this process while :attr:`active` (see the module docstring).

    ``synchronize`` waits for the device's current stream (None: host work, nothing to wait
    for); ``clock`` is the host clock (tests pass their own).
    """

    def __init__(
        self,
        synchronize: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.synchronize = synchronize
        self.clock = clock
        self.active = False
        self.spans: list[Span] = []

    def start(self, synchronize: Callable[[], None] | None = None) -> None:
        """Switch recording on (forgetting earlier spans); ``synchronize`` as the constructor's
        (given here by the owner who knows the device)."""
        self.spans = []
        if synchronize is not None:
            self.synchronize = synchronize
        self.active = True

    def stop(self) -> list[Span]:
        """Switch recording off; the spans recorded since :meth:`start`, by start time."""
        self.active = False
        spans, self.spans = self.spans, []
        return sorted(spans, key=lambda s: (s.start_s, -s.end_s))

    def now(self) -> float:
        """The host clock, after the device's queued work (when recording on a device)."""
        if self.synchronize is not None:
            self.synchronize()
        return self.clock()

    def span(self, name: str, category: str, **args: Any) -> contextlib.AbstractContextManager:
        """A context recording the block as one span (nothing while off). A block left by an
        exception is still recorded, with ``error`` in its args."""
        if not self.active:
            return _NOTHING
        return self._recorded(name, category, args)

    @contextlib.contextmanager
    def _recorded(self, name: str, category: str, args: dict[str, Any]) -> Iterator[None]:
        start = self.now()
        try:
            yield
        except BaseException as exc:
            args = {**args, "error": type(exc).__name__}
            raise
        finally:
            if self.active:
                self.spans.append(Span(name, category, start, self.now(), args))


_NOTHING = contextlib.nullcontext()
