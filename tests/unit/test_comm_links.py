"""Device-backend links: connected once when built, p2p batches coalesced per link (fakes only)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from megatron_het.comm import p2p
from megatron_het.comm.groups import UnifiedGroup
from megatron_het.comm.layout import GroupLayout
from megatron_het.comm.links import Link
from megatron_het.comm.relay import Bridge

KINDS = ["gpu", "gpu", "cpu", "cpu"]  # "gpu" runs a device backend ("fakenccl"), "cpu" gloo


class FakeWork:
    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FakeBackend:
    """Records every call; stands in for a backend object (not a registered ProcessGroup)."""

    def __init__(self, ranks: tuple[int, ...], backend: str) -> None:
        self.ranks, self.backend = ranks, backend
        self.calls: list[tuple] = []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> FakeWork:
        self.calls.append(("allreduce", tensors[0].numel()))
        return FakeWork()

    def _start_coalescing(self, *device: torch.device) -> None:
        self.calls.append(("start", *device))

    def _end_coalescing(self, *device: torch.device) -> FakeWork:
        self.calls.append(("end", *device))
        return FakeWork()

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> FakeWork:
        self.calls.append(("send", peer, tag))
        return FakeWork()

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> FakeWork:
        self.calls.append(("recv", peer, tag))
        return FakeWork()


class FakeProcessGroup(FakeBackend, dist.ProcessGroup):
    def __init__(self, ranks: tuple[int, ...], backend: str) -> None:
        dist.ProcessGroup.__init__(self, 0, len(ranks))
        FakeBackend.__init__(self, ranks, backend)


def build(me: int, bridge: Bridge) -> tuple[UnifiedGroup, list[FakeBackend]]:
    made: list[FakeBackend] = []

    def factory(ranks: tuple[int, ...], backend: str) -> FakeBackend | None:
        if me not in ranks:
            return None
        made.append(FakeBackend(ranks, backend))
        return made[-1]

    layout = GroupLayout.build(range(4), KINDS)
    group = UnifiedGroup(
        layout, me, "g", bridge, {"gpu": "fakenccl", "cpu": "gloo"}, factory, debug=False
    )
    return group, made


def warm_ups(made: list[FakeBackend]) -> dict[tuple[str, tuple[int, ...]], int]:
    return {(b.backend, b.ranks): sum(c == ("allreduce", 1) for c in b.calls) for b in made}


def test_device_links_are_connected_once_when_built_and_gloo_links_never() -> None:
    group, made = build(0, Bridge("relay"))
    assert warm_ups(made) == {
        ("gloo", (0, 1, 2, 3)): 0,
        ("fakenccl", (0, 1)): 1,
        ("gloo", (0, 2)): 0,
    }
    assert group.native.backend == "fakenccl"
    _, made = build(3, Bridge("relay"))  # a gloo kind: nothing to connect
    assert set(warm_ups(made).values()) == {0}


def test_a_direct_bridge_on_a_device_backend_connects_its_links_too() -> None:
    _, made = build(1, Bridge("direct", "fakenccl"))
    assert warm_ups(made) == {
        ("fakenccl", (0, 1, 2, 3)): 1,
        ("gloo", (0, 1, 2, 3)): 0,
        ("fakenccl", (0, 1)): 1,
        ("fakenccl", (1, 3)): 1,
    }


def test_coalesced_batch_calls_the_backend_with_link_ranks() -> None:
    backend = FakeBackend((2, 5, 7), "fakenccl")
    link = Link(backend, (7, 2, 5), 5, "fakenccl", "native[gpu]", "g")
    t = torch.zeros(3)
    works = p2p.coalesced(link, [p2p.P2POp("isend", t, 7, 4), p2p.P2POp("irecv", t, 2, 4)])
    assert backend.calls == [("start",), ("send", 2, 4), ("recv", 0, 4), ("end",)]
    assert len(works) == 1
    group_pg = FakeProcessGroup((0, 1), "fakenccl")  # a registered group takes the device
    p2p.coalesced(Link(group_pg, (0, 1), 0, "fakenccl", "native", "g"), [p2p.P2POp("isend", t, 1)])
    assert group_pg.calls == [("start", t.device), ("send", 1, 0), ("end", t.device)]


def test_batch_coalesces_device_link_ops_and_posts_gloo_ops_singly() -> None:
    native = FakeBackend((0, 1), "fakenccl")
    flat = FakeBackend((0, 1, 2, 3), "gloo")
    parts = SimpleNamespace(
        layout=GroupLayout.build(range(4), KINDS),
        me=0,
        bridge=Bridge("relay"),
        native=Link(native, (0, 1), 0, "fakenccl", "native[gpu]", "g"),
        flat=Link(flat, (0, 1, 2, 3), 0, "gloo", "bridge", "g"),
    )
    t = torch.zeros(2)
    ops = [
        p2p.P2POp("irecv", t, 1),
        p2p.P2POp("irecv", t, 2),
        p2p.P2POp("isend", t, 1),
        p2p.P2POp("isend", t, 3),
    ]
    handles = p2p.batch_isend_irecv(parts, ops)
    assert len(handles) == 4 and handles[0] is handles[2]  # one handle for the native batch
    assert native.calls == [("start",), ("recv", 1, 0), ("send", 1, 0), ("end",)]
    assert flat.calls == [("send", 3, 0), ("recv", 2, 0)]  # sends posted first
    for handle in handles:
        handle.wait()
