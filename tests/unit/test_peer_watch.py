"""PeerWatch: heartbeats in a store, the failure report, the reporter rule and the abort; the
bounded store calls and the report when the store's node is gone."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from megatron_het.comm.faults import CommError, first_line
from megatron_het.launcher.bounded_store import BoundedStore, StoreUnreachable
from megatron_het.launcher.peer_watch import PeerWatch, heartbeat_interval


def watch(store, rank: int, world: int = 4, **kwargs) -> PeerWatch:
    return PeerWatch(
        store, rank, world, timeout_s=1.0, describe=lambda r: f"rank {r} (kind)", **kwargs
    )


def test_interval_is_a_tenth_of_the_timeout_within_bounds() -> None:
    assert heartbeat_interval(60) == 3.0
    assert heartbeat_interval(1) == 0.5
    assert heartbeat_interval(3600) == 5.0


def test_report_names_the_rank_that_stopped_beating_and_those_that_failed() -> None:
    store = dist.HashStore()
    watches = [watch(store, r) for r in range(4)]
    for w in watches:
        w._beat()
    # rank 1 keeps beating (alive, waiting), rank 2 failed already, rank 3 is silent
    watches[2].record(CommError("pp", "recv", "peer gone"), 7)
    beats = iter(range(100))

    def sleep(_s: float) -> None:
        watches[1]._beat()
        next(beats)

    report = watches[0].report(
        CommError("dp", "all_reduce", "Timed out waiting 6000ms"), 7, sleep=sleep
    )  # rank 0 is the logging rank
    assert report.silent == (3,) and report.failed == (2,)
    assert report.line.startswith("iteration 7: rank 3 (kind) stopped answering")
    assert (
        "on rank 0: unified group 'dp': all_reduce failed: Timed out waiting 6000ms" in report.line
    )
    assert "failed before: rank 2 at iteration 7 (recv on unified group 'pp')" in report.line
    assert "\n" not in report.line


def test_a_rank_that_never_beat_is_silent_and_every_other_answers_otherwise() -> None:
    store = dist.HashStore()
    w0, w1 = watch(store, 0, world=3), watch(store, 1, world=3)
    w0._beat(), w1._beat()
    report = w0.report(RuntimeError("x"), 1, sleep=lambda _s: w1._beat())
    assert report.silent == (2,)
    w2 = watch(store, 2, world=3)
    w2._beat()
    report = w0.report(RuntimeError("x"), 1, sleep=lambda _s: (w1._beat(), w2._beat()))
    assert report.silent == () and "every other rank still answers" in report.line


def test_the_logging_rank_reports_and_the_others_print_a_short_line() -> None:
    store = dist.HashStore()
    watches = [watch(store, r, logging_rank=2) for r in range(4)]
    for w in watches:
        w._beat()
    assert watches[0].reporters() == [2, 0, 1, 3]
    alive = lambda _s: [w._beat() for w in watches[1:3]]  # noqa: E731 - ranks 0 and 3 stop

    full = watches[2].report(CommError("dp", "all_reduce", "timed out"), 4, sleep=alive)
    assert full.full and full.silent == (0, 3)
    short = watches[1].report(CommError("pp", "recv", "reset"), 4, sleep=alive)
    assert not short.full
    assert short.line == (
        "rank 1: unified group 'pp': recv failed: reset (the report is on rank 2)"
    )


def test_the_first_fallback_that_answers_reports_when_the_logging_rank_is_lost() -> None:
    store = dist.HashStore()
    watches = [watch(store, r, world=8, logging_rank=2) for r in range(8)]
    for w in watches:
        w._beat()
    alive = lambda _s: [w._beat() for w in watches[1:] if w.rank != 2]  # noqa: E731
    # ranks 0 and 2 stopped: rank 1 is the first fallback that answers
    assert watches[1].report(CommError("dp", "all_reduce", "t"), 3, sleep=alive).full
    short = watches[3].report(CommError("dp", "all_reduce", "t"), 3, sleep=alive)
    assert not short.full and short.line.endswith("(the report is on rank 1)")
    reads = []
    watches[7].store = CountingStore(store, reads)
    short = watches[7].report(CommError("dp", "all_reduce", "t"), 3, sleep=alive)
    assert not short.full
    assert short.line.endswith("(the report is on the first of ranks 2, 0, 1, 3 that answers)")
    assert not [key for key in reads if "/beat/" in key]  # not a reporter: no heartbeats read


class CountingStore:
    def __init__(self, store, reads: list) -> None:
        self.inner, self.reads = store, reads

    def set(self, key, value):
        return self.inner.set(key, value)

    def check(self, keys):
        self.reads.extend(keys)
        return self.inner.check(keys)

    def get(self, key):
        self.reads.append(key)
        return self.inner.get(key)


def test_a_rank_whose_main_thread_does_not_fail_ends_itself_after_the_abort() -> None:
    store = dist.HashStore()
    aborted = threading.Event()
    messages = []

    def on_abort(message: str) -> None:
        messages.append(message)
        aborted.set()

    hung = watch(store, 1, grace_s=0.0, on_abort=on_abort, progress=lambda: 5)
    hung.start()
    watch(store, 0).record(CommError("dp", "all_reduce", "timed out"), 5)
    assert aborted.wait(10)
    hung.stop()
    assert messages[0].startswith(
        "rank 1: stopping at iteration 5: the run was aborted after a failure on rank 0 (kind)"
    )


def test_a_failing_rank_is_not_ended_by_its_own_abort() -> None:
    store = dist.HashStore()
    calls = []
    w = watch(store, 0, grace_s=0.0, on_abort=calls.append)
    w.start()
    w.record(RuntimeError("bug"), 3)
    time.sleep(3 * w.interval_s)
    w.stop()
    assert calls == []


def test_launches_sharing_a_store_do_not_see_each_others_abort() -> None:
    store = dist.HashStore()
    watch(store, 0, generation=0).record(RuntimeError("old"), 1)
    fresh = watch(store, 1, generation=1)
    assert not fresh.store.check([fresh._key("abort", 0)])


class GoneStore:
    def set(self, *_a):
        raise RuntimeError("Connection refused")

    check = get = set


def test_a_store_whose_host_is_gone_is_said_in_the_line() -> None:
    report = watch(GoneStore(), 2).report(
        CommError("dp", "all_reduce", "timed out"), 4, sleep=lambda _s: None
    )
    assert "the rendezvous store did not answer (Connection refused)" in report.line
    assert report.silent == ()


def test_first_line_drops_backend_source_locations_and_boilerplate() -> None:
    error = RuntimeError(
        "g (gloo over ranks [0, 2]): [/src/gloo/tcp/pair.cc:534] Read error "
        "[127.0.0.1]:1: Connection reset by peer. This is typically caused by "
        "a remote worker hanging. GLHF!\nmore"
    )
    assert first_line(error) == (
        "g (gloo over ranks [0, 2]): Read error [127.0.0.1]:1: Connection reset by peer."
    )


def test_a_rank_stuck_in_compute_is_singled_out() -> None:
    """Every rank still beats, but rank 3 has been inside one compute region for longer than
    half the timeout while the others wait in p2p: the report names it."""
    store = dist.HashStore()
    places = {0: ("p2p", 0.9), 1: ("p2p", 0.8), 2: ("outside", 0.7), 3: ("compute", 0.95)}
    watches = [watch(store, r, activity=lambda r=r: places[r]) for r in range(4)]
    for w in watches:
        w._beat()
    alive = lambda _s: [w._beat() for w in watches[1:]]  # noqa: E731
    report = watches[0].report(CommError("pp", "recv", "Timed out"), 3, sleep=alive)
    assert report.silent == () and report.stuck == (3,)
    assert (
        "every other rank still answers; rank 3 (kind) has been computing for 1 s "
        "(stuck in compute: the others' operations waited on it);"
    ) in report.line
    # a compute region shorter than half the timeout is no sign of being stuck
    places[3] = ("compute", 0.2)
    report = watches[0].report(CommError("pp", "recv", "Timed out"), 3, sleep=alive)
    assert report.stuck == () and "stuck" not in report.line


def test_the_clock_says_where_the_host_thread_is() -> None:
    import torch

    from megatron_het.pipeline.timing import RegionClock

    clock = RegionClock(torch.device("cpu"))
    clock.start()
    assert clock.activity()[0] == "outside"
    with clock.region("compute"):
        time.sleep(0.02)
        place, seconds = clock.activity()
        assert place == "compute" and seconds >= 0.02
    assert clock.activity()[0] == "outside"


class SilentStore:
    """A HashStore whose check and get wait until ``answer`` is set (a store host that stopped
    answering without closing its connections); set does not wait (TCPStore sends it without
    waiting for an answer)."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.answer = threading.Event()
        self.answer.set()

    def set(self, key, value):
        return self.inner.set(key, value)

    def check(self, keys):
        self.answer.wait()
        return self.inner.check(keys)

    def get(self, key):
        self.answer.wait()
        return self.inner.get(key)


