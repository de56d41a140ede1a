"""The executor's region clock: host clock on CPU, device events read once on accelerators."""

from __future__ import annotations

import torch

from megatron_het.pipeline.timing import EventTimer, RegionClock


class FakeEvent:
    """A CUDA event on a fake device clock that advances 10 ms per recorded event."""

    now = 0.0

    def record(self) -> None:
        FakeEvent.now += 10.0
        self.at = FakeEvent.now

    def elapsed_time(self, end: FakeEvent) -> float:  # milliseconds, as CUDA's
        return end.at - self.at

    def synchronize(self) -> None:  # the host waits for this event
        FakeEvent.waited.append(self.at)


def test_events_are_read_once_after_one_synchronisation() -> None:
    FakeEvent.now, FakeEvent.waited = 0.0, []
    clock = RegionClock(torch.device("cpu"), EventTimer(FakeEvent))
    assert clock.uses_events
    clock.start()  # t=10
    with clock.region("compute"):  # 20 .. 30
        pass
    with clock.region("p2p"):  # 40 .. 50
        pass
    with clock.region("compute"):  # 60 .. 70
        pass
    assert FakeEvent.waited == []  # nothing waits for the device between regions
    times, wall = clock.totals()  # end at 80
    assert FakeEvent.waited == [80.0]  # one wait, for the last mark
    assert times == {"compute": 0.020, "p2p": 0.010}
    assert wall == 0.070


def test_cpu_regions_use_the_host_clock() -> None:
    clock = RegionClock(torch.device("cpu"))
    assert not clock.uses_events
    clock.start()
    with clock.region("compute"):
        sum(range(10000))
    times, wall = clock.totals()
    assert 0 < times["compute"] <= wall


def test_an_accelerator_waits_for_its_current_stream_only(monkeypatch) -> None:
    """The trainer's clock waits for the current stream (compute and waited collectives), not
    the whole device, on any accelerator module with streams (torch.cuda, torch_npu's)."""
    from types import SimpleNamespace

    from megatron_het.pipeline.timing import synchronize_stream

    waited = []
    stream = SimpleNamespace(synchronize=lambda: waited.append("stream"))
    monkeypatch.setattr(
        torch,
        "fakeacc",
        SimpleNamespace(
            current_stream=lambda device: stream,
            synchronize=lambda device=None: waited.append("device"),
        ),
        raising=False,
    )
    synchronize_stream(SimpleNamespace(type="fakeacc"))  # as torch.device("npu") with torch_npu
    synchronize_stream(torch.device("cpu"))
    assert waited == ["stream"]
