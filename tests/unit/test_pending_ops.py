"""Device-backend operations past the timeout: noted by the links when waited for, found by the
heartbeat thread, reported as a failed operation (no GPU needed: markers and backends are
stand-ins)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_het.comm import links, pending
from megatron_het.comm.faults import CommError
from megatron_het.comm.links import Link
from megatron_het.comm.pending import DEVICE_BACKSTOP, PendingOps, device_timeout
from megatron_het.launcher.peer_watch import PeerWatch


class Marker:
    """A stand-in for a device event: ``query()`` is True once ``done``."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_oldest_operation_past_the_timeout_is_named() -> None:
    clock = Clock()
    ops = PendingOps(clock)
    first, second = Marker(), Marker()
    ops.add(first, "tp", "all_reduce", "native[gpu] (nccl over ranks [0, 1])")
    clock.now += 5
    ops.add(second, "pp", "recv from rank 2", "native[gpu] (nccl over ranks [1, 2])")
    assert ops.stuck(60.0) is None
    clock.now += 56  # the first is 61 s old, the second 56 s
    error = ops.stuck(60.0)
    assert isinstance(error, CommError) and (error.group, error.op) == ("tp", "all_reduce")
    assert str(error) == (
        "unified group 'tp': all_reduce failed: native[gpu] (nccl over ranks "
        "[0, 1]): not complete 61 s after it started (timeout 60 s)"
    )
    first.done = True  # completed since: dropped; the second is not old enough yet
    assert ops.stuck(60.0) is None and len(ops) == 1
    clock.now += 10
    assert ops.stuck(60.0).op == "recv from rank 2"
    second.done = True
    assert ops.stuck(60.0) is None and len(ops) == 0


def test_a_marker_that_fails_counts_as_done_and_adding_prunes(monkeypatch) -> None:
    class Broken:
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access")

    clock = Clock()
    ops = PendingOps(clock)
    ops.add(Broken(), "dp", "all_gather", "x")
    clock.now += 1000
    assert ops.stuck(1.0) is None and len(ops) == 0
    monkeypatch.setattr(pending, "_PRUNE_AT", 3)
    done = [Marker(True) for _ in range(3)]
    for marker in done:
        ops.add(marker, "dp", "all_gather", "x")
    ops.add(Marker(), "dp", "all_gather", "x")  # the three completed ones go first
    assert len(ops) == 1


def test_the_device_backend_gets_the_backstop() -> None:
    minute = datetime.timedelta(minutes=1)
    assert device_timeout(minute) == minute + DEVICE_BACKSTOP > minute


class FakeWork:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FakeBackend:
    def allreduce(self, tensors, opts):
        return FakeWork()


@pytest.mark.parametrize("backend, noted", [("nccl", True), ("gloo", False)])
def test_links_note_device_backend_operations_once_waited_for(monkeypatch, backend, noted) -> None:
    ops, made = PendingOps(), []

    def marker(device_type: str) -> Marker:
        made.append(device_type)
        return Marker()

    monkeypatch.setattr(pending, "PENDING", ops)
    monkeypatch.setattr(pending, "stream_marker", marker)
    link = Link(FakeBackend(), (0, 1), 0, backend, "native[gpu]", "tp")
    work = link.all_reduce_async(torch.zeros(4), "sum")
    assert len(ops) == 0  # noted when waited for, not when started
    work.wait()
    work.wait()  # once
    assert len(ops) == (1 if noted else 0)
    assert made == (["cuda"] if noted else [])
    if noted:
        error = ops.stuck(0.0)
        assert (error.group, error.op) == ("tp", "all_reduce")
        assert "native[gpu] (nccl over ranks [0, 1])" in str(error)
    assert links._device_type("hccl") == "npu"


class FakeP2PBackend:
    """Coalesced sends and receives, as a device backend's object takes them."""

    def _start_coalescing(self) -> None:
        pass

    def send(self, tensors, peer, tag):
        return None

    def recv(self, tensors, peer, tag):
        return None

    def _end_coalescing(self):
        return FakeWork()