def test_a_store_call_without_answer_fails_after_the_deadline_and_later_ones_at_once() -> None:
    silent = SilentStore()
    store = BoundedStore(silent, deadline_s=0.2)
    store.set("k", "v")
    assert store.check(["k"])
    silent.answer.clear()
    with pytest.raises(StoreUnreachable, match="no answer in 0.2 s"):
        store.check(["k"])
    time.sleep(0.3)  # the call in flight is overdue: a new one is not even queued
    started = time.monotonic()
    with pytest.raises(StoreUnreachable):
        store.get("k")
    assert time.monotonic() - started < 0.15
    silent.answer.set()  # the overdue call returns: the store answers again
    deadline = time.monotonic() + 5
    while True:
        try:
            assert store.get("k") == b"v"
            break
        except StoreUnreachable:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    store.close()


def nodes_of_two(silent: SilentStore, rank0_node_size: int = 2, **kwargs) -> list[PeerWatch]:
    """Four ranks, ranks 0-1 on the store's node; rank 0 publishes its node's size and every
    rank beats once (the others learn it)."""
    watches = [
        PeerWatch(
            silent,
            r,
            4,
            timeout_s=1.0,
            describe=lambda r: f"rank {r} (kind)",
            node_size=rank0_node_size if r == 0 else 2,
            store_deadline_s=0.2,
            **kwargs,
        )
        for r in range(4)
    ]
    watches[0].start()
    watches[0].stop()
    for w in watches[1:]:
        w._beat()
    return watches


