"""The "unified" torch.distributed backend: plain dist.* calls and DDP over mixed groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_het.comm.backend import register_unified_backend
from megatron_het.comm.communicator import UnifiedCommunicator
from tests.distributed.harness import run_ranks

MICRO = 3  # samples per rank
STEPS = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))


def batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return (
        torch.randn(world_size * MICRO, 8, generator=gen),
        torch.randn(world_size * MICRO, 5, generator=gen),
    )


def ddp_steps(rank: int, world_size: int, kinds: list[str]) -> list[list[torch.Tensor]]:
    register_unified_backend(kinds, {k: "gloo" for k in kinds})
    group = dist.new_group(list(range(world_size)), backend="unified")
    model = make_model()
    # tiny buckets: several all-reduces per step, of uneven sizes
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, process_group=group, bucket_cap_mb=0.0005
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        x, y = batch(step, world_size)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    grads.append([p.detach().clone() for p in model.parameters()])
    return grads


@pytest.mark.slow
def test_ddp_over_mixed_group_matches_single_process() -> None:
    kinds = ["fast", "fast", "slow", "slow"]
    results = run_ranks(ddp_steps, 4, kinds, timeout=60)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS + 1):
        if step < STEPS:
            x, y = batch(step, 4)
            opt.zero_grad()
            # mean over 4 ranks of per-rank mean losses == mean over the full batch
            torch.nn.functional.mse_loss(model(x), y).backward()
            want = [p.grad for p in model.parameters()]
        else:
            want = [p.detach() for p in model.parameters()]
        for rank in range(4):
            for got, ref in zip(results[rank][step], want):
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        if step < STEPS:
            opt.step()


def plain_dist_calls(rank: int, world_size: int, kinds: list[str]) -> list[str]:
    comm = UnifiedCommunicator(kinds, {k: "gloo" for k in kinds}, {k: "cpu" for k in kinds})
    comm.register_torch_backend()
    ranks = [0, 1, 3]  # mixed subgroup: 2 "fast" + 1 "slow"
    unified = dist.new_group(ranks, backend="unified")
    ref = dist.new_group(ranks, backend="gloo")
    if rank not in ranks:
        return []
    bad = []
    x = torch.arange(6, dtype=torch.int64) * (rank + 1)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        got, want = x.clone(), x.clone()
        dist.all_reduce(got, op=op, group=unified)
        dist.all_reduce(want, op=op, group=ref)
        bad += [] if torch.equal(got, want) else [f"all_reduce {op}"]
    got = [torch.empty_like(x) for _ in ranks]
    want = [torch.empty_like(x) for _ in ranks]
    dist.all_gather(got, x, group=unified)
    dist.all_gather(want, x, group=ref)
    bad += [] if all(map(torch.equal, got, want)) else ["all_gather"]
    out, out_ref = torch.empty(3 * 6, dtype=torch.int64), torch.empty(3 * 6, dtype=torch.int64)
    dist.all_gather_into_tensor(out, x, group=unified)
    dist.all_gather_into_tensor(out_ref, x, group=ref)
    bad += [] if torch.equal(out, out_ref) else ["all_gather_into_tensor"]
    one, one_ref = torch.empty(2, dtype=torch.int64), torch.empty(2, dtype=torch.int64)
    dist.reduce_scatter_tensor(one, x, group=unified)
    dist.reduce_scatter_tensor(one_ref, x, group=ref)
    bad += [] if torch.equal(one, one_ref) else ["reduce_scatter_tensor"]
    sizes = [1, 2, 3]  # uneven all_to_all_single: rank i sends sizes[j] elements to rank j
    out_split = [sizes[ranks.index(rank)]] * 3
    inp = torch.arange(6, dtype=torch.int64) + 100 * rank
    recv = torch.empty(sum(out_split), dtype=torch.int64)
    dist.all_to_all_single(recv, inp, out_split, sizes, group=unified)
    mine = ranks.index(rank)
    expect = torch.cat(
        [(torch.arange(6) + 100 * r)[sum(sizes[:mine]) : sum(sizes[: mine + 1])] for r in ranks]
    )
    bad += [] if torch.equal(recv, expect) else ["all_to_all_single"]
    # the name torch.distributed calls before torch 2.13
    recv.zero_()
    unified.alltoall_base(recv, inp, out_split, sizes, dist.AllToAllOptions()).wait()
    bad += [] if torch.equal(recv, expect) else ["alltoall_base"]
    got, want = x.clone(), x.clone()
    dist.broadcast(got, src=3, group=unified)  # src is a global rank, as in torch
    dist.broadcast(want, src=3, group=ref)
    bad += [] if torch.equal(got, want) else ["broadcast"]
    dist.barrier(group=unified)
    if rank == 0:
        dist.send(x, dst=3, group=unified)
    elif rank == 3:
        got = torch.empty_like(x)
        dist.recv(got, src=0, group=unified)
        bad += [] if torch.equal(got, torch.arange(6)) else ["send/recv"]
    return bad


def test_plain_dist_calls_over_unified_backend() -> None:
    results = run_ranks(plain_dist_calls, 4, ["fast", "fast", "slow", "slow"], timeout=60)
    assert results == [[], [], [], []]


def fake_device_links(store, rank: int, size: int, timeout, backend: str):
    """Link builder whose "fakenccl" links are gloo behaving like a device backend."""
    from megatron_het.comm.backend import build_backend
    from tests.distributed.test_comm_device_links import FAKE, CoalescingGloo

    if backend == FAKE:
        return CoalescingGloo(build_backend(store, rank, size, timeout, "gloo"))
    return build_backend(store, rank, size, timeout, backend)


def p2p_and_scatters(rank: int, world_size: int, native: str) -> list[str]:
    """batch_isend_irecv, reduce_scatter and all_to_all through the unified backend, on the
    world (2 + 2 ranks) and on a group of 2 ranks of one kind, against plain gloo groups."""
    kinds = ["fast", "fast", "slow", "slow"]
    builder = fake_device_links if native != "gloo" else None
    register_unified_backend(
        kinds, {"fast": native, "slow": "gloo"}, **({"link_builder": builder} if builder else {})
    )
    groups = [
        (
            list(range(4)),
            dist.new_group(list(range(4)), backend="unified"),
            dist.new_group(list(range(4)), backend="gloo"),
        )
    ]
    for ranks in ([0, 1], [2, 3]):
        pair = (
            ranks,
            dist.new_group(ranks, backend="unified"),
            dist.new_group(ranks, backend="gloo"),
        )
        if rank in ranks:
            groups.append(pair)
    bad = []
    for ranks, unified, ref in groups:
        n, me = len(ranks), ranks.index(rank)
        where = f"{ranks}"
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
        x = torch.arange(5, dtype=torch.int64) + 10 * rank
        got_next, got_prev = torch.empty_like(x), torch.empty_like(x)
        ops = [
            dist.P2POp(dist.irecv, got_prev, prv, unified),  # receives listed first
            dist.P2POp(dist.isend, x, nxt, unified),
            dist.P2POp(dist.isend, x + 1, prv, unified),
            dist.P2POp(dist.irecv, got_next, nxt, unified),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        ok = torch.equal(got_prev, torch.arange(5) + 10 * prv) and torch.equal(
            got_next, torch.arange(5) + 10 * nxt + 1
        )
        bad += [] if ok else [f"{where} batch_isend_irecv"]
        inputs = [torch.arange(3, dtype=torch.int64) * (i + 1) + rank for i in range(n)]
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            got, want = torch.empty(3, dtype=torch.int64), torch.empty(3, dtype=torch.int64)
            dist.reduce_scatter(got, inputs, op=op, group=unified)
            dist.reduce_scatter(want, inputs, op=op, group=ref)
            bad += [] if torch.equal(got, want) else [f"{where} reduce_scatter {op}"]
        got, want = torch.empty(3, dtype=torch.int64), torch.empty(3, dtype=torch.int64)
        dist.reduce_scatter_tensor(got, torch.cat(inputs), group=unified)
        dist.reduce_scatter_tensor(want, torch.cat(inputs), group=ref)
        bad += [] if torch.equal(got, want) else [f"{where} reduce_scatter_tensor"]
        # all_to_all against the result written out (gloo has no list all_to_all before
        # torch 2.13): the i-th tensor received comes from group member i, its tensor for me
        ins = [torch.full((2,), 100 * rank + i, dtype=torch.int64) for i in range(n)]
        want = [torch.full((2,), 100 * src + me, dtype=torch.int64) for src in ranks]
        got = [torch.empty(2, dtype=torch.int64) for _ in range(n)]
        dist.all_to_all(got, ins, group=unified)
        bad += [] if all(map(torch.equal, got, want)) else [f"{where} all_to_all"]
        one = torch.empty(2 * n, dtype=torch.int64)
        dist.all_to_all_single(one, torch.cat(ins), group=unified)
        bad += [] if torch.equal(one, torch.cat(want)) else [f"{where} all_to_all_single"]
        if native != "gloo" and rank < 2:  # this rank's device link saw only coalesced p2p
            link = unified.group.native.pg
            if link.single_p2p or not link.batches:
                bad.append(
                    f"{where} device link: {link.single_p2p} single p2p, {link.batches} batches"
                )
    return bad


@pytest.mark.parametrize("native", ["gloo", "fakenccl"])
def test_p2p_batches_reduce_scatter_and_all_to_all_over_unified_backend(native: str) -> None:
    assert run_ranks(p2p_and_scatters, 4, native, timeout=60) == [[]] * 4
