"""Start bridge operations off the calling thread once their host data is ready.

A device tensor crosses the relay bridge in a host buffer, and the copy into that buffer runs
on a side stream after everything the device has queued (:mod:`megatron_het.comm.staging`).
Waiting for that copy on the thread that runs backward would stop it from queueing more kernels
until the device has caught up, so the device would run dry at every gradient bucket. Instead,
:class:`StartQueue` (one per bridge) starts such an operation on a thread of its own: it waits
for the copy (the operation's *fence*) and then starts the backend operation, in the order the
operations were submitted.

Every rank submits the same operations in the same order, and one thread starts them in that
order, so every rank's backend still sees its operations in one order. An operation on a link
that arrives while earlier ones of that link are still queued is queued behind them (even if it
has no fence of its own), so nothing overtakes; other links' operations without a fence go on
at once (fenced ones take their turn on the one thread, behind whatever it is running).

A fence that fails is this rank's device failing (not a peer): its operation raises
:class:`StagingError`, and so does every later operation of the queue's links, which is never
started (its peers would pair it with the wrong transfer otherwise).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from megatron_het.comm.faults import first_line
from megatron_het.comm.staging import Fence


class StagingError(Exception):
    """The copy that fills a transfer's host buffer failed on this rank's own device."""


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


def _STOP() -> None:  # the queue entry that ends the worker thread
    return None


class StartQueue:
    """Runs ``fence(); work = start()`` for each submitted operation on one worker thread,
    strictly in submission order; the thread is made on first use (never before a fork)."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Fence, Callable[[], Any], Deferred, Hashable]] = deque()
        self._cond = threading.Condition()
        self._pending: dict[Hashable, int] = {}  # per key: submitted, not started yet
        self._broken: BaseException | None = None  # the first failed fence
        self._thread: threading.Thread | None = None
        self.submitted = 0  # operations that went through the queue (for tests and stats)

    def on_worker(self) -> bool:
        """Whether the caller is this queue's worker thread (a job it runs issuing its own
        operations, which go straight to the backend)."""
        return self._thread is not None and threading.current_thread() is self._thread

    @property
    def broken(self) -> bool:
        """True once a fence has failed: every later operation fails without starting."""
        return self._broken is not None

    def busy(self, key: Hashable = None) -> bool:
        """True while some operation submitted with ``key`` (any, for None) has not been
        started yet."""
        with self._cond:
            return bool(self._pending) if key is None else key in self._pending

    def submit(self, fence: Fence, start: Callable[[], Any], key: Hashable = None) -> Deferred:
        """Queue ``start`` to run after ``fence`` and after every earlier submission;
        ``key`` (the link) is what :meth:`busy` is asked about."""
        deferred = Deferred()
        with self._cond:
            self._queue.append((fence, start, deferred, key))
            self._pending[key] = self._pending.get(key, 0) + 1
            self.submitted += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="bridge-starts", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return deferred

    def drain(self) -> None:
        """Block until every operation submitted so far has been started (or failed)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending)

    def close(self) -> None:
        """Start what is queued, then end the worker thread (a later submit makes a new one)."""
        with self._cond:
            thread = self._thread
            if thread is None:
                return
            self._queue.append((None, _STOP, Deferred(), _STOP))
            self._pending[_STOP] = 1
            self._cond.notify()
        thread.join()

    def _run(self, fence: Fence, start: Callable[[], Any]) -> Any:
        if self._broken is not None:
            raise StagingError(
                "not started: an earlier transfer's copy to the host failed "
                f"({first_line(self._broken)})"
            )
        if fence is not None:
            try:
                fence()
            except BaseException as exc:
                self._broken = exc
                raise StagingError(
                    "the copy of a transfer's data to the host failed on this "
                    f"rank's device: {first_line(exc)}"
                ) from exc
        return start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                fence, start, deferred, key = self._queue.popleft()
                if start is _STOP:
                    del self._pending[_STOP]
                    self._thread = None
                    self._cond.notify_all()
                    return
            try:
                work = self._run(fence, start)
            except BaseException as exc:
                deferred._set(error=exc)
            else:
                deferred._set(work)
            with self._cond:
                self._pending[key] -= 1
                if not self._pending[key]:
                    del self._pending[key]
                self._cond.notify_all()


__all__ = ["Deferred", "Fence", "StagingError", "StartQueue"]
