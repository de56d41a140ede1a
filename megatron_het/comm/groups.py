"""``UnifiedGroup``: a set of ranks, possibly of several accelerator types, acting as one group.

A unified group is made of backend links, created in the same order on every rank:

1. ``flat``: the bridge backend over all its ranks (gloo in relay mode). It carries debug
   descriptors and barriers, the uneven all-gather fallback, cross-type p2p, and, in direct
   mode, every operation of a mixed group. When the direct backend is not gloo, a gloo
   ``control`` link over the same ranks carries the debug descriptors and barriers.
2. one native link per kind present (nccl on NVIDIA and ROCm, hccl on Ascend, gloo on CPU).
3. the bridge channels of :meth:`GroupLayout.channels` (mixed groups only).

A group of a single kind runs every collective on its native link (no bridge). A mixed group
runs the hierarchical algorithms of :mod:`megatron_het.comm.hierarchical` in relay mode.

Operations are in place; tensors live on the rank's device. They are synchronous unless
``async_op=True`` (all_reduce, reduce_scatter_tensor, all_gather_into_tensor), which returns a
handle with ``wait()``/``is_completed()`` (see :mod:`megatron_het.comm.async_ops` for what runs
when on single-kind and mixed groups). Device-backend links (everything but gloo) are connected
when the group is built, so later batches of point-to-point transfers may involve any subset of
the members. Reduce ops: "sum",
"avg" (floating dtypes), "max", "min", or the matching ``dist.ReduceOp``. Float sums over a mixed
group add in a different order than a flat ring, so they agree with torch.distributed to
rounding; integer results and max/min agree bitwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megatron_het.comm import hierarchical as hier
from megatron_het.comm import p2p, ring
from megatron_het.comm.async_ops import DONE, CollectiveHandle, FinishQueue, WorkHandle
from megatron_het.comm.debug import REDUCE_OPS, check_matching
from megatron_het.comm.layout import GroupLayout
from megatron_het.comm.links import Link, Work
from megatron_het.comm.relay import Bridge
from megatron_het.comm.ring import Scratch
from megatron_het.trace.recorder import Recorder

# Makes the backend group for ``ranks`` (sorted global ranks) with ``backend``; returns None on
# ranks outside it. Called for every link on every rank that builds the group, in one order.
LinkFactory = Callable[[tuple[int, ...], str], Any]

_REDUCE_OPS = {"sum": "sum", "avg": "avg", "max": "max", "min": "min"}
_DIST_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
}


def reduce_op_name(op: Any) -> str:
    """Normalise "sum"/"avg"/"max"/"min" or a ``dist.ReduceOp`` to its name."""
    if isinstance(op, str) and op.lower() in _REDUCE_OPS:
        return op.lower()
    for key, name in _DIST_OPS.items():
        if op == key:
            return name
    raise ValueError(f"unsupported reduce op {op!r}; use one of sum, avg, max, min")


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _traced(op: str) -> Callable[[_Method], _Method]:
    """Record each call of a collective as a span of the group's recorder while it records
    (the call's own time: for ``async_op`` its start; see :mod:`megatron_het.trace.recorder`)."""

    def wrap(method: _Method) -> _Method:
        @functools.wraps(method)
        def traced(self: UnifiedGroup, *args: Any, **kwargs: Any) -> Any:
            if not self.recorder.active:
                return method(self, *args, **kwargs)
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            details = {
                "group": self.name,
                "size": self.size,
                "path": "native" if not self.is_mixed else f"bridge ({self._path()})",
                "bytes": max((t.numel() * t.element_size() for t in tensors), default=0),
            }
            name = f"{op} {self.name}"
            if kwargs.get("async_op"):
                details["async"] = True
                with self.recorder.span(f"start {name}", "collective", **details):
                    handle = method(self, *args, **kwargs)
                return _TracedHandle(handle, self.recorder, f"wait {name}", details)
            with self.recorder.span(name, "collective", **details):
                return method(self, *args, **kwargs)

        return traced  # type: ignore[return-value]

    return wrap


class _TracedHandle:
    """An asynchronous collective's handle whose ``wait()`` is recorded as a span (the time
    the caller blocks on the rest of the operation)."""

    def __init__(
        self, handle: CollectiveHandle, recorder: Recorder, name: str, details: dict[str, Any]
    ) -> None:
        self.handle, self.recorder, self.name, self.details = handle, recorder, name, details

    def wait(self) -> None:
        with self.recorder.span(self.name, "collective", **self.details):
            self.handle.wait()

    def is_completed(self) -> bool:
        return self.handle.is_completed()


# Scratch sets a group keeps for its asynchronous hierarchical operations (see _phased).
_SPARE_SCRATCH = 2


class UnifiedGroup:
    """Ranks ``layout.ranks`` (global, sorted; group rank = position) as one group.

    Made by :meth:`UnifiedCommunicator.new_group` (or by the "unified" torch.distributed
    backend); ``factory`` creates its backend links. A group keeps scratch buffers as large as
    its largest padded all-reduce or reduce-scatter, so repeated calls do not allocate.
    ``recorder`` (the communicator's, shared by its groups) records each collective while it
    records.
    """

    def __init__(
        self,
        layout: GroupLayout,
        me: int,
        name: str,
        bridge: Bridge,
        native_backends: dict[str, str],
        factory: LinkFactory,
        debug: bool,
        recorder: Recorder | None = None,
    ) -> None:
        self.layout, self.me, self.name, self.bridge, self.debug = layout, me, name, bridge, debug
        self.recorder = recorder if recorder is not None else Recorder()
        self.is_member = me in layout.ranks
        links: dict[tuple[str, tuple[int, ...]], Link] = {}

        def make(label: str, ranks: tuple[int, ...], backend: str) -> None:
            pg = factory(tuple(sorted(ranks)), backend)
            if pg is not None and me in ranks:
                wire = bridge.wire_for(frozenset(layout.kinds[layout.kind_index(r)] for r in ranks))
                bridged = label in ("bridge", "channel") and bridge.stages
                starts = bridge.starts if bridged else None
                link = Link(pg, ranks, me, backend, label, name, wire, starts)
                if link.is_native_device_link:
                    link.warm_up()  # connect now (collective over the link's members)
                links[(label, tuple(sorted(ranks)))] = link

        make("bridge", layout.ranks, bridge.backend)
        if bridge.backend != "gloo":  # debug descriptors and barriers stay on the host
            make("control", layout.ranks, "gloo")
        for kind, members in zip(layout.kinds, layout.members):
            make(f"native[{kind}]", members, native_backends[kind])
        for owners in layout.channels():
            make("channel", owners, bridge.backend)
        self._links = links
        self.scratch = Scratch()  # reusable buffers of the hierarchical algorithms
        # Scratch lent to pending asynchronous operations and given back after; at most
        # _SPARE_SCRATCH kept (a gradient sync starts every bucket before waiting on any, and
        # keeping one set per bucket would hold another copy of the gradients for good).
        self._spare_scratch: list[Scratch] = []
        self._pending = FinishQueue()
        if self.is_member:
            self.flat = links[("bridge", layout.ranks)]
            self.control = links.get(("control", layout.ranks), self.flat)
            kind = layout.kinds[layout.kind_index(me)]
            members = layout.members[layout.kind_index(me)]
            self.native = links[(f"native[{kind}]", members)]

    # -- facts -------------------------------------------------------------------------------
    @property
    def ranks(self) -> tuple[int, ...]:
        return self.layout.ranks

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def rank(self) -> int:
        """This process's group rank."""
        self._member()
        return self.layout.group_rank(self.me)

    @property
    def is_mixed(self) -> bool:
        return self.layout.is_mixed

    def p2p_link(self, peer: int) -> Link:
        """The link a transfer with global rank ``peer`` goes over (native or bridge)."""
        self._member()
        return p2p.route(self, peer)[0]

    def channel(self, owners: tuple[int, ...]) -> Link:
        """The bridge channel over ``owners`` (this rank must be one of them)."""
        return self._links[("channel", tuple(sorted(owners)))]

    def _member(self) -> None:
        if not self.is_member:
            raise ValueError(
                f"rank {self.me} is not a member of unified group '{self.name}' "
                f"(ranks {list(self.ranks)})"
            )

    def _check(
        self,
        op: str,
        tensor: torch.Tensor | None,
        argument: int = 0,
        argument_name: str = "",
        check_shape: bool = True,
    ) -> None:
        self._member()
        if self.debug:
            check_matching(self.control, op, tensor, argument, argument_name, check_shape)

    def _path(self) -> str:
        if not self.is_mixed:
            return "native"
        return "flat" if self.bridge.mode == "direct" else "hierarchical"

    # -- collectives -------------------------------------------------------------------------
    @_traced("all_reduce")
    def all_reduce(
        self, tensor: torch.Tensor, op: Any = "sum", async_op: bool = False
    ) -> CollectiveHandle | None:
        """In-place reduction of ``tensor`` over the group (every rank gets the result).

        ``async_op``: return a handle at once (the result is in place after ``wait()``)."""
        name = reduce_op_name(op)
        self._check("all_reduce", tensor, REDUCE_OPS.index(name), "op")
        base = "sum" if name == "avg" else name
        _check_avg(name, tensor)
        view = FlatView(tensor)
        flat = view.flat

        def done() -> None:
            if name == "avg":
                flat.div_(self.size)
            view.write_back()

        path = self._path()
        if path == "native":
            return self._native(self.native.all_reduce_async(flat, base, then=done), async_op)
        if path == "hierarchical":
            return self._phased(
                lambda s: hier.start_all_reduce(self, flat, base, s), done, async_op
            )
        hier.flat_all_reduce(self.flat, self.bridge, flat, base)
        done()
        return DONE if async_op else None

    @_traced("all_gather")
    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> CollectiveHandle | None:
        """``output`` (``size * input.numel()`` elements, e.g. ``[size*d0, ...]``) receives every
        rank's ``input`` in group-rank order. ``async_op``: return a handle at once (``input``
        must stay unchanged until ``wait()``); on a mixed group the gather across kinds is
        started and the rest runs in ``wait()`` (with uneven kind sizes it has all run when
        this returns)."""
        self._check("all_gather", input)
        if output.numel() != self.size * input.numel():
            raise ValueError(
                f"all_gather output has {output.numel()} elements, expected "
                f"{self.size} x {input.numel()}"
            )
        source = input.contiguous().view(-1)
        view = FlatView(output, copy_in=False)
        out = view.flat
        path = self._path()
        if path == "native" and (async_op or self.native.backend != "gloo"):
            work = self.native.all_gather_tensor_async(out, source, then=view.write_back)
            return self._native(work, async_op)
        if path == "native":  # gloo: the ring is faster than gloo's own gather (see ring.py)
            ring.all_gather(self.native, out, source, "all_gather")
        elif path == "flat":
            hier.flat_all_gather(self.flat, self.bridge, out, source)
        else:
            return self._phased(
                lambda _: hier.start_all_gather(self, out, source), view.write_back, async_op
            )
        view.write_back()
        return DONE if async_op else None

    def all_gather(self, tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor) -> None:
        """``tensor_list[i]`` receives group rank i's ``tensor`` (all the same shape)."""
        out = torch.empty(self.size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        self.all_gather_into_tensor(out, tensor)
        for i, dst in enumerate(tensor_list):
            dst.copy_(out[i * tensor.numel() : (i + 1) * tensor.numel()].view(tensor.shape))

    @_traced("reduce_scatter")
    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum", async_op: bool = False
    ) -> CollectiveHandle | None:
        """``input`` holds ``size`` blocks shaped like ``output``; block i reduced over the group
        lands in group rank i's ``output``. ``async_op``: return a handle at once."""
        name = reduce_op_name(op)
        self._check("reduce_scatter", input, REDUCE_OPS.index(name), "op")
        if input.numel() != self.size * output.numel():
            raise ValueError(
                f"reduce_scatter input has {input.numel()} elements, expected "
                f"{self.size} x {output.numel()}"
            )
        base = "sum" if name == "avg" else name
        _check_avg(name, input)
        source = input.contiguous().view(-1)
        view = FlatView(output, copy_in=False)
        out = view.flat

        def done() -> None:
            if name == "avg":
                out.div_(self.size)
            view.write_back()

        path = self._path()
        if path == "native" and (async_op or self.native.backend != "gloo"):
            work = self.native.reduce_scatter_tensor_async(out, source, base, then=done)
            return self._native(work, async_op)
        if path == "hierarchical":
            return self._phased(
                lambda s: hier.start_reduce_scatter(self, out, source, base, s), done, async_op
            )
        if path == "native":  # gloo: the ring is faster than gloo's own (see ring.py)
            ring.reduce_scatter(self.native, out, source, base, self.scratch, "reduce_scatter")
        else:
            hier.flat_reduce_scatter(self.flat, self.bridge, out, source, base, self.scratch)
        done()
        return DONE if async_op else None

    def _native(self, work: Work, async_op: bool) -> CollectiveHandle | None:
        if async_op:
            return WorkHandle(work)
        work.wait()
        return None

    def _phased(
        self,
        start: Callable[[Scratch], Callable[[], None]],
        done: Callable[[], None],
        async_op: bool,
    ) -> CollectiveHandle | None:
        """Run a hierarchical collective: ``start(scratch)`` runs its first phases and returns
        its last one. Synchronous calls run both now on the group's scratch; asynchronous ones
        get scratch of their own and finish in ``wait()``, in the order they were started."""
        if not async_op:
            start(self.scratch)()
            done()
            return None
        scratch = self._spare_scratch.pop() if self._spare_scratch else Scratch()
        try:
            finish = start(scratch)
        except BaseException:
            self._spare_scratch.append(scratch)
            raise

        def last_phase() -> None:
            try:
                finish()
                done()
            finally:
                if len(self._spare_scratch) < _SPARE_SCRATCH:
                    self._spare_scratch.append(scratch)

        return self._pending.add(last_phase)

    def wait_all(self) -> None:
        """Finish every asynchronous operation of this group that has not been waited on."""
        self._pending.finish_all()

    def reduce_scatter(
        self, output: torch.Tensor, input_list: Sequence[torch.Tensor], op: Any = "sum"
    ) -> None:
        """List form of :meth:`reduce_scatter_tensor` (``input_list[i]`` goes to group rank i)."""
        if len(input_list) != self.size:
            raise ValueError(f"reduce_scatter needs {self.size} inputs, got {len(input_list)}")
        self.reduce_scatter_tensor(output, torch.cat([t.reshape(-1) for t in input_list]), op)

    @_traced("broadcast")
    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In-place broadcast from global rank ``src`` (a member of this group)."""
        self._check("broadcast", tensor, src, "src")
        if src not in self.ranks:
            raise ValueError(f"broadcast source {src} is not in unified group '{self.name}'")
        view = FlatView(tensor, copy_in=self.me == src)
        path = self._path()
        if path == "native":
            self.native.broadcast(view.flat, src)
        elif path == "flat":
            hier.flat_broadcast(self.flat, self.bridge, view.flat, src)
        else:
            hier.broadcast(self, view.flat, src)
        view.write_back()

    @_traced("all_to_all")
    def all_to_all(
        self, output_list: Sequence[torch.Tensor], input_list: Sequence[torch.Tensor]
    ) -> None:
        """``output_list[i]`` receives group rank i's ``input_list[my rank]``; shapes may differ
        per pair, so output tensors must be preallocated (and contiguous) with the right size."""
        self._check("all_to_all", input_list[0] if input_list else None, check_shape=False)
        p2p.all_to_all(self, output_list, input_list)

    @_traced("barrier")
    def barrier(self) -> None:
        """Returns once every rank of the group has entered it."""
        self._check("barrier", None)
        self.control.barrier()

    # -- point to point (peers are global ranks of this group) -------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> p2p.P2PHandle:
        self._member()
        return p2p.isend(self, tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> p2p.P2PHandle:
        self._member()
        return p2p.irecv(self, tensor, src, tag)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    def batch_isend_irecv(self, ops: Sequence[p2p.P2POp]) -> list[p2p.P2PHandle]:
        self._member()
        return p2p.batch_isend_irecv(self, ops)


def _check_avg(name: str, tensor: torch.Tensor) -> None:
    if name == "avg" and not tensor.is_floating_point():
        raise ValueError(f"reduce op avg needs a floating dtype, got {tensor.dtype}")


class FlatView:
    """A 1-D contiguous view of ``tensor`` (the tensor's own memory when it is contiguous, else
    a temporary, filled from it when ``copy_in``); ``write_back()`` copies a temporary back."""

    def __init__(self, tensor: torch.Tensor, copy_in: bool = True) -> None:
        self.tensor = tensor
        self.is_view = tensor.is_contiguous()
        if self.is_view:
            self.flat = tensor.view(-1)
        elif copy_in:
            self.flat = tensor.contiguous().view(-1)
        else:
            self.flat = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)

    def write_back(self) -> None:
        if not self.is_view:
            self.tensor.copy_(self.flat.view(self.tensor.shape))
