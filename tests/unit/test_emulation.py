"""CPU emulation: injected slowdown, emulated links, the memory cap (driven by a fake clock)."""

import time

import pytest

from megatron_het.cluster import get_accelerator
from megatron_het.emulation import (
    REFERENCE_QUANTILE,
    REFERENCE_WINDOW,
    EmulatedLink,
    EmulatedOutOfMemory,
    EmulationStats,
    Emulator,
    RankEmulation,
)
from megatron_het.errors import UserError

GIB = 1024**3


class FakeClock:
    """A clock that only moves when told to, and a sleep that moves it."""

    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def __call__(self):
        return self.now

    def work(self, seconds):
        self.now += seconds

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("slowdown", [1.0, 2.0, 3.5])
def test_injects_slowdown_minus_one_times_measured(slowdown):
    clock = FakeClock()
    emulator = Emulator(slowdown, clock=clock, sleep=clock.sleep)
    start = clock.now
    for seconds in (0.25, 0.5, 1.25):
        with emulator.timed_region():
            clock.work(seconds)
    stats = emulator.stats()
    assert stats.regions == 3
    assert stats.measured_s == pytest.approx(2.0)
    assert stats.injected_s == pytest.approx((slowdown - 1.0) * 2.0)
    assert stats.emulated_s == pytest.approx(clock.now - start) == pytest.approx(slowdown * 2.0)
    expected_sleeps = [] if slowdown == 1.0 else [(slowdown - 1.0) * s for s in (0.25, 0.5, 1.25)]
    assert clock.sleeps == pytest.approx(expected_sleeps)


def test_compute_returns_result_and_accounts():
    clock = FakeClock()
    emulator = Emulator(2.0, clock=clock, sleep=clock.sleep)

    def step(x):
        clock.work(0.1)
        return x * 3

    assert emulator.compute(step, 7) == 21
    assert emulator.stats().injected_s == pytest.approx(0.1)
    emulator.reset()
    assert emulator.stats() == EmulationStats(0, 0.0, 0.0)


def test_failing_region_is_not_padded():
    clock = FakeClock()
    emulator = Emulator(2.0, clock=clock, sleep=clock.sleep)
    with pytest.raises(RuntimeError):
        with emulator.timed_region():
            clock.work(1.0)
            raise RuntimeError("boom")
    assert clock.sleeps == [] and emulator.stats().regions == 0


def test_real_clock_ratio_is_accounted_exactly():
    slept = []
    emulator = Emulator(3.0, sleep=slept.append)
    for _ in range(3):
        with emulator.timed_region():
            sum(i * i for i in range(20000))
    stats = emulator.stats()
    assert stats.measured_s > 0
    assert stats.injected_s / stats.measured_s == pytest.approx(2.0)
    assert sum(slept) == pytest.approx(stats.injected_s)


class FakeCpuClock:
    """CPU seconds of the calling thread: moves only while it computes."""

    def __init__(self):
        self.now = 7.0

    def __call__(self):
        return self.now


def test_cpu_basis_pads_to_slowdown_times_cpu_time():
    clock, cpu = FakeClock(), FakeCpuClock()
    emulator = Emulator(3.0, clock=clock, sleep=clock.sleep, cpu_clock=cpu)
    assert emulator.basis == "cpu"
    start = clock.now
    with emulator.timed_region():  # 1 s of CPU work that took 2 s: a shared core
        clock.work(2.0)
        cpu.now += 1.0
    assert clock.sleeps == pytest.approx([1.0])  # 3 x 1 s in all, not 3 x 2 s
    assert clock.now - start == pytest.approx(3.0)
    with emulator.timed_region():  # a crowded host: 4 s for 1 s of CPU, past 3 x 1 s
        clock.work(4.0)
        cpu.now += 1.0
    stats = emulator.stats()
    assert clock.sleeps == pytest.approx([1.0])
    assert stats == EmulationStats(2, pytest.approx(6.0), pytest.approx(1.0), pytest.approx(2.0), 1)
    assert stats.emulated_s == pytest.approx(7.0)


