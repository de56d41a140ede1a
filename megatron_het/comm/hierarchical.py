"""Collectives over a group that spans accelerator types.

Each function takes the pieces of a mixed :class:`~megatron_het.comm.groups.UnifiedGroup`:
``parts.native`` (this rank's kind inside the group, native backend), ``parts.channel(owners)``
(bridge links between one rank of every kind) and ``parts.flat`` (a bridge link over the whole
group), plus ``parts.bridge`` for host staging.

- all_reduce: reduce-scatter inside each kind (native), then every segment of the buffer is
  reduced across kinds on its own channel; all channels run at once (asynchronous ops on
  separate backend groups), so cross-type traffic is spread over several rank pairs instead of
  one leader. Last, all-gather inside each kind. The three phases are pipelined in chunks: a
  chunk goes onto its channel as soon as the reduce-scatter has finished it, and the
  all-gather sends a chunk as soon as its channel is done with it. Uneven kind sizes use the lcm
  sharding of :mod:`megatron_het.comm.layout`: same three steps, a rank of a smaller kind joins
  several channels. Float sums therefore add in a different order than a flat ring does: results
  match a flat all-reduce to rounding (bitwise for integers and for max/min).
- broadcast: the source sends over its entry channel (one rank of every kind), then each kind
  broadcasts natively from the rank that received it.
- all_gather: with equal kind sizes, gather over the channel of equal local ranks, then gather
  that natively; with uneven sizes it falls back to one flat gather on the bridge. It too
  comes in two parts (``start_all_gather``): the channel gather is started at the call.
- reduce_scatter: the first two phases of the all-reduce, then each rank collects its output
  block from the shards of its own kind's members (native point-to-point).

all_reduce and reduce_scatter come in two parts (``start_*``): the call runs the reduction
inside the kind and starts the cross-kind transfers, which then proceed in the bridge backend's
threads; the returned function finishes the rest. An asynchronous collective of a group calls
the second part in ``wait()`` (see :mod:`megatron_het.comm.async_ops`). Device tensors cross on
host buffers from the bridge's pool, copied on side streams (:mod:`megatron_het.comm.staging`);
the all-reduce's cross-kind pieces are started by the bridge's start queue once their copy to
the host is done (:mod:`megatron_het.comm.start_queue`), so the calling thread never waits for
the device there (a backward hook that starts a bucket's reduction goes straight on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from megatron_het.comm import p2p, ring
from megatron_het.comm.layout import GroupLayout
from megatron_het.comm.links import Link, Work
from megatron_het.comm.relay import Bridge, Staged
from megatron_het.comm.ring import Scratch

SHARD_SLOT, PAD_SLOT = 3, 4  # Scratch slots (ring.py uses 0-2)
RS_TAG = (1 << 30) - 1  # below ring.RING_TAG; never a user's tag in practice


class MixedParts(Protocol):
    """What the algorithms need from a mixed group (a :class:`UnifiedGroup` provides it)."""

    layout: GroupLayout
    me: int
    bridge: Bridge
    native: Link
    flat: Link
    scratch: Scratch

    def channel(self, owners: tuple[int, ...]) -> Link: ...


def start_all_reduce(
    parts: MixedParts, flat: torch.Tensor, op: str, scratch: Scratch
) -> Callable[[], None]:
    """In-place all-reduce of a 1-D contiguous tensor (``op`` in sum/max/min), in two parts:
    this call reduces inside the kind and starts the cross-kind transfers; the returned
    function finishes them, all-gathers inside the kind and leaves the result in ``flat``.

    ``scratch`` holds the padded buffer and the shard until then (one per pending call)."""
    if flat.numel() == 0:
        return lambda: None
    buf = _padded(flat, parts.layout.units, scratch)
    shard, stream = _reduce_shards(parts, buf, op, scratch)

    def finish() -> None:
        if parts.native.size > 1:
            native_all_gather(parts, buf, shard, stream.wait_below)
        stream.wait_below(0, shard.numel())
        if buf is not flat:
            flat.copy_(buf[: flat.numel()])

    return finish


def all_reduce(parts: MixedParts, flat: torch.Tensor, op: str) -> None:
    """In-place all-reduce of a 1-D contiguous tensor (``op`` in sum/max/min)."""
    start_all_reduce(parts, flat, op, parts.scratch)()


def _padded(flat: torch.Tensor, units: int, scratch: Scratch) -> torch.Tensor:
    """``flat`` itself, or a scratch copy padded to a multiple of ``units``; the pad takes
    part in the reduction but is dropped afterwards."""
    numel = flat.numel()
    padded = -(-numel // units) * units
    if padded == numel:
        return flat
    buf = scratch.get(PAD_SLOT, padded, flat)
    buf[:numel].copy_(flat)
    buf[numel:].zero_()
    return buf


def _reduce_shards(
    parts: MixedParts, buf: torch.Tensor, op: str, scratch: Scratch
) -> tuple[torch.Tensor, _ChannelStream]:
    """Reduce-scatter inside the kind, then (streamed) reduce each shard piece across kinds.

    Returns this rank's shard and the stream whose pieces must be waited on before the shard
    holds the reduction over the whole group.
    """
    lay, me = parts.layout, parts.me
    chunk = buf.numel() // lay.units
    u0, u1 = lay.shard_units(me)
    shard = buf[u0 * chunk : u1 * chunk]
    if parts.native.size > 1 and parts.native.backend != "gloo":
        shard = scratch.get(SHARD_SLOT, (u1 - u0) * chunk, buf)
    stream = _ChannelStream(
        parts,
        shard,
        [
            ((seg.start - u0) * chunk, (seg.stop - u0) * chunk, seg.owners)
            for seg in lay.segments()
            if me in seg.owners
        ],
        op,
    )
    if parts.native.size > 1:
        native_reduce_scatter(parts, shard, buf, op, stream.launch_upto)
    stream.launch_upto(shard.numel())
    return shard, stream


class _ChannelStream:
    """The cross-kind phase of the all-reduce, streamed: each piece of this rank's shard goes
    onto its channel as soon as the native reduce-scatter has finished it, and the all-gather
    waits only for the pieces it is about to send. Pieces are cut from each segment by a
    function of the segment length alone, so both ends of a channel cut alike."""

    def __init__(
        self,
        parts: MixedParts,
        shard: torch.Tensor,
        segments: list[tuple[int, int, tuple[int, ...]]],
        op: str,
    ) -> None:
        self.parts, self.shard, self.op = parts, shard, op
        self.pieces = [
            (start + a, start + b, owners)
            for start, stop, owners in segments
            for a, b in ring.chunks(stop - start)
        ]
        self.launched: list[tuple[int, Work, Staged]] = []
        self.done = 0

    def launch_upto(self, ready: int) -> None:
        """Start the channel all-reduce of every piece inside ``shard[:ready]``."""
        while len(self.launched) < len(self.pieces) and self.pieces[len(self.launched)][1] <= ready:
            start, stop, owners = self.pieces[len(self.launched)]
            # The copy to the host is not waited for here: the bridge's start queue starts the
            # transfer once it is done, and this thread goes on queueing device work.
            staged = self.parts.bridge.stage(self.shard[start:stop], wait=False)
            work = self.parts.channel(owners).all_reduce_async(
                staged.host, self.op, name="all_reduce", after=staged.ready
            )
            self.launched.append((start, work, staged))

    def wait_below(self, _start: int, stop: int) -> None:
        """Finish every piece that starts before ``stop``."""
        while self.done < len(self.launched) and self.launched[self.done][0] < stop:
            _, work, staged = self.launched[self.done]
            work.wait()
            staged.finish()  # back to the device (side stream), buffer back to the pool
            self.done += 1


def native_reduce_scatter(
    parts: MixedParts,
    shard: torch.Tensor,
    buf: torch.Tensor,
    op: str,
    on_progress: Callable[[int], None],
) -> None:
    """Reduce-scatter inside this rank's kind (a ring of send/recv on gloo, see ring.py)."""
    if parts.native.backend == "gloo":
        ring.reduce_scatter(parts.native, shard, buf, op, parts.scratch, "all_reduce", on_progress)
    else:
        parts.native.reduce_scatter_tensor(shard, buf, op, name="all_reduce")