def test_coalesced_pipeline_transfers_are_noted_too(monkeypatch) -> None:
    from megatron_het.comm.p2p import P2POp, coalesced

    ops = PendingOps()
    monkeypatch.setattr(pending, "PENDING", ops)
    monkeypatch.setattr(pending, "stream_marker", lambda device_type: Marker())
    link = Link(FakeP2PBackend(), (0, 1), 0, "nccl", "native[gpu]", "pipeline-p0")
    works = coalesced(link, [P2POp("isend", torch.zeros(2), 1), P2POp("irecv", torch.zeros(2), 1)])
    for work in works:
        work.wait()
    error = ops.stuck(0.0)
    assert (error.group, error.op) == ("pipeline-p0", "batch_isend_irecv")
    assert link.pending_device == "cuda"
    assert Link(FakeP2PBackend(), (0, 1), 0, "gloo", "x", "y").pending_device is None


def test_the_heartbeat_thread_ends_a_rank_whose_operation_never_failed() -> None:
    store = dist.HashStore()
    found = threading.Event()
    errors = []
    late = CommError("tp", "all_reduce", "native[gpu]: not complete 2 s after it started")
    calls = {"n": 0}

    def stuck(timeout_s: float):
        calls["n"] += 1
        assert timeout_s == 1.0
        return late if calls["n"] >= 2 else None

    def on_stuck(error: BaseException) -> None:
        errors.append(error)
        found.set()

    watch = PeerWatch(store, 0, 2, timeout_s=1.0, stuck_operation=stuck)
    watch.start()
    assert not found.wait(2 * watch.interval_s)  # nothing happens before on_stuck is set
    watch.on_stuck = on_stuck
    assert found.wait(10)
    watch.stop()
    assert errors[0] is late


def test_a_failing_rank_is_not_reported_again_as_stuck() -> None:
    store = dist.HashStore()
    calls = []
    watch = PeerWatch(
        store, 0, 2, timeout_s=1.0, stuck_operation=lambda _s: CommError("tp", "all_reduce", "late")
    )
    watch.on_stuck = calls.append
    watch.record(RuntimeError("bug"), 3)
    watch._check_stuck()
    assert calls == []


def test_a_stuck_operation_is_reported_and_ends_the_process(monkeypatch, capsys, tmp_path) -> None:
    from megatron_het.launcher.failure_record import read_failure
    from megatron_het.training import run

    class Watch:
        rank, world_size, run_id = 1, 2, "job-0"

        def progress(self) -> int:
            return 6

        def report(self, error, iteration):
            from megatron_het.launcher.peer_watch import PeerReport

            return PeerReport(
                f"iteration {iteration}: rank 0 (kind) stopped answering; on rank 1: {error}",
                (0,),
                (),
            )

    class Setup:
        class train:
            save = str(tmp_path)

    exits = []
    monkeypatch.setattr(run.os, "_exit", lambda code: exits.append(code))
    run._end_stuck(Setup, Watch(), CommError("tp", "all_reduce", "not complete"))
    assert exits == [1]
    err = capsys.readouterr().err
    assert err.startswith(
        "error: iteration 7: rank 0 (kind) stopped answering; on rank 1: "
        "unified group 'tp': all_reduce failed: not complete"
    )
    assert err.count("\n") == 1
    # for a supervisor's relaunch, as a failed operation on the main thread records it
    record = read_failure(tmp_path)
    assert record["lost_ranks"] == [0] and record["run_id"] == "job-0"


def test_a_device_marker_is_queried_on_the_device_it_was_recorded_on(monkeypatch) -> None:
    """The heartbeat thread queries markers; its own current device would be device 0."""
    import contextlib
    import threading
    from types import SimpleNamespace

    entered, state = [], {"current": 3, "done": False}

    class Event:
        def record(self) -> None:
            pass

        def query(self) -> bool:
            return state["done"]

    @contextlib.contextmanager
    def device(index):
        entered.append((threading.current_thread().name, index))
        yield

    monkeypatch.setattr(
        torch,
        "fakedev",
        SimpleNamespace(Event=Event, current_device=lambda: state["current"], device=device),
        raising=False,
    )
    marker = pending.stream_marker("fakedev")
    state["current"] = 0  # another thread's current device
    answers = []
    thread = threading.Thread(target=lambda: answers.append(marker.query()), name="beat")
    thread.start()
    thread.join()
    state["done"] = True
    assert answers == [False] and marker.query() is True
    assert entered == [("beat", 3), ("MainThread", 3)]
