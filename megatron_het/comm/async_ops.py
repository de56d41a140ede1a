"""Handles of asynchronous collectives (``async_op=True`` on a :class:`UnifiedGroup`).

Every handle has ``wait()`` (block until the result is in place; a failed or timed-out peer
raises :class:`~megatron_het.comm.faults.CommError`) and ``is_completed()`` (never blocks).

- :class:`WorkHandle`: a group of one kind runs the collective as one asynchronous operation of
  its native backend (gloo, NCCL, ...); the backend makes progress on its own.
- :class:`DoneHandle`: the collective already ran to completion when it was called.
- :class:`PendingHandle`: a hierarchical collective over several kinds. Its first phases (the
  reduce-scatter inside each kind and the start of the cross-kind transfers, which then proceed
  in the bridge backend's own threads) run when it is called; its last phase (inside each kind
  again) is a collective too, so it runs in ``wait()``. To keep every rank issuing the same
  collectives in the same order, a group finishes its pending operations strictly in the order
  they were started (waiting on one finishes the earlier ones first), and ``is_completed()``
  never starts that phase: it is False until a ``wait()`` has run it. Wait on such a handle; do
  not poll it.

All calls must come from one thread, in the same program order on every rank of the group.
Because a pending handle's last phase needs the other members of this rank's kind, ranks that
share several mixed groups must also wait on those groups' handles in one order (within one
group the order of waits does not matter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from megatron_het.comm.links import Work


class CollectiveHandle(Protocol):
    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class WorkHandle:
    """One backend operation in flight (its completion callback runs in ``wait()``)."""

    def __init__(self, work: Work) -> None:
        self._work = work

    def wait(self) -> None:
        self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()


class DoneHandle:
    """An operation that finished before it was returned."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class PendingHandle:
    """A hierarchical operation whose last phase runs in ``wait()`` (see module docstring)."""

    def __init__(self, queue: FinishQueue, finish: Callable[[], None]) -> None:
        self._queue, self._finish = queue, finish
        self._done = False
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._finish()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._done = True

    def wait(self) -> None:
        if not self._done:
            self._queue.finish_through(self)
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        return self._done


class FinishQueue:
    """A group's pending hierarchical operations, finished strictly in the order started."""

    def __init__(self) -> None:
        self._pending: list[PendingHandle] = []

    def add(self, finish: Callable[[], None]) -> PendingHandle:
        handle = PendingHandle(self, finish)
        self._pending.append(handle)
        return handle

    def finish_through(self, handle: PendingHandle) -> None:
        """Run the last phase of every operation started up to and including ``handle``."""
        while self._pending and not handle.is_completed():
            self._pending.pop(0)._run()

    def finish_all(self) -> None:
        while self._pending:
            self._pending.pop(0)._run()

    def __len__(self) -> int:
        return len(self._pending)


DONE = DoneHandle()

__all__ = ["DONE", "CollectiveHandle", "DoneHandle", "FinishQueue", "PendingHandle", "WorkHandle"]
