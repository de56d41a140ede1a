"""The bridge's start queue: operations whose host copy is still running start off the calling
thread, in submission order, and nothing on a bridge link overtakes them."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from megatron_het.comm.faults import CommError
from megatron_het.comm.links import Link
from megatron_het.comm.start_queue import StagingError, StartQueue

WAIT_S = 20


@pytest.fixture(autouse=True)
def no_thread_left(monkeypatch: pytest.MonkeyPatch):
    """Every queue made here ends its worker thread afterwards (later tests fork workers)."""
    made: list[StartQueue] = []
    init = StartQueue.__init__

    def record(self: StartQueue) -> None:
        init(self)
        made.append(self)

    monkeypatch.setattr(StartQueue, "__init__", record)
    yield
    for queue in made:
        queue.close()
    assert not [t for t in threading.enumerate() if t.name == "bridge-starts"]


class Done:
    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class RecordingGroup:
    """Stands in for a backend group: records the order its operations were started in."""

    def __init__(self) -> None:
        self.started: list[tuple[str, float]] = []
        self.threads: set[str] = set()

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Done:
        self.started.append(("allreduce", tensors[0][0].item()))
        self.threads.add(threading.current_thread().name)
        return Done()

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Done:
        self.started.append(("send", tensors[0][0].item()))
        self.threads.add(threading.current_thread().name)
        return Done()


def gate() -> tuple[threading.Event, threading.Event]:
    """(opened, reached): a fence blocks on ``opened`` and sets ``reached`` when called."""
    return threading.Event(), threading.Event()


def test_an_operation_with_a_fence_returns_at_once_and_starts_after_it() -> None:
    pg, starts = RecordingGroup(), StartQueue()
    link = Link(pg, [0, 1], 0, "gloo", "channel", "dp", starts=starts)
    opened, reached = gate()

    def fence() -> None:
        reached.set()
        assert opened.wait(WAIT_S)

    work = link.all_reduce_async(torch.ones(4), "sum", after=fence)
    assert reached.wait(WAIT_S)  # the queue's thread waits for the copy, not the caller
    assert pg.started == [] and starts.busy(link) and not work.is_completed()
    # a later operation on a bridge link, fence or not, queues behind it
    later = link.isend(torch.full((2,), 2.0), 1, tag=0)
    assert pg.started == []
    opened.set()
    work.wait()
    later.wait()
    assert pg.started == [("allreduce", 1.0), ("send", 2.0)]
    assert pg.threads == {"bridge-starts"} and starts.submitted == 2
    starts.drain()
    assert not starts.busy()
    link.isend(torch.full((2,), 3.0), 1, tag=0).wait()  # an idle queue: started at the call
    assert pg.started[-1] == ("send", 3.0) and starts.submitted == 2


def test_many_fenced_operations_start_in_submission_order() -> None:
    pg, starts = RecordingGroup(), StartQueue()
    link = Link(pg, [0, 1], 0, "gloo", "channel", "dp", starts=starts)
    opened = threading.Event()
    works = [
        link.all_reduce_async(
            torch.full((1,), float(i)),
            "sum",
            after=(lambda: opened.wait(WAIT_S)) if i % 3 == 0 else None,
        )
        for i in range(12)
    ]
    opened.set()
    for w in reversed(works):
        w.wait()
    assert [v for _, v in pg.started] == [float(i) for i in range(12)]


def test_a_link_without_a_queue_waits_for_the_fence_at_the_call() -> None:
    pg = RecordingGroup()
    link = Link(pg, [0, 1], 0, "gloo", "channel", "dp")
    order: list[str] = []
    link.all_reduce_async(torch.ones(1), "sum", after=lambda: order.append("fence")).wait()
    order.append("after call")
    assert order == ["fence", "after call"] and pg.threads == {threading.current_thread().name}


def test_a_failed_start_is_raised_by_wait_as_a_comm_error() -> None:
    class Broken(RecordingGroup):
        def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Done:
            raise RuntimeError("Connection closed by peer [10.0.0.2]:4567")

    starts = StartQueue()
    link = Link(Broken(), [0, 1], 0, "gloo", "channel", "dp", starts=starts)
    work = link.all_reduce_async(torch.ones(1), "sum", after=lambda: None)
    with pytest.raises(CommError, match="unified group 'dp': all_reduce failed: .*closed by peer"):
        work.wait()
    starts.drain()  # the queue goes on after a failure
    ok = Link(RecordingGroup(), [0, 1], 0, "gloo", "channel", "dp", starts=starts)
    ok.all_reduce_async(torch.ones(1), "sum", after=lambda: None).wait()


def test_a_failing_copy_is_this_ranks_error_and_stops_the_queue() -> None:
    pg, starts = RecordingGroup(), StartQueue()
    link = Link(pg, [0, 1], 0, "gloo", "channel", "dp", starts=starts)

    def bad_copy() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    failed = link.all_reduce_async(torch.full((1,), 1.0), "sum", after=bad_copy)
    later = link.all_reduce_async(torch.full((1,), 2.0), "sum", after=lambda: None)
    # not a CommError (a peer's failure): the rank's own device failed
    with pytest.raises(
        StagingError, match="failed on this rank's device: CUDA error: an illegal memory access"
    ):
        failed.wait()
    # never started: its peers would pair it with the transfer this rank skipped
    with pytest.raises(StagingError, match="not started: an earlier transfer's copy"):
        later.wait()
    # nor does anything after it, fence or not, queued or not
    with pytest.raises(StagingError, match="not started"):
        link.isend(torch.ones(1), 1, tag=0).wait()
    assert pg.started == [] and starts.broken


def test_a_link_waits_only_behind_its_own_queued_operations() -> None:
    starts = StartQueue()
    dp, pp = RecordingGroup(), RecordingGroup()
    dp_link = Link(dp, [0, 1], 0, "gloo", "channel", "dp", starts=starts)
    pp_link = Link(pp, [0, 2], 0, "gloo", "bridge", "pp", starts=starts)
    opened = threading.Event()
    held = dp_link.all_reduce_async(torch.ones(1), "sum", after=lambda: opened.wait(WAIT_S))
    assert starts.busy(dp_link) and not starts.busy(pp_link) and starts.busy()
    pp_link.isend(torch.full((1,), 5.0), 2, tag=0).wait()  # another link: started at the call
    assert pp.started == [("send", 5.0)] and pp.threads == {threading.current_thread().name}
    opened.set()
    held.wait()
    starts.drain()
    assert not starts.busy()
