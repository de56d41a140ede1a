"""Asynchronous collectives (``async_op=True``) of unified groups, over gloo on CPU.

Integer-valued data keeps every sum exact, so asynchronous results must equal the synchronous
ones bitwise, on single-kind groups (the backend's own asynchronous work) and on mixed groups
(hierarchical: first phases at the call, the last one in ``wait()``).
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch

from megatron_het.comm.async_ops import PendingHandle
from megatron_het.comm.communicator import UnifiedCommunicator
from megatron_het.comm.faults import CollectiveMismatchError
from tests.distributed.harness import RankFailure, run_ranks
from tests.distributed.test_comm_collectives import data
from tests.distributed.test_comm_device_links import FAKE, FakeDeviceCommunicator

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def make_comm(
    kinds: list[str], native: str = "gloo", debug: bool = False, timeout_s: float = 30
) -> UnifiedCommunicator:
    cls = FakeDeviceCommunicator if native == FAKE else UnifiedCommunicator
    return cls(
        kinds,
        {k: native for k in kinds},
        {k: "cpu" for k in kinds},
        timeout=datetime.timedelta(seconds=timeout_s),
        debug=debug,
    )


def compare_one_group(ug, me: int) -> list[str]:
    """Every async op against its sync twin on ``ug``; returns mismatches."""
    bad, n = [], ug.size
    for dtype in DTYPES:
        for shape in ((13,), (4, 6), (2, 1100)):
            ops = ("sum", "max") + (("avg",) if dtype.is_floating_point else ())
            for op in ops:
                x = data(10 * me + len(shape), shape, dtype)
                sync, done = x.clone(), x.clone()
                ug.all_reduce(sync, op)
                ug.all_reduce(done, op, async_op=True).wait()
                bad += [] if torch.equal(sync, done) else [f"all_reduce {op} {dtype} {shape}"]
                big = data(20 + me, (n * x.numel(),), dtype).view(n * shape[0], *shape[1:])
                sync, done = torch.empty_like(x), torch.empty_like(x)
                ug.reduce_scatter_tensor(sync, big, op)
                ug.reduce_scatter_tensor(done, big, op, async_op=True).wait()
                bad += [] if torch.equal(sync, done) else [f"reduce_scatter {op} {dtype} {shape}"]
            sync = torch.empty((n * shape[0],) + shape[1:], dtype=dtype)
            done = torch.empty_like(sync)
            ug.all_gather_into_tensor(sync, x)
            handle = ug.all_gather_into_tensor(done, x, async_op=True)
            handle.wait()
            bad += (
                []
                if torch.equal(sync, done) and handle.is_completed()
                else [f"all_gather {dtype} {shape}"]
            )
    # a non-contiguous tensor gets its result written back in wait()
    t = data(me, (6, 4), torch.float32).t()
    want = t.contiguous()
    ug.all_reduce(want)
    ug.all_reduce(t, async_op=True).wait()
    bad += [] if torch.equal(t, want) else ["all_reduce non-contiguous"]
    return bad


def async_equals_sync(rank: int, world_size: int, kinds: list[str], native: str) -> list[str]:
    comm = make_comm(kinds, native)
    single = comm.new_group([r for r in range(4) if kinds[r] == kinds[0]], name="single")
    mixed = comm.new_group([0, 3], name="mixed")
    bad = []
    for ug in (comm.world, single, mixed):
        if rank in ug.ranks:
            bad += [f"{ug.name}: {b}" for b in compare_one_group(ug, ug.rank)]
    comm.barrier()
    return bad


@pytest.mark.parametrize(
    "kinds, native",
    [
        (["fast", "fast", "slow", "slow"], "gloo"),
        (["fast", "fast", "fast", "slow"], "gloo"),
        (["fast", "fast", "slow", "slow"], FAKE),  # device-backend native links (see there)
    ],
)
def test_async_results_equal_sync_ones(kinds: list[str], native: str) -> None:
    assert run_ranks(async_equals_sync, 4, kinds, native, timeout=60) == [[]] * 4


def outstanding(rank: int, world_size: int, debug: bool) -> dict:
    kinds = ["fast", "fast", "slow", "slow"]
    comm = make_comm(kinds, debug=debug)
    # every rank builds every group, in one order; each uses its own TP (one kind) and DP
    # (mixed) group
    tps = [comm.new_group([0, 1], name="tp-fast"), comm.new_group([2, 3], name="tp-slow")]
    dps = [comm.new_group([0, 2], name="dp0"), comm.new_group([1, 3], name="dp1")]
    tp, dp = tps[rank // 2], dps[rank % 2]
    world = comm.world
    # three async ops on mixed groups and one on a single-kind group, sync ops in between
    a = torch.full((1000,), float(rank + 1))
    h_world = world.all_reduce(a, async_op=True)
    t = torch.full((5,), float(rank))
    tp.all_reduce(t)  # sync, other group
    b = torch.arange(8.0) + rank
    b_out = torch.empty(4)
    h_dp = dp.reduce_scatter_tensor(b_out, b, async_op=True)
    c = torch.full((3,), float(rank))
    h_tp = tp.all_reduce(c, op="max", async_op=True)
    g = torch.empty(8)
    dp.all_gather_into_tensor(g, torch.full((4,), float(rank)))  # sync, while h_dp is pending
    d = torch.full((7,), 2.0 * rank)
    h_world2 = world.all_reduce(d, op="avg", async_op=True)
    pending_before = [
        isinstance(h, PendingHandle) and not h.is_completed() for h in (h_world, h_dp, h_world2)
    ]
    h_world2.wait()  # waits out of order: the world's earlier op finishes first
    early = h_world.is_completed()
    for h in (h_tp, h_dp, h_world):
        h.wait()
    return {
        "a": a[0].item(),
        "t": t[0].item(),
        "b": b_out.tolist(),
        "c": c[0].item(),
        "g": g.tolist(),
        "d": d[0].item(),
        "pending_before": pending_before,
        "world_done_early": early,
    }


@pytest.mark.parametrize("debug", [False, True])
def test_outstanding_async_ops_interleaved_with_sync_ones(debug: bool) -> None:
    results = run_ranks(outstanding, 4, debug, timeout=60)
    for rank, r in enumerate(results):
        peer = 2 + rank % 2 if rank < 2 else rank % 2
        assert r["a"] == 10.0 and r["d"] == 3.0  # sums of 1..4, mean of 0,2,4,6
        assert r["t"] == (1.0 if rank < 2 else 5.0) and r["c"] == (1.0 if rank < 2 else 3.0)
        pair = sorted((rank, peer))
        block = pair.index(rank) * 4
        assert r["b"] == [2 * i + pair[0] + pair[1] for i in range(block, block + 4)]
        assert r["g"] == [float(pair[0])] * 4 + [float(pair[1])] * 4
        assert r["pending_before"] == [True, True, True] and r["world_done_early"]


def mismatch_async(rank: int, world_size: int) -> list[str]:
    comm = make_comm(["fast", "fast", "slow", "slow"], debug=True)
    out = []
    try:
        comm.world.all_reduce(torch.ones(4 if rank else 5), async_op=True).wait()
    except CollectiveMismatchError as exc:
        out.append(str(exc))
    t = torch.full((3,), float(rank))
    comm.world.all_reduce(t, async_op=True).wait()  # the group still works afterwards
    out.append(str(t[0].item()))
    return out


def test_debug_mode_checks_async_calls_when_they_are_made() -> None:
    results = run_ranks(mismatch_async, 4, timeout=60)
    assert all(r == results[0] for r in results)
    assert "rank 0 called all_reduce with float32[5] op=sum" in results[0][0]
    assert results[0][1] == "6.0"


def dead_peer_async(rank: int, world_size: int, group_ranks: list[int]) -> None:
    comm = make_comm(["fast", "fast", "slow", "slow"], timeout_s=5)
    group = comm.new_group(group_ranks, name="dp")
    comm.barrier()
    if rank == group_ranks[-1]:
        os._exit(1)
    if rank not in group_ranks:
        return
    time.sleep(0.5)
    handle = group.all_reduce(torch.ones(100), async_op=True)  # may fail here already
    handle.wait()


@pytest.mark.parametrize("group_ranks", [[0, 1], [0, 1, 2, 3]])
def test_waiting_on_a_dead_peer_raises_comm_error(group_ranks: list[int]) -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(dead_peer_async, 4, group_ranks, timeout=60)
    text = str(info.value)
    assert "did not finish" not in text  # nobody hung
    survivors = [r for r in group_ranks[:-1] if f"rank {r} failed" in text]
    assert survivors, text
    assert text.count("CommError: unified group 'dp': all_reduce") == len(survivors), text


def lagging_copies(rank: int, world_size: int) -> dict:
    """Every rank stages as a device rank does, through a copier whose copies to the host only
    finish when the gate opens (a device still busy with the work queued before them)."""
    import threading

    from megatron_het.comm import relay
    from megatron_het.comm.staging import HostCopier

    opened = threading.Event()

    class LaggingCopier(HostCopier):
        def to_host(self, host: torch.Tensor, device: torch.Tensor):
            host.copy_(device)
            return lambda: opened.wait(10)  # bounded: a caller that waits fails the test

    relay.default_copier = lambda device: LaggingCopier()
    relay.Bridge.needs_staging = lambda self, tensor: self.stages
    comm = make_comm(["fast", "fast", "slow", "slow"])
    tp = [comm.new_group([0, 1], name="tp-fast"), comm.new_group([2, 3], name="tp-slow")][rank // 2]
    dp = [comm.new_group([0, 2], name="dp0"), comm.new_group([1, 3], name="dp1")][rank % 2]
    starts = comm.bridge.starts
    a = torch.full((3000,), float(rank + 1))
    h_a = dp.all_reduce(a, async_op=True)  # returns with its copy to the host still running
    queued_after_call = starts.busy() and not opened.is_set()
    t = torch.full((5,), float(rank))
    tp.all_reduce(t)  # a native link goes on meanwhile
    b = torch.arange(8.0) + rank
    b_out = torch.empty(4)
    h_b = dp.reduce_scatter_tensor(b_out, b, async_op=True)
    gathered = torch.empty(2 * 600)
    h_g = dp.all_gather_into_tensor(gathered, torch.full((600,), float(rank)), async_op=True)
    still_queued = starts.busy()
    opened.set()
    h_g.wait()  # out of order: the reduce-scatter started before it finishes first
    g = torch.empty(8)
    dp.all_gather_into_tensor(g, torch.full((4,), float(rank)))  # sync, behind the queue
    h_b.wait()
    h_a.wait()
    # a send across kinds (a pipeline's activation) returns before its copy is done too
    opened.clear()
    peer = 2 + rank if rank < 2 else rank - 2
    if rank < 2:
        sent = comm.isend(torch.full((700,), float(rank + 5)), peer)
        send_queued = starts.busy() and not opened.is_set()
        got = torch.empty(0)
        opened.set()
        sent.wait()
    else:
        opened.set()  # a receive stages nothing in
        got = torch.empty(700)
        comm.recv(got, peer)
        send_queued = True
    return {
        "a": a.unique().tolist(),
        "t": t[0].item(),
        "b": b_out.tolist(),
        "g": g.tolist(),
        "gathered": [gathered[:600].unique().tolist(), gathered[600:].unique().tolist()],
        "queued_after_call": queued_after_call,
        "still_queued": still_queued,
        "submitted": starts.submitted,
        "send_queued": send_queued,
        "got": got.unique().tolist(),
    }


def test_staged_transfers_start_once_their_copy_is_done_without_blocking_the_caller() -> None:
    results = run_ranks(lagging_copies, 4, timeout=60)
    for rank, r in enumerate(results):
        peer = 2 + rank % 2 if rank < 2 else rank % 2
        pair = sorted((rank, peer))
        assert r["a"] == [float(pair[0] + pair[1] + 2)]
        assert r["t"] == (1.0 if rank < 2 else 5.0)
        block = pair.index(rank) * 4
        assert r["b"] == [2 * i + pair[0] + pair[1] for i in range(block, block + 4)]
        assert r["g"] == [float(pair[0])] * 4 + [float(pair[1])] * 4
        assert r["gathered"] == [[float(pair[0])], [float(pair[1])]]
        assert r["queued_after_call"] and r["still_queued"] and r["submitted"] >= 2, r
        assert r["send_queued"] and r["got"] == ([] if rank < 2 else [float(rank - 2 + 5)])
