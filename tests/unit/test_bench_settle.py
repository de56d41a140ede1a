"""bench.settle: a run's warm-up ends where its iteration times settle."""

from __future__ import annotations

import pytest

from bench.settle import settle


def test_the_warm_up_ends_where_the_times_settle() -> None:
    times = [3.0, 1.6, 1.3, 1.01, 1.0, 0.99, 1.02, 1.0]
    steady = settle(times, least=1)
    assert (steady.dropped, steady.settled) == (3, True)
    assert steady.kept == (1.01, 1.0, 0.99, 1.02, 1.0)
    assert steady.median == 1.0


def test_at_least_the_given_warm_up_is_dropped() -> None:
    times = [1.0] * 6
    assert settle(times, least=2).dropped == 2
    assert settle(times, least=0).dropped == 0


def test_a_run_that_never_settles_keeps_its_last_and_says_so() -> None:
    times = [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]  # alternating: no three within 5% of the median
    steady = settle(times, least=1, keep=3)
    assert (steady.dropped, steady.settled, steady.kept) == (3, False, (2.0, 1.0, 2.0))


def test_a_rising_host_speed_is_followed_to_its_plateau() -> None:
    # a fast-only job whose tokens/s rose over its iterations: times falling, then flat
    times = [1.0 / x for x in (1085, 1200, 1300, 1420, 1433, 1431, 1436, 1430)]
    steady = settle(times, least=1)
    assert steady.dropped == 3 and steady.settled


def test_too_few_times_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot drop 2 and keep 3"):
        settle([1.0, 1.0, 1.0, 1.0], least=2, keep=3)
