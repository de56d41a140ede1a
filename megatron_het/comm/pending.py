"""Operations on device backends that have not completed, for a deadline the host can keep.

A gloo operation blocks the waiting thread and raises after the group's timeout, so a dead or
hung peer surfaces as a :class:`~megatron_het.comm.faults.CommError` on the thread that waited.
A device backend's (NCCL, HCCL) ``wait()`` returns at once: it only orders the device's stream
after the operation. The host then blocks later, at whatever reads a result, and the backend's
own watchdog ends the process after the timeout with a message of its own.

So every operation a link hands to a device backend is noted here when the host waits for it:
a marker on the waiting stream (a device event, which holds no tensor, recorded right after
the backend's ``wait()``, so it completes with the operation), with the unified group, op,
backend group and the time. :meth:`PendingOps.stuck` (called by the rank's heartbeat thread,
:mod:`megatron_het.launcher.peer_watch`) drops the completed ones and returns a CommError for
the oldest one still running after the timeout: the run then reports and ends on the same
terms as a gloo failure, while the device backend's watchdog, given the timeout plus
:data:`DEVICE_BACKSTOP` (:func:`device_timeout`), is left as the backstop.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_het.comm.faults import CommError

# How much later than the run's timeout a device backend's own watchdog ends the process.
DEVICE_BACKSTOP = datetime.timedelta(seconds=30)
# Past this many noted operations, adding one first drops the completed oldest ones.
_PRUNE_AT = 4096


def device_timeout(timeout: datetime.timedelta) -> datetime.timedelta:
    """The timeout a device backend's group is created with: the run's plus the backstop."""
    return timeout + DEVICE_BACKSTOP


@dataclass
class _Op:
    marker: Any
    group: str
    op: str
    where: str
    started: float


class PendingOps:
    """The device-backend operations of this process not yet seen complete (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ops: OrderedDict[int, _Op] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._ops)

    def add(self, marker: Any, group: str, op: str, where: str) -> None:
        """Note an operation waited for now; ``marker.query()`` says whether it completed."""
        with self._lock:
            if len(self._ops) >= _PRUNE_AT:
                self._prune()
            self._ops[self._next] = _Op(marker, group, op, where, self._clock())
            self._next += 1

    def _prune(self) -> None:
        """Drop completed operations, oldest first, up to the first still running (lock
        held; later checks drop the rest)."""
        while self._ops:
            key, op = next(iter(self._ops.items()))
            if not _completed(op.marker):
                return
            del self._ops[key]

    def stuck(self, timeout_s: float) -> CommError | None:
        """A CommError for the oldest operation still running ``timeout_s`` after it started
        (naming its unified group, op and backend group), else None; drops completed ones."""
        with self._lock:
            self._prune()
            if not self._ops:
                return None
            op = next(iter(self._ops.values()))
            age = self._clock() - op.started
            if age < timeout_s:
                return None  # the younger ones are younger still
            return CommError(
                op.group,
                op.op,
                f"{op.where}: not complete {age:.0f} s after it "
                f"started (timeout {timeout_s:.0f} s)",
            )


def _completed(marker: Any) -> bool:
    try:
        return bool(marker.query())
    except Exception:
        return True


class _DeviceMarker:
    """An event and the device it was recorded on. The heartbeat thread queries it: a thread's
    current device starts as device 0, where a query from it would create a second context on
    a rank that trains on another device; :meth:`query` makes the event's device current for
    the call."""

    def __init__(self, event: Any, module: Any) -> None:
        self.event, self.module = event, module
        self.index = module.current_device()

    def query(self) -> bool:
        with self.module.device(self.index):
            return bool(self.event.query())


def stream_marker(device_type: str) -> Any | None:
    """An event recorded now on the current stream of ``device_type``, queried on its device
    from any thread (None where the device has no events this torch knows)."""
    import torch

    module = getattr(torch, device_type, None)
    event_type = getattr(module, "Event", None)
    if event_type is None:
        return None
    event = event_type()
    event.record()
    if not (hasattr(module, "current_device") and hasattr(module, "device")):
        return event
    return _DeviceMarker(event, module)


# The process's device-backend operations (links note theirs here).
PENDING = PendingOps()

__all__ = ["DEVICE_BACKSTOP", "PENDING", "PendingOps", "device_timeout", "stream_marker"]
