"""Point-to-point transfers between any two ranks of a unified group.

A transfer between ranks of the same kind goes over that kind's native link; a transfer between
kinds goes over the bridge (staged through host memory in relay mode). Sender and receiver pick
the same link because both know every rank's kind. ``all_to_all`` is built from these transfers,
so it accepts uneven block shapes (the receive buffers say how much arrives from whom).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_het.comm.faults import guarded
from megatron_het.comm.layout import GroupLayout
from megatron_het.comm.links import Link, Work
from megatron_het.comm.relay import Bridge


class P2PParts(Protocol):
    layout: GroupLayout
    me: int
    bridge: Bridge
    native: Link
    flat: Link


class P2PHandle:
    """Handle of an ``isend``/``irecv``: ``wait()`` blocks (raising ``CommError`` on failure),
    ``is_completed()`` polls."""

    def __init__(self, work: Work | _AllOf, keep: object = None) -> None:
        self._work = work
        self._keep = keep  # the staged host buffer must outlive the transfer

    def wait(self) -> None:
        self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()


@dataclass
class P2POp:
    """One transfer of a batch: ``op`` is "isend" or "irecv"; ``peer`` is a global rank."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0

    def __post_init__(self) -> None:
        if self.op not in ("isend", "irecv"):
            raise ValueError(f"P2POp op must be 'isend' or 'irecv', got {self.op!r}")


def route(parts: P2PParts, peer: int) -> tuple[Link, bool]:
    """The link to ``peer`` and whether it crosses kinds (and so uses the bridge)."""
    lay = parts.layout
    if peer == parts.me:
        raise ValueError(f"rank {peer} cannot send to or receive from itself")
    if peer not in lay.ranks:
        raise ValueError(f"rank {peer} is not in group {list(lay.ranks)}")
    if lay.kind_index(peer) == lay.kind_index(parts.me):
        return parts.native, False
    return parts.flat, True


def _contiguous(tensor: torch.Tensor, what: str) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{what} needs a contiguous tensor")


def isend(parts: P2PParts, tensor: torch.Tensor, dst: int, tag: int = 0) -> P2PHandle:
    """Start sending ``tensor`` (contiguous, unchanged until ``wait()``) to global rank ``dst``."""
    _contiguous(tensor, "send")
    link, crosses = route(parts, dst)
    if not crosses:
        return P2PHandle(link.isend(tensor, dst, tag, pollable=True))
    # the copy to the host is not waited for here: the bridge's start queue sends once it
    # is done, and this thread goes on queueing device work
    staged = parts.bridge.stage(tensor, wait=False)
    work = link.isend(
        staged.host,
        dst,
        tag,
        then=parts.bridge.then_release(staged),
        pollable=True,
        after=staged.ready,
    )
    return P2PHandle(work, staged)


def irecv(parts: P2PParts, tensor: torch.Tensor, src: int, tag: int = 0) -> P2PHandle:
    """Start receiving into ``tensor`` (contiguous) from global rank ``src``."""
    _contiguous(tensor, "recv")
    link, crosses = route(parts, src)
    if not crosses:
        return P2PHandle(link.irecv(tensor, src, tag, pollable=True))
    staged = parts.bridge.stage(tensor, copy_in=False)
    work = link.irecv(staged.host, src, tag, then=parts.bridge.then_finish(staged), pollable=True)
    return P2PHandle(work, staged)


class _AllOf:
    """Waits on several works (a coalesced batch may return fewer works than ops)."""

    def __init__(self, works: list[Work]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def batch_isend_irecv(parts: P2PParts, ops: Sequence[P2POp]) -> list[P2PHandle]:
    """Start every op of ``ops``; returns one handle per op, in order.

    Transfers on a gloo link are independent, so sends are posted first and receives after.
    Transfers on a device backend's link (NCCL, HCCL: the native link of this rank's kind, or
    a direct bridge) must be issued as one coalesced group per link, or a ring of blocking
    sends would deadlock; those get one shared handle per link.
    """
    starters: dict[str, Callable[..., P2PHandle]] = {"isend": isend, "irecv": irecv}
    handles: list[P2PHandle | None] = [None] * len(ops)
    by_link: dict[int, tuple[Link, list[int]]] = {}
    for i, op in enumerate(ops):
        link, _ = route(parts, op.peer)
        if link.backend != "gloo":
            by_link.setdefault(id(link), (link, []))[1].append(i)
    for link, indices in by_link.values():
        shared = P2PHandle(_AllOf(coalesced(link, [ops[i] for i in indices])))
        for i in indices:
            handles[i] = shared
    order = sorted(
        (i for i in range(len(ops)) if handles[i] is None), key=lambda i: ops[i].op != "isend"
    )
    for i in order:
        op = ops[i]
        handles[i] = starters[op.op](parts, op.tensor, op.peer, op.tag)
    return [h for h in handles if h is not None]


def coalesced(link: Link, ops: Sequence[P2POp]) -> list[Work]:
    """Issue ``ops`` (peers are global ranks) as one coalesced batch on ``link``'s backend.

    Calls the backend object itself (start coalescing, send/recv with link ranks, end), so it
    works on a backend that torch.distributed never registered (the "unified" backend builds
    its links straight from a store) as well as on a ``ProcessGroup``.
    """
    for op in ops:
        _contiguous(op.tensor, op.op)
    if not ops:
        return []
    pg, device = link.pg, ops[0].tensor.device
    is_group = isinstance(pg, dist.ProcessGroup)

    def issue() -> list[Any]:
        if is_group:
            pg._start_coalescing(device)
        else:
            pg._start_coalescing()
        works = []
        for op in ops:
            peer = link.to_group_rank(op.peer)
            call = pg.send if op.op == "isend" else pg.recv
            works.append(call([op.tensor], peer, op.tag))
        end = pg._end_coalescing(device) if is_group else pg._end_coalescing()
        return [end] if end is not None else [w for w in works if w is not None]

    works = guarded(link.group_name, "batch_isend_irecv", link.where, issue)
    return [
        Work(w, link.group_name, "batch_isend_irecv", link.where, device=link.pending_device)
        for w in works
    ]


def all_to_all(
    parts: P2PParts, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], tag: int = 0
) -> None:
    """``outputs[i]`` receives group rank i's ``inputs[my group rank]``; shapes may differ."""
    lay = parts.layout
    if len(outputs) != lay.size or len(inputs) != lay.size:
        raise ValueError(
            f"all_to_all needs {lay.size} input and output tensors, got "
            f"{len(inputs)} and {len(outputs)}"
        )
    mine = lay.group_rank(parts.me)
    ops = []
    for i, rank in enumerate(lay.ranks):
        if i != mine:
            ops.append(P2POp("isend", inputs[i].contiguous(), rank, tag))
            ops.append(P2POp("irecv", outputs[i], rank, tag))
    outputs[mine].copy_(inputs[mine])
    for handle in batch_isend_irecv(parts, ops):
        handle.wait()
