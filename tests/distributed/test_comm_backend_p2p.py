"""Point-to-point and group scenarios of torch's Python process-group tests, written afresh.

Run by test_comm_backend_torch.py over gloo and over "unified" on 2 and 4 ranks of two kinds
(see there): transfers blocking, tagged, batched and from any source; objects sent and
received; groups with ``sort_ranks=False``, ``use_local_synchronization``, ``new_subgroups``,
destroyed and made again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from tests.distributed.test_comm_backend_torch import Ctx


# -- point to point --------------------------------------------------------------------------
def send_recv_ring(ctx: Ctx) -> Any:
    n, r = ctx.world_size, ctx.rank
    got = torch.zeros(5, dtype=torch.int64)
    if r % 2 == 0:
        dist.send(ctx.ints(5), (r + 1) % n, group=ctx.world)
        dist.recv(got, (r - 1) % n, group=ctx.world)
    else:
        dist.recv(got, (r - 1) % n, group=ctx.world)
        dist.send(ctx.ints(5), (r + 1) % n, group=ctx.world)
    return got


def isend_irecv_tags(ctx: Ctx) -> Any:
    """Two messages to the same peer, received in the other order by tag."""
    n, r = ctx.world_size, ctx.rank
    a, b = torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    sends = [
        dist.isend(ctx.ints(3), (r + 1) % n, group=ctx.world, tag=1),
        dist.isend(ctx.ints(4, offset=50), (r + 1) % n, group=ctx.world, tag=2),
    ]
    recvs = [
        dist.irecv(b, (r - 1) % n, group=ctx.world, tag=2),
        dist.irecv(a, (r - 1) % n, group=ctx.world, tag=1),
    ]
    for work in sends + recvs:
        work.wait()
    return a, b


def send_to_self(ctx: Ctx) -> Any:
    return ctx.outcome(lambda: dist.send(torch.zeros(2), ctx.rank, group=ctx.world))


def recv_any_source(ctx: Ctx) -> Any:
    """Rank 0 posts a receive from any rank, then rank k sends (k = 1, 2, ...); a sender
    sends only once rank 0's receive was accepted (told over the harness's world)."""
    got, senders = torch.zeros(3, dtype=torch.int64), []
    for turn in range(1, ctx.world_size):
        work, refused = None, None
        if ctx.rank == 0:
            try:
                work = dist.irecv(got, group=ctx.world)  # no src: from any rank
            except Exception as exc:
                refused = exc
        accepted = torch.tensor([refused is None])
        dist.broadcast(accepted, 0)
        if refused is not None:
            raise refused
        if not accepted.item():
            return None
        if ctx.rank == turn:
            dist.send(ctx.ints(3), 0, group=ctx.world)
        if work is not None:
            work.wait()
            senders.append((work._source_rank(), got.clone()))
    return senders


def batch_isend_irecv(ctx: Ctx) -> Any:
    n, r = ctx.world_size, ctx.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    from_prv, from_nxt = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    ops = [
        dist.P2POp(dist.irecv, from_prv, prv, ctx.world),
        dist.P2POp(dist.isend, ctx.ints(4), nxt, ctx.world),
        dist.P2POp(dist.isend, ctx.ints(4, offset=7), prv, ctx.world),
        dist.P2POp(dist.irecv, from_nxt, nxt, ctx.world),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return from_prv, from_nxt


def object_send_recv(ctx: Ctx) -> Any:
    objs: list[Any] = [None, None]
    last = ctx.world_size - 1
    if ctx.rank == 0:
        dist.send_object_list([{"a": 1}, [ctx.rank, "b"]], dst=last, group=ctx.world)
    elif ctx.rank == last:
        dist.recv_object_list(objs, src=0, group=ctx.world)
    return objs


# -- groups ----------------------------------------------------------------------------------
def new_group_ordered(ctx: Ctx) -> Any:
    """``sort_ranks=False``: group rank i is ``ranks[i]``, for ops and for peers."""
    order = list(reversed(range(ctx.world_size)))
    group = ctx.group(order, sort_ranks=False)
    me = order.index(ctx.rank)
    out = [torch.zeros(2, dtype=torch.int64) for _ in order]
    dist.all_gather(out, ctx.ints(2), group=group)
    bcast = ctx.ints(3)
    dist.broadcast(bcast, group_src=0, group=group)
    got = torch.zeros(2, dtype=torch.int64)
    ops = [
        dist.P2POp(dist.isend, ctx.ints(2), group=group, group_peer=(me + 1) % len(order)),
        dist.P2POp(dist.irecv, got, group=group, group_peer=(me - 1) % len(order)),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    ranks = (
        dist.get_group_rank(group, ctx.rank),
        dist.get_process_group_ranks(group),
        group.rank(),
    )
    return ranks, out, bcast, got


def new_group_local_sync(ctx: Ctx) -> Any:
    """Two disjoint pairs made with ``use_local_synchronization``, twice each."""
    n, r = ctx.world_size, ctx.rank
    pair = sorted({r, (r + n // 2) % n})
    out = []
    for _ in range(2):
        group = ctx.group(pair, use_local_synchronization=True)
        got = [torch.zeros(2, dtype=torch.int64) for _ in pair]
        dist.all_gather(got, torch.tensor([pair[0], r]), group=group)
        out.append((dist.get_group_rank(group, r), got))
    dist.barrier()  # the default group: both pairs are done before the next scenario
    return out


def subgroups(ctx: Ctx) -> Any:
    """Every pair of neighbours (``new_subgroups``) and a group of one kind."""
    mine, _ = dist.new_subgroups(group_size=2, backend=ctx.backend)
    ctx.made.append(mine)
    x = ctx.ints(3)
    dist.all_reduce(x, group=mine)
    first = ctx.group(list(range(ctx.world_size // 2 or 1)))
    y = ctx.ints(3)
    if ctx.rank < max(1, ctx.world_size // 2):
        dist.all_reduce(y, group=first)
    return x, y


def destroy_and_recreate(ctx: Ctx) -> Any:
    out = []
    for _ in range(2):
        group = dist.new_group(list(range(ctx.world_size)), backend=ctx.backend)
        x = ctx.ints(3)
        dist.all_reduce(x, group=group)
        dist.destroy_process_group(group)
        out.append(x)
    return out


P2P_SCENARIOS: list[Callable[[Ctx], Any]] = [
    send_recv_ring,
    isend_irecv_tags,
    send_to_self,
    recv_any_source,
    batch_isend_irecv,
    object_send_recv,
    new_group_ordered,
    new_group_local_sync,
    subgroups,
    destroy_and_recreate,
]