def native_all_gather(
    parts: MixedParts,
    buf: torch.Tensor,
    shard: torch.Tensor,
    before_send: Callable[[int, int], None],
) -> None:
    """All-gather inside this rank's kind (a ring of send/recv on gloo, see ring.py)."""
    if parts.native.backend == "gloo":
        ring.all_gather(parts.native, buf, shard, "all_reduce", before_send)
    else:
        before_send(0, shard.numel())
        parts.native.all_gather_tensor(buf, shard, name="all_reduce")


def broadcast(parts: MixedParts, tensor: torch.Tensor, src: int) -> None:
    """In-place broadcast of a contiguous tensor from global rank ``src``."""
    lay, me = parts.layout, parts.me
    channel = lay.entry_channel(lay.local_index(src))
    if me in channel:
        relay_broadcast(parts.channel(channel), parts.bridge, tensor.view(-1), src)
    if parts.native.size > 1:
        parts.native.broadcast(tensor, channel[lay.kind_index(me)])


def relay_broadcast(link: Link, bridge: Bridge, flat: torch.Tensor, src: int) -> None:
    """Broadcast a 1-D tensor on a bridge link, chunk by chunk through host buffers."""
    is_src = link.me == src
    bridge.relay(
        flat,
        ring.chunks(flat.numel()),
        lambda host: link.broadcast_async(host, src),
        copy_in=is_src,
        copy_out=not is_src,
    )


