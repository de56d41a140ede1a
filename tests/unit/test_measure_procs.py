"""The measurement process runner: results in report order, and every way a worker can fail
turns into a RuntimeError that says which, with no process left behind."""
import multiprocessing
import os
import time

import pytest

from megatron_het.perf.measure_procs import (free_loopback_port, report_to_parent,
                                             run_measurement_processes)

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
    return run_measurement_processes(CTX, target, args, len(args), 5.0, "timed out", "failed",
                                     join_s=0.5, **kw)


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


def test_free_loopback_port_is_a_port():
    assert 0 < free_loopback_port() < 65536
