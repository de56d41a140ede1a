"""Every unified-group operation against torch.distributed (gloo) on the same ranks.

One 4-rank launch per cluster shape; inside it, the world group and two subgroups (one single
type, one mixed) run every op x dtype, and each result is compared with the same op run by
torch.distributed on a plain gloo group of the same ranks. Data moves (gather, broadcast,
all-to-all, p2p) and integer/max/min reductions must match bitwise; sums of integer-valued floats
are exact and must match bitwise too; sums of random floats must match to rounding.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from megatron_het.comm.communicator import UnifiedCommunicator
from megatron_het.comm.p2p import P2POp
from tests.distributed.harness import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
SHAPES = ((13,), (3, 5), (2, 520))
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 5e-3}

SHAPES_BY_NAME = {
    "2+2": ["fast", "fast", "slow", "slow"],
    "3+1": ["fast", "fast", "fast", "slow"],
    "1+1+2": ["nv", "amd", "cpu", "cpu"],
    "interleaved 2+2": ["fast", "slow", "fast", "slow"],
}


def data(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Integer-valued data in [-8, 8): exact in every dtype and in every sum of 4 of them."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, shape, generator=gen).to(dtype)


class Checker:
    """Collects mismatches instead of raising, so one launch reports every failure."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []
        self.count = 0

    def equal(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.count += 1
        if got.dtype != want.dtype or got.shape != want.shape:
            self.failures.append(
                f"rank {self.rank}: {what}: got {got.dtype}{list(got.shape)} "
                f"want {want.dtype}{list(want.shape)}"
            )
        elif not torch.equal(got, want):
            at = int((got != want).flatten().nonzero()[0])
            self.failures.append(
                f"rank {self.rank}: {what}: element {at} is "
                f"{got.flatten()[at].item()}, want {want.flatten()[at].item()}"
            )

    def close(self, what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
        self.count += 1
        if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
            err = (got.float() - want.float()).abs().max().item()
            self.failures.append(f"rank {self.rank}: {what}: max error {err}")


def check_reductions(chk: Checker, ug, ref, tag: str) -> None:
    n, me = ug.size, ug.rank
    for dtype in DTYPES:
        for shape in SHAPES:
            for op in ("sum", "avg", "max", "min"):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                x = data(100 * me + len(shape), shape, dtype)
                got, want = x.clone(), x.clone()
                ug.all_reduce(got, op)
                dist.all_reduce(
                    want,
                    dist.ReduceOp.SUM if op == "avg" else getattr(dist.ReduceOp, op.upper()),
                    group=ref,
                )
                if op == "avg":
                    want.div_(n)
                chk.equal(f"{tag} all_reduce {op} {dtype} {shape}", got, want)
            block = data(7 + me, shape, dtype)
            big = data(11 + me, (n * block.numel(),), dtype)
            for op in ("sum", "max"):
                got, want = torch.empty_like(block), torch.empty_like(block)
                before = big.clone()
                ug.reduce_scatter_tensor(got, big.view(n * shape[0], *shape[1:]), op)
                chk.equal(f"{tag} reduce_scatter_tensor {op} leaves its input", big, before)
                dist.reduce_scatter_tensor(
                    want.view(-1), big, getattr(dist.ReduceOp, op.upper()), group=ref
                )
                chk.equal(f"{tag} reduce_scatter_tensor {op} {dtype} {shape}", got, want)
            pieces = list(big.view(n, -1).unbind(0))
            got = torch.empty(block.numel(), dtype=dtype)
            ug.reduce_scatter(got, pieces)
            want = torch.empty_like(got)
            dist.reduce_scatter_tensor(want, big, group=ref)
            chk.equal(f"{tag} reduce_scatter list {dtype} {shape}", got, want)
    # large enough that every phase streams in several chunks (see comm/ring.py)
    for op, dtype in (("sum", torch.float32), ("max", torch.bfloat16)):
        x = data(900 + me, (3 * (1 << 19) + 7,), dtype)
        got, want = x.clone(), x.clone()
        ug.all_reduce(got, op)
        dist.all_reduce(want, getattr(dist.ReduceOp, op.upper()), group=ref)
        chk.equal(f"{tag} all_reduce {op} large {dtype}", got, want)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # random data: rounding only
        gen = torch.Generator().manual_seed(me)
        x = torch.randn(1031, generator=gen).to(dtype)
        got, want = x.clone(), x.clone()
        ug.all_reduce(got)
        dist.all_reduce(want, group=ref)
        chk.close(f"{tag} all_reduce sum random {dtype}", got, want, TOLERANCE[dtype])


def check_moves(chk: Checker, ug, ref, tag: str) -> None:
    n, me = ug.size, ug.rank
    for dtype in DTYPES:
        for shape in SHAPES:
            x = data(31 * me + 5, shape, dtype)
            got = [torch.empty_like(x) for _ in range(n)]
            want = [torch.empty_like(x) for _ in range(n)]
            ug.all_gather(got, x)
            dist.all_gather(want, x, group=ref)
            for i in range(n):
                chk.equal(f"{tag} all_gather list [{i}] {dtype} {shape}", got[i], want[i])
            got_t = torch.empty((n * shape[0],) + shape[1:], dtype=dtype)
            ug.all_gather_into_tensor(got_t, x)
            chk.equal(f"{tag} all_gather_into_tensor {dtype} {shape}", got_t, torch.cat(want))
            for src in ug.ranks:
                got, want = x.clone(), x.clone()
                ug.broadcast(got, src)
                dist.broadcast(want, src, group=ref)
                chk.equal(f"{tag} broadcast src {src} {dtype} {shape}", got, want)
        # all_to_all with a different length for every (sender, receiver) pair
        inputs = [data(1000 * me + i, (1 + me + 2 * i,), dtype) for i in range(n)]
        outputs = [torch.empty(1 + i + 2 * me, dtype=dtype) for i in range(n)]
        ug.all_to_all(outputs, inputs)
        for i in range(n):
            chk.equal(
                f"{tag} all_to_all from {i} {dtype}",
                outputs[i],
                data(1000 * i + me, (1 + i + 2 * me,), dtype),
            )


def check_p2p(chk: Checker, ug, tag: str) -> None:
    ranks, me = ug.ranks, ug.rank
    nxt, prv = ranks[(me + 1) % ug.size], ranks[(me - 1) % ug.size]
    for dtype in DTYPES:
        x = data(500 + me, (37,), dtype)
        got = torch.empty_like(x)
        send, recv = ug.isend(x, nxt), ug.irecv(got, prv)
        while not recv.is_completed():  # polling completes the copy back, like wait()
            time.sleep(0.0005)  # (bounded by the harness timeout)
        send.wait()
        chk.equal(
            f"{tag} isend/irecv ring {dtype}", got, data(500 + (me - 1) % ug.size, (37,), dtype)
        )
        back = torch.empty_like(x)
        ops = [P2POp("irecv", back, nxt, tag=3), P2POp("isend", x, prv, tag=3)]
        for h in ug.batch_isend_irecv(ops):
            h.wait()
        chk.equal(
            f"{tag} batch p2p reverse ring {dtype}",
            back,
            data(500 + (me + 1) % ug.size, (37,), dtype),
        )
    # blocking send/recv between the first and last rank (different kinds in mixed groups)
    first, last = ranks[0], ranks[-1]
    if ug.me == first:
        ug.send(torch.arange(9.0), last)
    elif ug.me == last:
        got = torch.empty(9)
        ug.recv(got, first)
        chk.equal(f"{tag} send/recv {first}->{last}", got, torch.arange(9.0))


def run_shape(
    rank: int, world_size: int, kinds: list[str], bridge: str, subgroups: list[list[int]]
) -> tuple[list[str], int, list[bool]]:
    comm = UnifiedCommunicator(
        kinds,
        {k: "gloo" for k in kinds},
        {k: "cpu" for k in kinds},
        bridge=bridge,
        timeout=datetime.timedelta(seconds=30),
    )
    chk = Checker(rank)
    groups = [(comm.world, dist.new_group(list(range(world_size))))]
    for ranks in subgroups:
        groups.append((comm.new_group(ranks), dist.new_group(ranks)))
    mixed = []
    for ug, ref in groups:
        if rank not in ug.ranks:
            continue
        tag = f"group {list(ug.ranks)}"
        mixed.append(ug.is_mixed)
        check_reductions(chk, ug, ref, tag)
        check_moves(chk, ug, ref, tag)
        check_p2p(chk, ug, tag)
    comm.barrier()
    return chk.failures, chk.count, mixed


@pytest.mark.parametrize("shape", list(SHAPES_BY_NAME))
def test_every_op_matches_torch_distributed(shape: str) -> None:
    kinds = SHAPES_BY_NAME[shape]
    # a single-type subgroup and a mixed subgroup of the same world
    biggest = max(kinds, key=kinds.count)
    single = [r for r in range(4) if kinds[r] == biggest]
    mixed_sub = [0, 3] if kinds[0] != kinds[3] else [0, 1, 3]
    results = run_ranks(run_shape, 4, kinds, "relay", [single, mixed_sub], timeout=60)
    failures = [f for fails, _, _ in results for f in fails]
    assert not failures, "\n".join(failures[:20])
    assert all(count > 200 for _, count, _ in results), [c for _, c, _ in results]
    ran = [m for _, _, mixed in results for m in mixed]
    assert True in ran and False in ran  # both mixed and single-type groups were exercised


def test_direct_bridge_matches_torch_distributed() -> None:
    kinds = SHAPES_BY_NAME["3+1"]
    results = run_ranks(run_shape, 4, kinds, "direct", [[1, 2, 3]], timeout=60)
    failures = [f for fails, _, _ in results for f in fails]
    assert not failures, "\n".join(failures[:20])
