"""The "unified" torch.distributed backend: plain dist.* calls and DDP over mixed groups, a
group whose ranks are not sorted, "unified" as the default backend, and the documented example
under torchrun."""

from __future__ import annotations

import datetime
import pathlib
import re
import shlex
import subprocess
import sys

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


ORDER = [1, 3, 0, 2]  # group rank i is global rank ORDER[i]; the kinds interleave


def unsorted_collectives(g, me: int, x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Every collective on group ``g`` (ranks ``ORDER``), roots and peers given as group ranks;
    returns what each one leaves on this rank."""
    n = len(ORDER)
    blocks = [x + 100 * i for i in range(n)]
    out: dict[str, list[torch.Tensor]] = {}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        out[f"all_reduce {op}"] = [x.clone()]
        dist.all_reduce(out[f"all_reduce {op}"][0], op=op, group=g)
    out["all_gather"] = [torch.zeros_like(x) for _ in ORDER]
    dist.all_gather(out["all_gather"], x, group=g)
    out["all_gather_into_tensor"] = [torch.zeros(n * x.numel(), dtype=x.dtype)]
    dist.all_gather_into_tensor(out["all_gather_into_tensor"][0], x, group=g)
    out["reduce_scatter"] = [torch.zeros_like(x)]
    dist.reduce_scatter(out["reduce_scatter"][0], blocks, group=g)
    out["reduce_scatter_tensor"] = [torch.zeros(x.numel() // n, dtype=x.dtype)]
    dist.reduce_scatter_tensor(out["reduce_scatter_tensor"][0], x, group=g)
    out["all_to_all"] = [torch.zeros_like(x) for _ in ORDER]
    dist.all_to_all(out["all_to_all"], blocks, group=g)
    out["all_to_all_single"] = [torch.zeros_like(x)]
    dist.all_to_all_single(out["all_to_all_single"][0], x, group=g)
    out["broadcast"] = [x.clone()]
    dist.broadcast(out["broadcast"][0], group_src=1, group=g)
    reduced = x.clone()
    dist.reduce(reduced, group_dst=2, group=g)
    out["reduce"] = [reduced] if me == 2 else []
    out["gather"] = [torch.zeros_like(x) for _ in ORDER] if me == 3 else []
    dist.gather(x, out["gather"] if me == 3 else None, group_dst=3, group=g)
    out["scatter"] = [torch.zeros_like(x)]
    dist.scatter(out["scatter"][0], blocks if me == 0 else None, group_src=0, group=g)
    return out


def unsorted_transfers(g, me: int, x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """A ring of batched transfers in group-rank order, and one send/recv by group rank."""
    n = len(ORDER)
    ring = torch.zeros_like(x)
    ops = [
        dist.P2POp(dist.isend, x, group=g, group_peer=(me + 1) % n),
        dist.P2POp(dist.irecv, ring, group=g, group_peer=(me - 1) % n),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    pair = torch.zeros_like(x)
    if me == 0:  # global rank 1 (fast) to group rank 2 (global rank 0, fast)
        dist.send(x, group_dst=2, group=g)
    elif me == 2:
        dist.recv(pair, group_src=0, group=g)
    return {"batch_isend_irecv": [ring], "send/recv": [pair]}


def unsorted_group_ops(rank: int, world_size: int) -> list[str]:
    """``dist.new_group(ORDER, sort_ranks=False)`` over two kinds against a gloo group of the
    same order: every result bitwise, and each rank's identity and kind in the group."""
    kinds = ["fast", "fast", "slow", "slow"]
    register_unified_backend(kinds, {k: "gloo" for k in kinds})
    unified = dist.new_group(ORDER, backend="unified", sort_ranks=False)
    ref = dist.new_group(ORDER, backend="gloo", sort_ranks=False)
    me = ORDER.index(rank)
    bad = []
    if (unified.rank(), unified.group.me) != (me, rank):
        bad.append(f"group rank {unified.rank()}, global rank {unified.group.me}")
    of_my_kind = tuple(r for r in sorted(ORDER) if kinds[r] == kinds[rank])
    if unified.group.native.ranks != of_my_kind:
        bad.append(f"native link {unified.group.native.ranks}, not {of_my_kind}")
    x = torch.arange(4, dtype=torch.int64) * (rank + 1) + 10 * rank
    for run in (unsorted_collectives, unsorted_transfers):
        got, want = run(unified, me, x), run(ref, me, x)
        for name in want:
            if not all(torch.equal(a, b) for a, b in zip(got[name], want[name], strict=True)):
                bad.append(f"{name}: {got[name]} != {want[name]}")
    dist.barrier(group=unified)
    return bad


def test_unsorted_mixed_group_keeps_every_rank_and_kind() -> None:
    assert run_ranks(unsorted_group_ops, 4, timeout=60) == [[]] * 4


def default_world(rank: int, world_size: int, port: int) -> list:
    """``init_process_group("unified")``: the default group spans both kinds."""
    kinds = ["fast", "slow"]
    register_unified_backend(kinds, {k: "gloo" for k in kinds})
    dist.init_process_group(
        "unified",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        x = torch.arange(4) * (rank + 1)
        dist.all_reduce(x)
        gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(gathered, torch.tensor([rank, 10 * rank]))
        dist.barrier()
        return [dist.get_backend(), x, gathered]
    finally:
        dist.destroy_process_group()


def test_unified_as_the_default_backend() -> None:
    results = run_ranks(default_world, 2, backend=None, timeout=60)
    for backend, x, gathered in results:
        assert backend == "unified"
        assert torch.equal(x, torch.arange(4) * 3)
        assert [g.tolist() for g in gathered] == [[0, 0], [1, 10]]


REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = "examples/ddp_mixed_kinds.py"


def documented_command() -> list[str]:
    """The command docs/communicator.md shows for the example, as tokens."""
    page = (REPO / "docs" / "communicator.md").read_text(encoding="utf-8")
    lines = [line for line in page.splitlines() if EXAMPLE in line and "torchrun" in line]
    assert len(lines) == 1, f"docs/communicator.md shows {len(lines)} commands for {EXAMPLE}"
    return shlex.split(lines[0])


@pytest.mark.slow
def test_the_ddp_example_runs_as_the_page_shows() -> None:
    command = documented_command()
    assert command[0] == "torchrun" and command[-1] == EXAMPLE
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    proc = subprocess.run(
        torchrun + command[1:], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    kinds = dict(re.findall(r"^rank (\d): (.+)$", proc.stdout, re.M))
    assert kinds == {"0": "emu-fast (emulated)", "1": "emu-fast (emulated)",
                     "2": "emu-slow (emulated)", "3": "emu-slow (emulated)"}  # fmt: skip
    losses = [float(v) for v in re.findall(r"^step \d: mean loss ([\d.]+)$", proc.stdout, re.M)]
    assert len(losses) == 5 and losses[-1] < losses[0], proc.stdout
