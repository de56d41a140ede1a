"""CPU emulation: injected slowdown, emulated links, the memory cap (driven by a fake clock)."""
import time

import pytest

from megatron_het.cluster import get_accelerator
from megatron_het.emulation import EmulatedLink, EmulatedOutOfMemory, EmulationStats, Emulator
from megatron_het.errors import UserError

GIB = 1024 ** 3


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
    assert stats == EmulationStats(2, pytest.approx(6.0), pytest.approx(1.0), pytest.approx(2.0),
                                   1)
    assert stats.emulated_s == pytest.approx(7.0)


def test_keyed_regions_pad_to_the_least_cpu_time_of_their_key():
    clock, cpu = FakeClock(), FakeCpuClock()
    emulator = Emulator(4.0, clock=clock, sleep=clock.sleep, cpu_clock=cpu)

    def region(key, cpu_s):
        start = clock.now
        with emulator.timed_region(key):
            clock.work(cpu_s)
            cpu.now += cpu_s
        return clock.now - start

    assert region("forward", 1.5) == pytest.approx(6.0)  # first of its key: its own time
    assert region("forward", 1.0) == pytest.approx(4.0)
    # A host hiccup (cold caches after a wait) does not make the emulated kind slower.
    assert region("forward", 1.25) == pytest.approx(4.0)
    assert region("backward", 2.0) == pytest.approx(8.0)  # another key, its own history
    assert region(None, 1.25) == pytest.approx(5.0)  # no key: this region's own time
    assert emulator.stats().cpu_s == pytest.approx(7.0)  # what really ran is still accounted


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
        stats.late == 1 and slept == [])


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
        "a plan with less memory per device (more stages, tp or recompute) or raise memory_cap_gib")
    Emulator(2.0).check_memory(10 ** 15)  # no cap, no limit


@pytest.mark.parametrize("kwargs, message", [
    ({"slowdown": 0.5}, "emulated: slowdown must be a number >= 1.0 (an emulated kind can only be "
                        "slower than the host CPU), got 0.5"),
    ({"slowdown": 2.0, "memory_cap_gib": 0}, "emulated: memory_cap_gib must be positive, got 0"),
])
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


def test_a_rank_with_late_regions_warns(capsys):
    from types import SimpleNamespace

    from megatron_het.training.distributed import _warn_late_regions

    clock, cpu = FakeClock(), FakeCpuClock()
    emulator = Emulator(2.0, name="emu-slow (emulated)", clock=clock, sleep=clock.sleep,
                        cpu_clock=cpu)
    trainer = SimpleNamespace(executor=SimpleNamespace(emulator=emulator),
                              groups=SimpleNamespace(comm=SimpleNamespace(rank=3)))
    with emulator.timed_region():
        clock.work(1.0)
        cpu.now += 1.0
    _warn_late_regions(trainer)
    assert capsys.readouterr().err == ""
    with emulator.timed_region():
        clock.work(3.0)
        cpu.now += 1.0
    _warn_late_regions(trainer)
    assert capsys.readouterr().err == (
        "warning: rank 3 (emu-slow (emulated)): 1 of 2 compute regions took longer than 2 x "
        "their CPU time (EMULATION: the host's cores are shared by too many ranks); its times "
        "are slower than the emulated kind\n")