def test_keyed_regions_pad_to_a_low_quantile_of_their_key():
    clock, cpu = FakeClock(), FakeCpuClock()
    emulator = Emulator(
        4.0,
        clock=clock,
        sleep=clock.sleep,
        cpu_clock=cpu,
        reference_window=4,
        reference_quantile=0.25,
    )

    def region(key, cpu_s):
        start = clock.now
        with emulator.timed_region(key):
            clock.work(cpu_s)
            cpu.now += cpu_s
        return clock.now - start

    assert region("forward", 1.5) == pytest.approx(6.0)  # first of its key: its own time
    assert region("forward", 1.0) == pytest.approx(4.0)  # the lesser of 2 (index 0)
    # A host hiccup (cold caches after a wait) does not make the emulated kind slower.
    assert region("forward", 1.25) == pytest.approx(4.0)
    assert region("backward", 2.0) == pytest.approx(8.0)  # another key, its own history
    assert region(None, 1.25) == pytest.approx(5.0)  # no key: this region's own time
    # 4 in the window: the reference is the 2nd least, so one lucky region does not set it,
    # and it pads to the reference like every region of its key.
    assert region("forward", 0.5) == pytest.approx(4.0)  # window 1.5 1.0 1.25 0.5
    # The window keeps the last 4 regions.
    assert region("forward", 1.25) == pytest.approx(4.0)  # window 1.0 1.25 0.5 1.25
    assert region("forward", 1.25) == pytest.approx(5.0)  # window 1.25 0.5 1.25 1.25
    assert emulator.stats().cpu_s == pytest.approx(10.0)  # what really ran is accounted


@pytest.mark.parametrize(
    "quantile, settled_s, lucky_min_s",
    [
        (0.0, 2.0, 1.0),  # the least of the last 20: 1.0 (the default rule); with the lucky 0.5
        # in the window the regions are late and last their own CPU time
        (0.25, 2.4, 2.4),  # their 6th least: 1.2, which one lucky region does not move
    ],
)
def test_keyed_reference_does_not_drift_with_the_number_of_regions(
    quantile, settled_s, lucky_min_s
):
    """A running least would fall with every lucky region and never come back (the emulated
    kind speeding up the longer it runs); the reference over a window forgets one."""
    clock, cpu = FakeClock(), FakeCpuClock()
    emulator = Emulator(
        2.0,
        clock=clock,
        sleep=clock.sleep,
        cpu_clock=cpu,
        reference_window=20,
        reference_quantile=quantile,
    )
    cycle = [1.0 + 0.1 * i for i in range(10)]  # the host's spread of one region's CPU time
    lengths = []
    for n in range(200):
        start = clock.now
        with emulator.timed_region("forward"):
            work = 0.5 if n == 50 else cycle[(3 * n) % 10]  # one lucky region at n = 50
            clock.work(work)
            cpu.now += work
        lengths.append(clock.now - start)
    # Every region alike (2 x the reference of a window holding two of each value), before the
    # lucky region and again once it has left the window.
    settled = lengths[20:50] + lengths[70:]
    assert settled == pytest.approx([settled_s] * len(settled))
    assert min(lengths[50:70]) == pytest.approx(lucky_min_s)
    assert max(lengths[50:70]) <= settled_s + 1e-9


def test_default_reference_is_the_least_of_a_window():
    clock, cpu = FakeClock(), FakeCpuClock()
    emulator = Emulator(2.0, clock=clock, sleep=clock.sleep, cpu_clock=cpu)
    for work in [1.0] + [1.5] * REFERENCE_WINDOW:
        with emulator.timed_region("forward"):
            clock.work(work)
            cpu.now += work
    start = clock.now
    with emulator.timed_region("forward"):  # 1.0 has left the window: the least is 1.5 now
        clock.work(1.5)
        cpu.now += 1.5
    assert clock.now - start == pytest.approx(3.0)
    assert REFERENCE_QUANTILE == 0.0


def test_fixed_reference_keys_keep_one_speed_whatever_the_host_does():
    clock, cpu = FakeClock(), FakeCpuClock()
    emulator = Emulator(
        2.0, clock=clock, sleep=clock.sleep, cpu_clock=cpu, fixed_reference_s={"forward": 0.5}
    )
    assert emulator.fixed_reference_s == {"forward": 0.5}

    def region(key, cpu_s, wall_s=None):
        start = clock.now
        with emulator.timed_region(key):
            clock.work(cpu_s if wall_s is None else wall_s)
            cpu.now += cpu_s
        return clock.now - start

    # A faster or slower host (less or more CPU time for the same work) changes nothing.
    assert region("forward", 0.25) == pytest.approx(1.0)
    assert region("forward", 0.75) == pytest.approx(1.0)
    assert region("forward", 0.4, wall_s=0.9) == pytest.approx(1.0)  # shared core, in time
    assert emulator.stats().late == 0
    assert region("forward", 0.5, wall_s=1.5) == pytest.approx(1.5)  # past 2 x 0.5 s: late
    assert emulator.stats().late == 1
    # Keys without a fixed time keep the measured reference.
    assert region("backward", 0.75) == pytest.approx(1.5)
    assert region("backward", 1.0) == pytest.approx(1.5)


