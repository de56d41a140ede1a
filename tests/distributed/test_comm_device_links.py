"""The device-backend code paths (NCCL-like native and direct links) on CPU, over gloo.

:class:`CoalescingGloo` wraps a gloo backend so it behaves like a device backend where the
communicator can tell: it is not named "gloo" (so the communicator uses the backend's own
collectives, coalesced point-to-point batches and the eager connect, as on NCCL), it implements
the coalescing calls, and it counts the point-to-point transfers that arrive outside a batch.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_het.comm.communicator import UnifiedCommunicator
from tests.distributed.harness import run_ranks
from tests.distributed.test_comm_collectives import (
    Checker,
    check_moves,
    check_p2p,
    check_reductions,
)

FAKE = "fakenccl"


class _AllWorks:
    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class _Watched:
    """A gloo transfer whose is_completed() works without waiting (as on a device backend)."""

    def __init__(self, work: Any) -> None:
        self._work = work
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._error: BaseException | None = None
        self._thread.start()

    def _wait(self) -> None:
        try:
            self._work.wait()
        except BaseException as exc:
            self._error = exc

    def wait(self, timeout: Any = None) -> bool:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return not self._thread.is_alive()


class CoalescingGloo:
    """gloo with a device backend's coalescing API; sends of a batch are posted first."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._batch: list[tuple[str, list[torch.Tensor], int, int]] | None = None
        self.batches = 0  # coalesced batches issued
        self.single_p2p = 0  # sends/receives issued outside a batch
        self.all_reduces = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def allreduce(self, *args: Any) -> Any:
        self.all_reduces += 1
        return self._inner.allreduce(*args)

    def _start_coalescing(self, *device: torch.device) -> None:
        if self._batch is not None:
            raise RuntimeError("coalescing started twice")
        self._batch = []

    def _end_coalescing(self, *device: torch.device) -> _AllWorks:
        batch, self._batch = self._batch or [], None
        self.batches += 1
        batch.sort(key=lambda entry: entry[0] != "send")
        return _AllWorks([getattr(self._inner, op)(t, peer, tag) for op, t, peer, tag in batch])

    def _p2p(self, op: str, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        if self._batch is None:
            self.single_p2p += 1
            return _Watched(getattr(self._inner, op)(tensors, peer, tag))
        self._batch.append((op, tensors, peer, tag))
        return None

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        return self._p2p("send", tensors, peer, tag)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        return self._p2p("recv", tensors, peer, tag)


class FakeDeviceCommunicator(UnifiedCommunicator):
    """Builds links of backend "fakenccl" as :class:`CoalescingGloo` groups."""

    def _backend_available(self, backend: str) -> bool:
        return backend == FAKE or super()._backend_available(backend)

    def _new_backend_group(self, ranks: tuple[int, ...], backend: str) -> Any:
        if backend != FAKE:
            return super()._new_backend_group(ranks, backend)
        pg = dist.new_group(list(ranks), timeout=self.timeout, backend="gloo")
        return CoalescingGloo(pg) if self.rank in ranks else None


def device_links(comm: UnifiedCommunicator) -> list[CoalescingGloo]:
    groups = [comm.world]
    return [
        link.pg for g in groups for link in g._links.values() if isinstance(link.pg, CoalescingGloo)
    ]


def run_suite(
    rank: int,
    world_size: int,
    kinds: list[str],
    backends: dict[str, str],
    bridge: str,
    subgroups: list[list[int]],
) -> tuple[list[str], int, list[int]]:
    comm = FakeDeviceCommunicator(
        kinds,
        backends,
        {k: "cpu" for k in kinds},
        bridge=bridge,
        timeout=datetime.timedelta(seconds=30),
    )
    chk = Checker(rank)
    groups = [(comm.world, dist.new_group(list(range(world_size))))]
    for ranks in subgroups:
        groups.append((comm.new_group(ranks), dist.new_group(ranks)))
    connected = [pg.all_reduces for pg in device_links(comm)]  # right after building: 1 each
    for ug, ref in groups:
        if rank not in ug.ranks:
            continue
        tag = f"group {list(ug.ranks)}"
        check_reductions(chk, ug, ref, tag)
        check_moves(chk, ug, ref, tag)
        check_p2p(chk, ug, tag)
    comm.barrier()
    return chk.failures, chk.count, connected


@pytest.mark.parametrize("kinds", [["gpu", "gpu", "cpu", "cpu"], ["gpu", "gpu", "gpu", "cpu"]])
def test_relay_over_device_native_links_matches_torch_distributed(kinds: list[str]) -> None:
    backends = {"gpu": FAKE, "cpu": "gloo"}
    results = run_ranks(run_suite, 4, kinds, backends, "relay", [[0, 1], [1, 3]], timeout=90)
    failures = [f for fails, _, _ in results for f in fails]
    assert not failures, "\n".join(failures[:20])
    assert all(count > 200 for _, count, _ in results)
    for rank, (_, _, connected) in enumerate(results):
        assert connected == ([1] if kinds[rank] == "gpu" else [])  # the world's native link


def test_direct_bridge_over_a_shared_device_backend_matches_torch_distributed() -> None:
    kinds = ["fast", "fast", "fast", "slow"]  # both kinds run "fakenccl": direct chooses it
    results = run_ranks(
        run_suite, 4, kinds, {"fast": FAKE, "slow": FAKE}, "direct", [[1, 2, 3]], timeout=90
    )
    failures = [f for fails, _, _ in results for f in fails]
    assert not failures, "\n".join(failures[:20])
    for rank, (_, _, connected) in enumerate(results):
        # the world's bridge, native link and channels are all device links, connected once
        assert connected and set(connected) == {1}, (rank, connected)


def chunked_relay(rank: int, world_size: int, bridge: str) -> list[str]:
    """As in a world with device kinds: relayed transfers are cut in chunks on every rank."""
    kinds = ["fast", "fast", "fast", "slow"]
    comm = UnifiedCommunicator(
        kinds,
        {k: "gloo" for k in kinds},
        {k: "cpu" for k in kinds},
        bridge=bridge,
        timeout=datetime.timedelta(seconds=30),
    )
    comm.bridge.host_only = False  # what a GPU + CPU world does; the CPU ranks cut alike
    chk = Checker(rank)
    ref = dist.new_group(list(range(world_size)))
    for src in (0, 3):
        x = torch.arange(3 * (1 << 19) + 7, dtype=torch.float32) * (rank + 1)
        got, want = x.clone(), x.clone()
        comm.world.broadcast(got, src)
        dist.broadcast(want, src, group=ref)
        chk.equal(f"large broadcast from {src}", got, want)
    check_reductions(chk, comm.world, ref, "world")
    return chk.failures


@pytest.mark.parametrize("bridge", ["relay", "direct"])
def test_chunked_relay_between_cpu_ranks_matches_torch_distributed(bridge: str) -> None:
    failures = [f for fails in run_ranks(chunked_relay, 4, bridge, timeout=90) for f in fails]
    assert not failures, "\n".join(failures[:20])
