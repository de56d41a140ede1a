"""Host staging of the relay bridge: buffer pool, chunk pipeline order, CPU ranks stay off CUDA."""

from __future__ import annotations

import pytest
import torch

from megatron_het.comm.relay import Bridge
from megatron_het.comm.staging import HostPool, relay_chunks, size_class


class Recorder:
    """A copier and transfer that log what happens, in order; copies really copy."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def start(self, tensor: torch.Tensor) -> int:
        return tensor.data_ptr()

    def to_host(self, host: torch.Tensor, device: torch.Tensor) -> object:
        host.copy_(device)
        at = self.offset(device)
        self.log.append(("d2h", at))
        return lambda: self.log.append(("d2h done", at))

    def to_device(self, device: torch.Tensor, host: torch.Tensor) -> object:
        device.copy_(host)
        at = self.offset(device)
        self.log.append(("h2d", at))
        return lambda: self.log.append(("h2d done", at))

    def join(self) -> None:
        self.log.append(("join", -1))

    def offset(self, view: torch.Tensor) -> int:
        return (view.data_ptr() - self.base.data_ptr()) // view.element_size()

    def launch(self, chunks: list[torch.Tensor]):
        """A transfer that doubles the chunk in place once waited on (like a 2-rank sum)."""

        def start(host: torch.Tensor):
            i = len(chunks)
            chunks.append(host)
            self.log.append(("launch", i))

            class Work:
                def wait(inner) -> None:
                    host.mul_(2)
                    self.log.append(("wait", i))

            return Work()

        return start


def test_size_classes_are_powers_of_two_with_a_floor() -> None:
    assert size_class(1) == 4096 and size_class(4096) == 4096
    assert size_class(4097) == 8192 and size_class(1 << 20) == 1 << 20


def test_pool_reuses_buffers_best_fit_and_runs_fences_before_reuse() -> None:
    pool = HostPool()
    a = pool.acquire(5000, torch.float32)
    b = pool.acquire(100, torch.float32)
    assert (pool.allocated, pool.outstanding) == (2, 2) and a.numel() == 5000
    fenced: list[str] = []
    pool.release(a, lambda: fenced.append("a"))
    pool.release(b)
    c = pool.acquire(50, torch.float32)  # best fit: b's 4096-element buffer, not a's 8192
    assert c.data_ptr() == b.data_ptr() and fenced == [] and pool.reused == 1
    d = pool.acquire(6000, torch.float32)  # a's buffer: its fence runs before reuse
    assert d.data_ptr() == a.data_ptr() and fenced == ["a"]
    e = pool.acquire(10, torch.bfloat16)  # another dtype: its own buffers
    assert pool.allocated == 3 and e.dtype == torch.bfloat16
    for view in (c, d, e):
        pool.release(view)
    assert pool.outstanding == 0


def test_pool_keeps_at_most_max_free_buffers() -> None:
    pool = HostPool(max_free=2)
    views = [pool.acquire(n, torch.float32) for n in (10, 5000, 10000)]
    for view in views:
        pool.release(view)
    assert sorted(buf.numel() for buf, _ in pool._free[torch.float32]) == [8192, 16384]


def test_pool_keeps_at_most_max_free_bytes_but_always_its_largest_buffer() -> None:
    """Free buffers over the byte cap go smallest first, across dtypes; each dropped one's
    fence (a copy still reading it) runs before it goes."""
    fenced: list[int] = []
    pool = HostPool(max_free_bytes=100_000)
    small = pool.acquire(4096, torch.float32)  # 16 KiB
    half = pool.acquire(4096, torch.float16)  # 8 KiB
    big = pool.acquire(16384, torch.float32)  # 64 KiB
    pool.release(small, lambda: fenced.append(4096))
    pool.release(half)
    pool.release(big)
    assert fenced == []  # 88 KiB free: under the cap
    huge = pool.acquire(40_000, torch.float32)  # 256 KiB on its own
    pool.release(huge)
    assert fenced == [4096]
    assert {dtype: [b.numel() for b, _ in free] for dtype, free in pool._free.items()} == {
        torch.float32: [65536],
        torch.float16: [],
    }


def run_relay(
    numel: int, spans: list[tuple[int, int]], **flags: bool
) -> tuple[torch.Tensor, Recorder, HostPool]:
    rec, pool = Recorder(), HostPool()
    tensor = torch.arange(float(numel))
    rec.base = tensor
    relay_chunks(tensor, spans, rec.launch([]), pool, rec, **flags)
    return tensor, rec, pool


def test_relay_chunks_overlap_copies_with_transfers() -> None:
    spans = [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20)]
    tensor, rec, pool = run_relay(20, spans)
    assert torch.equal(tensor, torch.arange(20.0) * 2)  # every chunk went out and came back
    at = {event: i for i, event in enumerate(rec.log)}
    for i, (a, _) in enumerate(spans):
        assert at[("d2h done", a)] < at[("launch", i)]  # the host chunk is ready before sending
        assert at[("wait", i)] < at[("h2d", a)]  # and comes back only after the transfer
    for i in range(len(spans) - 1):
        a, b = spans[i][0], spans[i + 1][0]
        assert at[("d2h", b)] < at[("wait", i)]  # next chunk's copy out overlaps transfer i
        assert at[("launch", i + 1)] < at[("wait", i)]  # two chunks on the wire at once
        assert at[("h2d", a)] < at[("wait", i + 1)]  # copy back overlaps transfer i+1
    assert rec.log[-1] == ("join", -1)
    # two chunks on the wire and one being copied out: three host buffers, reused after that
    assert pool.allocated == 3 and pool.reused == 2 and pool.outstanding == 0


def test_relay_chunks_send_only_and_receive_only() -> None:
    tensor, rec, _ = run_relay(8, [(0, 4), (4, 8)], copy_out=False)
    assert torch.equal(tensor, torch.arange(8.0))  # a broadcast source keeps its data
    assert not [e for e in rec.log if e[0].startswith("h2d")] and ("join", -1) not in rec.log
    tensor, rec, _ = run_relay(8, [(0, 4), (4, 8)], copy_in=False)
    assert not [e for e in rec.log if e[0].startswith("d2h")]
    assert [e for e in rec.log if e[0] == "h2d"] == [("h2d", 0), ("h2d", 4)]


def test_relay_without_a_pool_launches_views_of_the_tensor_at_once() -> None:
    chunks: list[torch.Tensor] = []
    rec = Recorder()
    tensor = torch.arange(8.0)
    relay_chunks(tensor, [(0, 4), (4, 8)], rec.launch(chunks), None, rec)
    assert [c.data_ptr() for c in chunks] == [tensor.data_ptr(), tensor[4:].data_ptr()]
    assert [e[0] for e in rec.log] == ["launch", "launch", "wait", "wait"]
    assert torch.equal(tensor, torch.arange(8.0) * 2)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any CUDA initialisation fails the test (it must never happen on a CPU rank)."""

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("CUDA was touched on a CPU rank")

    monkeypatch.setattr(torch.cuda, "_lazy_init", refuse)
    monkeypatch.setattr(torch.cuda, "current_stream", refuse)
    monkeypatch.setattr(torch.cuda, "Stream", refuse)
    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)


