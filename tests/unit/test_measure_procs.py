"""The measurement process runner: results in report order, and every way a worker can fail
turns into a RuntimeError that says which, with no process left behind."""

import multiprocessing
import os
import time

import pytest

from megatron_het.perf.measure.worker_processes import (
    free_loopback_port,
    report_to_parent,
    run_measurement_processes,
)

CTX = multiprocessing.get_context("fork")


def _square(value, conn):
    report_to_parent(conn, lambda: value * value)


def _fail(conn):
    report_to_parent(conn, lambda: 1 / 0)


def _hang(conn):
    time.sleep(30)


def _exit_silently(conn):
    os._exit(0)


def _run(target, args, **kw):
    return run_measurement_processes(
        CTX, target, args, len(args), 5.0, "timed out", "failed", join_s=0.5, **kw
    )


def test_results_of_every_reporter():
    assert sorted(_run(_square, [(2,), (3,), (4,)])) == [4, 9, 16]


def test_a_worker_error_carries_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)^failed:\n.*ZeroDivisionError"):
        _run(_fail, [()])


def test_a_hung_worker_times_out_and_is_killed():
    with pytest.raises(RuntimeError, match="^timed out$"):
        run_measurement_processes(CTX, _hang, [()], 1, 0.2, "timed out", "failed", join_s=0.1)
    assert not multiprocessing.active_children()


def test_a_worker_that_dies_silently():
    with pytest.raises(RuntimeError, match="^worker died$"):
        _run(_exit_silently, [()], died_message="worker died")
    with pytest.raises(EOFError):
        _run(_exit_silently, [()])


def test_free_loopback_ports_lie_below_the_ephemeral_range_and_are_free(monkeypatch):
    """Ports the kernel hands out for port 0 can be handed out again to another process's
    socket before a rendezvous binds them; picks below that range cannot."""
    import socket

    from megatron_het.perf.measure import worker_processes as measure_procs

    low, high = measure_procs._ephemeral_range()
    ports = {free_loopback_port(span=4) for _ in range(20)}
    assert all(10000 <= p and p + 4 <= low or p > high for p in ports), (ports, low, high)
    assert len(ports) > 1  # drawn at random, not one fixed port for every caller
    monkeypatch.setattr(measure_procs, "_ENOUGH_PORTS", 1)
    monkeypatch.setattr(measure_procs, "_LOWEST_PORT", 20000)
    monkeypatch.setattr(measure_procs, "_ephemeral_range", lambda: (20003, 60999))
    with socket.socket() as busy:  # of 20000 and 20001 (span 1), only 20000 is free
        busy.bind(("127.0.0.1", 20001))
        assert free_loopback_port() == 20000
        with pytest.raises(RuntimeError, match="no 2 consecutive free"):
            free_loopback_port(span=2)


@pytest.mark.parametrize(
    "ephemeral, expected",
    [
        ((1024, 60999), lambda p: p > 60999),  # too few ports below: drawn above the range
        ((1024, 65535), lambda p: 1024 <= p <= 65535),  # none outside: the kernel's pick
    ],
)
def test_free_loopback_ports_where_the_ephemeral_range_is_wide(
    monkeypatch, ephemeral, expected
) -> None:
    from megatron_het.perf.measure import worker_processes as measure_procs

    monkeypatch.setattr(measure_procs, "_ephemeral_range", lambda: ephemeral)
    ports = [free_loopback_port(span=4) for _ in range(10)]
    assert all(expected(p) and p + 3 <= 65535 for p in ports), ports