def test_the_ranks_of_the_stores_node_are_named_when_the_store_stops_answering() -> None:
    silent = SilentStore()
    watches = nodes_of_two(silent)  # logging rank 0: lost with the store's node
    assert [w.store_node_ranks() for w in watches] == [(0, 1)] * 4
    silent.answer.clear()
    full = watches[2].report(CommError("pp", "send", "timed out"), 4, sleep=lambda _s: None)
    assert full.full and full.silent == (0, 1)
    assert full.line == (
        "iteration 4: rank 0 (kind), rank 1 (kind) stopped answering (the "
        "rendezvous store on their node did not answer: no answer in 0.2 s); "
        "on rank 2: unified group 'pp': send failed: timed out"
    )
    short = watches[3].report(CommError("pp", "recv", "reset"), 4, sleep=lambda _s: None)
    assert not short.full
    assert short.line == (
        "rank 3: unified group 'pp': recv failed: reset (the report is on rank 2)"
    )
    silent.answer.set()


def test_without_the_store_nodes_size_every_rank_says_the_store_is_gone() -> None:
    silent = SilentStore()
    watches = nodes_of_two(silent, rank0_node_size=0)  # not launched by torchrun
    assert watches[2].store_node_ranks() == ()
    silent.answer.clear()
    for w in watches[2:]:
        report = w.report(CommError("pp", "send", "timed out"), 4, sleep=lambda _s: None)
        assert report.full and report.silent == ()
        assert report.line.endswith(
            "the rendezvous store did not answer (no answer in "
            "0.2 s): the node serving it (rank 0's) is gone"
        )
    silent.answer.set()


def test_the_launch_env_carries_torchruns_node_size() -> None:
    from megatron_het.launcher.launch_env import read_launch_env

    base = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert read_launch_env({**base, "LOCAL_WORLD_SIZE": "2"}).local_world_size == 2
    assert read_launch_env(base).local_world_size == 0  # launched without torchrun
    assert read_launch_env({**base, "LOCAL_WORLD_SIZE": "x"}).local_world_size == 0
