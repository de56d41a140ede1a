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
    return (torch.randn(world_size * MICRO, 8, generator=gen),
            torch.randn(world_size * MICRO, 5, generator=gen))


def ddp_steps(rank: int, world_size: int, kinds: list[str]) -> list[list[torch.Tensor]]:
    register_unified_backend(kinds, {k: "gloo" for k in kinds})
    group = dist.new_group(list(range(world_size)), backend="unified")
    model = make_model()
    # tiny buckets: several all-reduces per step, of uneven sizes
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                    bucket_cap_mb=0.0005)
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
    expect = torch.cat([(torch.arange(6) + 100 * r)[sum(sizes[:mine]):sum(sizes[:mine + 1])]
                        for r in ranks])
    bad += [] if torch.equal(recv, expect) else ["all_to_all_single"]
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
