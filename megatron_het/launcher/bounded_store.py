"""A key-value store client whose every operation answers within a deadline.

torch.distributed's TCPStore client waits for the server's answer to ``check`` and ``get``
without any timeout: when the host serving the store stops answering without closing the
connection (a machine that lost power, a hung process), the call never returns, and every later
call of the same client waits behind it on the client's lock. :class:`BoundedStore` runs the
calls on one helper thread and gives up on a call after ``deadline_s``; while a call is overdue,
every new one fails at once, and the store answers again once the overdue call returns.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class StoreUnreachable(RuntimeError):
    """The store did not answer within the deadline."""


class _Call:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class BoundedStore:
    """``store`` (``set``, ``get``, ``check``) with each call bounded by ``deadline_s``
    seconds: :class:`StoreUnreachable` when it does not answer in time (the call stays in
    flight on the helper thread, and its answer is dropped). Other errors of the store are
    raised as they are. Side effect: one daemon helper thread, started at the first call."""

    def __init__(self, store: Any, deadline_s: float) -> None:
        self.inner, self.deadline_s = store, deadline_s
        self._calls: queue.Queue[_Call | None] = queue.Queue()
        self._lock = threading.Lock()
        self._busy_since: float | None = None  # when the call in flight started
        self._thread: threading.Thread | None = None

    def set(self, key: str, value: str) -> None:
        self._call(lambda: self.inner.set(key, value))

    def get(self, key: str) -> bytes:
        return self._call(lambda: self.inner.get(key))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda: self.inner.check(keys))

    def close(self) -> None:
        """Stop the helper thread once the calls queued before have run (it is not waited
        for)."""
        with self._lock:
            if self._thread is not None:
                self._calls.put(None)
                self._thread = None

    def _call(self, fn: Callable[[], Any]) -> Any:
        call = _Call(fn)
        with self._lock:
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.deadline_s:
                raise StoreUnreachable(f"no answer in {self.deadline_s:g} s")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="bounded-store", daemon=True
                )
                self._thread.start()
            self._calls.put(call)
        if not call.done.wait(self.deadline_s):
            raise StoreUnreachable(f"no answer in {self.deadline_s:g} s")
        if call.error is not None:
            raise call.error
        return call.value

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            with self._lock:
                self._busy_since = time.monotonic()
            try:
                call.value = call.fn()
            except BaseException as error:
                call.error = error
            with self._lock:
                self._busy_since = None
            call.done.set()