def start_all_gather(
    parts: MixedParts, output: torch.Tensor, input: torch.Tensor
) -> Callable[[], None]:
    """``output`` (1-D, ``size * input.numel()``) receives every rank's ``input`` in group
    order, in two parts: this call starts the gather across kinds (from the bridge's start
    queue once a device input's copy to the host is done); the returned function waits for
    it, gathers inside the kind and places the blocks. ``input`` must stay unchanged until
    then. Uneven kind sizes: one flat gather on the bridge, run here."""
    lay, me = parts.layout, parts.me
    if not lay.even:
        flat_all_gather(parts.flat, parts.bridge, output, input)
        return lambda: None
    per_kind, numel = len(lay.members[0]), input.numel()
    link = parts.channel(lay.entry_channel(lay.local_index(me)))
    bridge = parts.bridge
    staged_in = bridge.stage(input, wait=False)
    # The gather lands in a host buffer; the device copy of it is made only in finish(), so
    # gathers left in flight (--overlap-param-gather) hold no device memory of their own.
    staging = bridge.needs_staging(input)
    pool = bridge.pool(input) if staging else None
    host = (
        pool.acquire(link.size * numel, input.dtype)
        if pool is not None
        else torch.empty(link.size * numel, dtype=input.dtype, device=input.device)
    )
    across = link.run_async(
        lambda: ring.gather_on(link, host, staged_in.host, "all_gather"),
        "all_gather",
        after=staged_in.ready,
    )

    def finish() -> None:
        try:
            across.wait()
        except BaseException:
            if pool is not None:  # the ring has ended (or never started): nothing writes it
                pool.release(host)
            raise
        finally:
            staged_in.release()
        if pool is None:
            gathered = host
        else:
            gathered = torch.empty(link.size * numel, dtype=input.dtype, device=input.device)
            Staged(host, gathered, pool, bridge.copier(input.device), host).finish()
        if parts.native.size > 1:
            everything = torch.empty(
                per_kind * gathered.numel(), dtype=input.dtype, device=input.device
            )
            ring.gather_on(parts.native, everything, gathered, "all_gather")
        else:
            everything = gathered
        blocks = everything.view(per_kind, link.size, numel)
        out = output.view(lay.size, numel)
        for j in range(per_kind):
            for c, rank in enumerate(sorted(lay.entry_channel(j))):
                out[lay.group_rank(rank)].copy_(blocks[j, c])

    return finish


def all_gather(parts: MixedParts, output: torch.Tensor, input: torch.Tensor) -> None:
    """Synchronous :func:`start_all_gather`."""
    start_all_gather(parts, output, input)()


