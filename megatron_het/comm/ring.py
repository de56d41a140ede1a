"""Reduce-scatter and all-gather as rings of point-to-point transfers, for gloo links.

gloo's own tensor reduce-scatter and all-gather go through per-rank tensor lists and measured
several times slower than its all-reduce of the same data on this project's CPU runs, while its
send/recv move data at close to all-reduce speed. So on gloo links the hierarchical all-reduce
uses these rings instead (nccl/hccl links keep their native collectives).

Ring over ``n`` link ranks; link rank ``r`` sends to ``r+1`` and receives from ``r-1``. The
reduce-scatter takes ``n-1`` steps; in each, the block is cut in chunks that are all posted at
once and combined as they arrive, so reduction overlaps the transfer. Scratch buffers are kept by
the caller (:class:`Scratch`) so repeated calls do not page-fault fresh memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_het.comm.links import Link

# Tags at the top of gloo's tag space, so ring traffic never matches a user's send/recv.
RING_TAG = 1 << 30
CHUNK_ELEMENTS = 1 << 19
_COMBINE: dict[str, Callable[..., torch.Tensor]] = {
    "sum": torch.add,
    "max": torch.maximum,
    "min": torch.minimum,
}


class Scratch:
    """Reusable per-dtype/device buffers (grown on demand, never shrunk)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, slot: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        key = (slot, like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf[:numel]


def chunks(numel: int) -> list[tuple[int, int]]:
    """Cut ``numel`` elements into transfer chunks (at most 64, at least CHUNK_ELEMENTS each)."""
    step = max(CHUNK_ELEMENTS, -(-numel // 64))
    return [(i, min(i + step, numel)) for i in range(0, numel, step)] or [(0, 0)]


def reduce_scatter(
    link: Link,
    output: torch.Tensor,
    input: torch.Tensor,
    op: str,
    scratch: Scratch,
    name: str,
    on_progress: Callable[[int], None] | None = None,
) -> None:
    """``input`` (1-D, ``link.size`` blocks); block ``link.rank`` reduced over the link lands in
    ``output``, which may be that very block of ``input`` (it is only written at the last step,
    element by element from itself). ``on_progress(k)`` is called whenever ``output[:k]`` has
    its final value, so the caller can start the next phase on it. Collective over ``link``."""
    n, r, m = link.size, link.rank, output.numel()
    blocks = input.view(n, m)
    if n == 1:
        output.copy_(blocks[0])
        return
    nxt, prv = link.ranks[(r + 1) % n], link.ranks[(r - 1) % n]
    combine = _COMBINE[op]
    send = blocks[(r - 1) % n]
    for step in range(n - 1):
        recv = scratch.get(0, m, output)
        idx = (r - step - 2) % n
        dest = output if step == n - 2 else scratch.get(1 + step % 2, m, output)
        spans = chunks(m)
        sends = [link.isend(send[a:b], nxt, RING_TAG + i, name) for i, (a, b) in enumerate(spans)]
        recvs = [link.irecv(recv[a:b], prv, RING_TAG + i, name) for i, (a, b) in enumerate(spans)]
        for (a, b), work in zip(spans, recvs):
            work.wait()
            combine(recv[a:b], blocks[idx][a:b], out=dest[a:b])
            if on_progress is not None and step == n - 2:
                on_progress(b)
        for work in sends:
            work.wait()
        send = dest


def all_gather(
    link: Link,
    output: torch.Tensor,
    input: torch.Tensor,
    name: str,
    before_send: Callable[[int, int], None] | None = None,
) -> None:
    """``output`` (1-D, ``link.size`` blocks) receives every link rank's ``input`` in link-rank
    order. ``before_send(a, b)`` is called before ``input[a:b]`` is first sent (the caller may
    still be finishing it). Collective over ``link``."""
    n, r, m = link.size, link.rank, input.numel()
    blocks = output.view(n, m)
    own_block = blocks[r].data_ptr() == input.data_ptr()
    if n == 1:
        if before_send is not None:
            before_send(0, m)
        if not own_block:
            blocks[r].copy_(input)
        return
    nxt, prv = link.ranks[(r + 1) % n], link.ranks[(r - 1) % n]
    spans = chunks(m)
    for step in range(n - 1):
        send, recv = blocks[(r - step) % n], blocks[(r - step - 1) % n]
        works = [link.irecv(recv[a:b], prv, RING_TAG + i, name) for i, (a, b) in enumerate(spans)]
        for i, (a, b) in enumerate(spans):
            if step == 0:
                if before_send is not None:
                    before_send(a, b)
                if not own_block:
                    send[a:b].copy_(input[a:b])
            works.append(link.isend(send[a:b], nxt, RING_TAG + i, name))
        for work in works:
            work.wait()


def gather_on(link: Link, output: torch.Tensor, input: torch.Tensor, name: str) -> None:
    """All-gather on ``link``: the ring on gloo links, the backend's own collective elsewhere."""
    if link.backend == "gloo":
        all_gather(link, output, input, name)
    else:
        link.all_gather_tensor(output, input, name=name)


def reduce_scatter_on(
    link: Link, output: torch.Tensor, input: torch.Tensor, op: str, scratch: Scratch, name: str
) -> None:
    """Reduce-scatter on ``link``: the ring on gloo links, the backend's own elsewhere."""
    if link.backend == "gloo":
        reduce_scatter(link, output, input, op, scratch, name)
    else:
        link.reduce_scatter_tensor(output, input, op, name=name)