def test_fixed_reference_counts_late_regions_at_slowdown_one():
    clock, cpu = FakeClock(), FakeCpuClock()
    emulator = Emulator(
        1.0, clock=clock, sleep=clock.sleep, cpu_clock=cpu, fixed_reference_s={"forward": 1.0}
    )
    with emulator.timed_region("forward"):
        clock.work(0.5)
        cpu.now += 0.5
    assert clock.sleeps == pytest.approx([0.5]) and emulator.stats().late == 0
    with emulator.timed_region("forward"):
        clock.work(1.5)
        cpu.now += 1.5
    assert emulator.stats().late == 1


def test_fixed_reference_settings_are_checked():
    with pytest.raises(ValueError, match="CPU basis"):
        Emulator(2.0, fixed_reference_s={"forward": 1.0})
    with pytest.raises(ValueError, match="must be positive"):
        Emulator(2.0, cpu_clock=time.thread_time, fixed_reference_s={"forward": 0.0})
    with pytest.raises(UserError, match="one compute thread per rank"):
        Emulator.from_spec(
            get_accelerator("emu-slow"), threads=4, fixed_reference_s={"forward": 1.0}
        )
    fixed = Emulator.from_spec(
        get_accelerator("emu-slow"), threads=1, fixed_reference_s={"forward": 1.0}
    )
    assert fixed.basis == "cpu" and fixed.fixed_reference_s == {"forward": 1.0}


def test_reference_settings_are_checked():
    with pytest.raises(ValueError, match="reference_window"):
        Emulator(2.0, reference_window=0)
    with pytest.raises(ValueError, match="reference_quantile"):
        Emulator(2.0, reference_quantile=1.0)


def test_cpu_basis_slowdown_one_never_waits_nor_counts_late():
    clock, cpu = FakeClock(), FakeCpuClock()
    emulator = Emulator(1.0, clock=clock, sleep=clock.sleep, cpu_clock=cpu)
    with emulator.timed_region():
        clock.work(2.0)
        cpu.now += 1.0
    assert clock.sleeps == [] and emulator.stats().late == 0


def test_from_spec_picks_the_basis_by_threads():
    spec = get_accelerator("emu-slow")
    assert Emulator.from_spec(spec, threads=1).basis == "cpu"
    assert Emulator.from_spec(spec, threads=4).basis == "wall"
    assert Emulator(2.0).basis == "wall"


def test_real_cpu_clock_pads_a_busy_region_to_the_slowdown():
    slept = []
    emulator = Emulator(2.0, sleep=slept.append, cpu_clock=time.thread_time)
    with emulator.timed_region():
        sum(i * i for i in range(200000))
    stats = emulator.stats()
    assert stats.cpu_s > 0 and stats.regions == 1
    assert stats.measured_s + sum(slept) == pytest.approx(2.0 * stats.cpu_s, rel=1e-6) or (
        stats.late == 1 and slept == []
    )


def test_from_spec_uses_the_kind():
    clock = FakeClock()
    slow = Emulator.from_spec(get_accelerator("emu-slow"), clock=clock, sleep=clock.sleep)
    real = Emulator.from_spec(get_accelerator("H100"), clock=clock, sleep=clock.sleep)
    assert (slow.slowdown, real.slowdown) == (2.0, 1.0)
    assert slow.name == "emu-slow (emulated)"


def test_memory_cap():
    emulator = Emulator(2.0, memory_cap_gib=1.5, name="emu-slow (emulated)")
    emulator.check_memory(int(1.5 * GIB))
    with pytest.raises(EmulatedOutOfMemory) as exc:
        emulator.check_memory(2 * GIB, what="stage 1")
    assert isinstance(exc.value, UserError)
    assert str(exc.value) == (
        "emu-slow (emulated): stage 1 needs 2.00 GiB but the emulated memory cap is 1.5 GiB; use "
        "a plan with less memory per device (more stages, tp or recompute) or raise memory_cap_gib"
    )
    Emulator(2.0).check_memory(10**15)  # no cap, no limit


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"slowdown": 0.5},
            "emulated: slowdown must be a number >= 1.0 (an emulated kind can only be "
            "slower than the host CPU), got 0.5",
        ),
        (
            {"slowdown": 2.0, "memory_cap_gib": 0},
            "emulated: memory_cap_gib must be positive, got 0",
        ),
    ],
)
def test_emulator_validation(kwargs, message):
    with pytest.raises(UserError) as exc:
        Emulator(**kwargs)
    assert str(exc.value) == message