def start_reduce_scatter(
    parts: MixedParts, output: torch.Tensor, input: torch.Tensor, op: str, scratch: Scratch
) -> Callable[[], None]:
    """``input`` (1-D, ``size`` blocks) is reduced over the group; block ``group rank`` lands in
    ``output``. This call runs the first two phases of the all-reduce (the reduction inside the
    kind and the start of the cross-kind one); the returned function finishes them.

    Those phases leave every kind holding the full reduction, cut into its members' shards;
    instead of all-gathering, each member then sends the parts of its shard that fall in
    another member's output block to that member (native p2p)."""
    lay, units, numel = parts.layout, parts.layout.units, input.numel()
    if numel % units == 0 and parts.native.size > 1 and parts.native.backend != "gloo":
        buf = input  # a device backend's reduce-scatter only reads it (into a shard scratch)
    else:  # the gloo ring and a lone member reduce in place: work on a copy
        buf = scratch.get(PAD_SLOT, -(-numel // units) * units, input)
        buf[:numel].copy_(input)
        buf[numel:].zero_()
    shard, stream = _reduce_shards(parts, buf, op, scratch)

    def finish() -> None:
        stream.wait_below(0, shard.numel())
        _exchange_blocks(parts, output, shard, buf.numel() // lay.units)

    return finish


def reduce_scatter(parts: MixedParts, output: torch.Tensor, input: torch.Tensor, op: str) -> None:
    """Synchronous :func:`start_reduce_scatter`."""
    start_reduce_scatter(parts, output, input, op, parts.scratch)()


def _exchange_blocks(
    parts: MixedParts, output: torch.Tensor, shard: torch.Tensor, chunk: int
) -> None:
    """Move the pieces of every member's shard into the member whose output block they are."""
    lay, me, m = parts.layout, parts.me, output.numel()
    members = lay.members[lay.kind_index(me)]

    def span(rank: int) -> tuple[int, int, int, int]:  # shard [s0, s1) and output block [b0, b1)
        u0, u1 = lay.shard_units(rank)
        g = lay.group_rank(rank)
        return u0 * chunk, u1 * chunk, g * m, (g + 1) * m

    s0, s1, b0, b1 = span(me)
    ops = []
    for peer in members:
        p0, p1, q0, q1 = span(peer)
        if peer == me:
            lo, hi = max(s0, b0), min(s1, b1)
            if lo < hi:
                output[lo - b0 : hi - b0].copy_(shard[lo - s0 : hi - s0])
            continue
        lo, hi = max(s0, q0), min(s1, q1)  # my shard inside the peer's block
        if lo < hi:
            ops.append(p2p.P2POp("isend", shard[lo - s0 : hi - s0], peer, RS_TAG))
        lo, hi = max(p0, b0), min(p1, b1)  # the peer's shard inside my block
        if lo < hi:
            ops.append(p2p.P2POp("irecv", output[lo - b0 : hi - b0], peer, RS_TAG))
    for handle in p2p.batch_isend_irecv(parts, ops):
        handle.wait()


def flat_all_gather(link: Link, bridge: Bridge, output: torch.Tensor, input: torch.Tensor) -> None:
    """One all-gather on ``link`` (staged through the host when its backend is gloo)."""
    staged_in = bridge.stage(input)
    staged_out = bridge.stage(output, copy_in=False)
    ring.gather_on(link, staged_out.host, staged_in.host, "all_gather")
    staged_out.finish()
    staged_in.release()


def flat_all_reduce(link: Link, bridge: Bridge, flat: torch.Tensor, op: str) -> None:
    """All-reduce a 1-D tensor on one link, chunk by chunk through host buffers if needed."""
    bridge.relay(flat, ring.chunks(flat.numel()), lambda host: link.all_reduce_async(host, op))


def flat_broadcast(link: Link, bridge: Bridge, tensor: torch.Tensor, src: int) -> None:
    relay_broadcast(link, bridge, tensor.view(-1), src)


def flat_reduce_scatter(
    link: Link, bridge: Bridge, output: torch.Tensor, input: torch.Tensor, op: str, scratch: Scratch
) -> None:
    staged_in = bridge.stage(input)
    staged_out = bridge.stage(output, copy_in=False)
    ring.reduce_scatter_on(link, staged_out.host, staged_in.host, op, scratch, "reduce_scatter")
    staged_out.finish()
    staged_in.release()
