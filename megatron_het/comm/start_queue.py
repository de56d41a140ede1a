"""Start bridge operations off the calling thread once their host data is ready.

A device tensor crosses the relay bridge in a host buffer, and the copy into that buffer runs
on a side stream after everything the device has queued (:mod:`megatron_het.comm.staging`).
Waiting for that copy on the thread that runs backward would stop it from queueing more kernels
until the device has caught up, so the device would run dry at every gradient bucket. Instead,
:class:`StartQueue` (one per bridge) starts such an operation on a thread of its own: it waits
for the copy (the operation's *fence*) and then starts the backend operation, in the order the
operations were submitted.

Every rank submits the same operations in the same order, and one thread starts them in that
order, so every rank's backend still sees its operations in one order. An operation on a bridge
link that arrives while earlier ones are still queued is queued behind them (even if it has no
fence of its own), so nothing overtakes.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

from megatron_het.comm.staging import Fence


class Deferred:
    """The backend work of an operation the queue has not necessarily started yet: ``wait()``
    and ``is_completed()`` behave like the backend work's once it exists. An error raised
    while waiting for the fence or starting the operation is raised by ``wait()``."""

    def __init__(self) -> None:
        self._started = threading.Event()
        self._work: Any = None
        self._error: BaseException | None = None

    def _set(self, work: Any = None, error: BaseException | None = None) -> None:
        self._work, self._error = work, error
        self._started.set()

    def wait(self) -> Any:
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self._work.wait()

    def is_completed(self) -> bool:
        if not self._started.is_set():
            return False
        return self._error is not None or self._work.is_completed()


class StartQueue:
    """Runs ``fence(); work = start()`` for each submitted operation on one worker thread,
    strictly in submission order; the thread is made on first use (never before a fork)."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Fence, Callable[[], Any], Deferred]] = deque()
        self._cond = threading.Condition()
        self._running = False  # an operation taken off the queue is being started
        self._thread: threading.Thread | None = None
        self.submitted = 0  # operations that went through the queue (for tests and stats)

    @property
    def busy(self) -> bool:
        """True while some submitted operation has not been started yet."""
        with self._cond:
            return bool(self._queue) or self._running

    def submit(self, fence: Fence, start: Callable[[], Any]) -> Deferred:
        """Queue ``start`` to run after ``fence`` and after every earlier submission."""
        deferred = Deferred()
        with self._cond:
            self._queue.append((fence, start, deferred))
            self.submitted += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="bridge-starts",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        return deferred

    def drain(self) -> None:
        """Block until every operation submitted so far has been started."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and not self._running)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                fence, start, deferred = self._queue.popleft()
                self._running = True
            try:
                if fence is not None:
                    fence()
                work = start()
            except BaseException as exc:  # noqa: BLE001 - raised again by Deferred.wait()
                deferred._set(error=exc)
            else:
                deferred._set(work)
            with self._cond:
                self._running = False
                self._cond.notify_all()


__all__ = ["Deferred", "Fence", "StartQueue"]