def test_emulated_link_delay_and_wait():
    clock = FakeClock()
    link = EmulatedLink(bandwidth_gbps=2.0, latency_s=50e-6, sleep=clock.sleep)
    assert link.delay(0) == 50e-6
    assert link.delay(4_000_000) == pytest.approx(50e-6 + 2e-3)
    assert link.wait(4_000_000) == pytest.approx(2.05e-3)
    assert link.wait(4_000_000, elapsed_s=1e-3) == pytest.approx(1.05e-3)
    assert link.wait(4_000_000, elapsed_s=1.0) == 0.0
    assert clock.sleeps == pytest.approx([2.05e-3, 1.05e-3])
    assert (link.transfers, link.bytes_sent) == (3, 12_000_000)
    assert link.injected_s == pytest.approx(3.1e-3)
    assert "(emulated)" in repr(link)


def test_emulated_link_validation():
    with pytest.raises(UserError, match="emulated link: bandwidth_gbps must be positive, got 0"):
        EmulatedLink(0, 1e-6)
    with pytest.raises(UserError, match="emulated link: latency_s must be zero or more, got -1"):
        EmulatedLink(1.0, -1)


def test_default_clock_and_sleep_are_real():
    emulator = Emulator(1.0)
    with emulator.timed_region():
        time.sleep(0)
    assert emulator.stats().regions == 1 and emulator.stats().injected_s == 0.0


def test_a_rank_with_late_regions_warns():
    clock, cpu = FakeClock(), FakeCpuClock()
    emulator = Emulator(
        2.0, name="emu-slow (emulated)", clock=clock, sleep=clock.sleep, cpu_clock=cpu
    )
    emulation = RankEmulation(3, emulator, None)
    with emulator.timed_region():
        clock.work(1.0)
        cpu.now += 1.0
    assert emulation.late_warning() is None
    with emulator.timed_region():
        clock.work(3.0)
        cpu.now += 1.0
    assert emulation.late_warning() == (
        "warning: rank 3 (emu-slow (emulated)): 1 of 2 compute regions took longer than 2 x "
        "their CPU time (EMULATION: the host's cores are shared by too many ranks); its times "
        "are slower than the emulated kind; raise the emulated kinds' slowdowns (the demo's "
        "--dilation), launch fewer ranks per host core, or use a host with more cores"
    )
    assert RankEmulation(0, None, None).late_warning() is None  # not an emulated kind


def test_bench_counts_the_late_region_warnings():
    """bench/hetero_efficiency.py reads the warning back from each run's log."""
    from bench.hetero_runs import late_regions

    log = []
    for rank, walls in ((0, (3.0, 1.0, 3.0)), (2, (1.0, 3.0))):
        clock, cpu = FakeClock(), FakeCpuClock()
        emulator = Emulator(
            2.0,
            name="emu-fast (emulated)",
            clock=clock,
            sleep=clock.sleep,
            cpu_clock=cpu,
            fixed_reference_s={"forward": 1.0},
        )
        for wall in walls:
            with emulator.timed_region("forward"):
                clock.work(wall)
                cpu.now += 1.0
        log.append(RankEmulation(rank, emulator, None).late_warning() + "\n")
    assert "2 of 3 compute regions overran 2 x their profiled time and 1.00 s (16.7% of" in log[0]
    assert late_regions("iteration 1 ...\n" + "".join(log)) == (3, 5)
    assert late_regions("no warnings\n") == (0, 0)


def test_fixed_regions_make_up_an_overrun_and_owe_only_the_rest():
    """A profiled region the host stalled is made up by padding the next ones less: the kind's
    schedule is kept, and only what cannot be made up counts against the rank."""
    clock, cpu = FakeClock(), FakeCpuClock()
    emulator = Emulator(
        2.0,
        name="emu-fast (emulated)",
        clock=clock,
        sleep=clock.sleep,
        cpu_clock=cpu,
        fixed_reference_s={"forward": 1.0},
    )
    emulation = RankEmulation(0, emulator, None)
    start = clock.now
    for wall in (3.5, 1.0, 1.0, 1.0):  # 1.5 s over the first region's 2 s, then 1 s slack each
        with emulator.timed_region("forward"):
            clock.work(wall)
            cpu.now += 1.0
    stats = emulator.stats()
    assert clock.now - start == pytest.approx(8.0)  # four regions of 2 s: on the kind's schedule
    assert (stats.late, stats.behind_s, stats.scheduled_s) == (1, pytest.approx(0.0), 8.0)
    assert emulation.late_warning() is None
    with emulator.timed_region("forward"):
        clock.work(2.5)
        cpu.now += 1.0
    assert emulator.stats().behind_s == pytest.approx(0.5)
    assert "0.50 s (5.0% of the kind's compute time) could not be made up" in (
        emulation.late_warning()
    )