def test_cpu_staging_is_free_or_unpinned_and_never_touches_cuda(no_cuda: None) -> None:
    bridge = Bridge("relay")
    x = torch.arange(12.0)
    staged = bridge.stage(x)
    assert staged.host is x  # a contiguous CPU tensor is its own host buffer
    staged.finish()
    odd = torch.arange(12.0).view(3, 4).t()  # not contiguous: staged, unpinned
    staged = bridge.stage(odd)
    assert staged.host is not odd and torch.equal(staged.host, odd)
    assert not staged.host.is_pinned() and bridge.pool(odd).pin is False
    staged.host.mul_(3)
    staged.finish()
    assert torch.equal(odd, torch.arange(12.0).view(3, 4).t() * 3)
    assert bridge.pool(odd).outstanding == 0
    seen: list[int] = []

    def launch(host: torch.Tensor):
        seen.append(host.numel())
        return type("Done", (), {"wait": lambda self: None})()

    bridge.relay(odd.contiguous().view(-1), [(0, 6), (6, 12)], launch)
    assert seen == [6, 6]


def test_a_receive_buffer_is_copied_back_after_the_point_it_was_posted() -> None:
    """The bridge marks the device's stream when it stages a receive buffer (not when it
    stages a send, whose copy back must follow everything queued) and the copy back waits for
    that mark only."""
    from megatron_het.comm.staging import HostCopier

    calls: list = []

    class Marking(HostCopier):
        def mark(self):
            calls.append("mark")
            return f"mark {len(calls)}"

        def to_device(self, device, host, since=None):
            calls.append(("to_device", since))
            return super().to_device(device, host, since)

    bridge = Bridge("relay", copier_for=lambda device: Marking())
    bridge.needs_staging = lambda tensor: True
    out = torch.zeros(6)
    received = bridge.stage(out, copy_in=False)
    received.host.fill_(7)
    calls.append("compute queued after the post")
    received.finish()
    assert calls == ["mark", "compute queued after the post", ("to_device", "mark 1")]
    assert out.tolist() == [7.0] * 6
    calls.clear()
    sent = bridge.stage(torch.ones(3))  # in place (a reduction): back after everything
    sent.finish()
    assert calls == [("to_device", None)]


def test_a_direct_bridge_on_a_device_backend_sends_whole_tensors() -> None:
    bridge = Bridge("direct", "nccl")
    x = torch.arange(12.0).view(3, 4).t()
    assert not bridge.stages and bridge.stage(x).host is x
    seen: list[int] = []

    def launch(host: torch.Tensor):
        seen.append(host.numel())
        return type("Done", (), {"wait": lambda self: None})()

    bridge.relay(torch.zeros(12), [(0, 6), (6, 12)], launch)
    assert seen == [12]  # one transfer, no chunks: nothing is staged


def test_a_direct_bridge_on_gloo_still_stages_non_host_tensors() -> None:
    bridge = Bridge("direct", "gloo")
    assert bridge.stages
    assert bridge.needs_staging(torch.zeros(4, 4).t())
    assert not bridge.needs_staging(torch.zeros(4))
