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

Operations are synchronous and in place; tensors live on the rank's device. Reduce ops: "sum",
"avg" (floating dtypes), "max", "min", or the matching ``dist.ReduceOp``. Float sums over a mixed
group add in a different order than a flat ring, so they agree with torch.distributed to
rounding; integer results and max/min agree bitwise.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megatron_het.comm import hierarchical as hier
from megatron_het.comm import p2p, ring
from megatron_het.comm.debug import REDUCE_OPS, check_matching
from megatron_het.comm.layout import GroupLayout
from megatron_het.comm.links import Link
from megatron_het.comm.relay import Bridge
from megatron_het.comm.ring import Scratch

# Makes the backend group for ``ranks`` (sorted global ranks) with ``backend``; returns None on
# ranks outside it. Called for every link on every rank that builds the group, in one order.
LinkFactory = Callable[[tuple[int, ...], str], Any]

_REDUCE_OPS = {"sum": "sum", "avg": "avg", "max": "max", "min": "min"}
_DIST_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max",
             dist.ReduceOp.MIN: "min"}


def reduce_op_name(op: Any) -> str:
    """Normalise "sum"/"avg"/"max"/"min" or a ``dist.ReduceOp`` to its name."""
    if isinstance(op, str) and op.lower() in _REDUCE_OPS:
        return op.lower()
    for key, name in _DIST_OPS.items():
        if op == key:
            return name
    raise ValueError(f"unsupported reduce op {op!r}; use one of sum, avg, max, min")


class UnifiedGroup:
    """Ranks ``layout.ranks`` (global, sorted; group rank = position) as one group.

    Made by :meth:`UnifiedCommunicator.new_group` (or by the "unified" torch.distributed
    backend); ``factory`` creates its backend links. A group keeps scratch buffers as large as
    its largest padded all-reduce or reduce-scatter, so repeated calls do not allocate.
    """

    def __init__(self, layout: GroupLayout, me: int, name: str, bridge: Bridge,
                 native_backends: dict[str, str], factory: LinkFactory, debug: bool) -> None:
        self.layout, self.me, self.name, self.bridge, self.debug = layout, me, name, bridge, debug
        self.is_member = me in layout.ranks
        links: dict[tuple[str, tuple[int, ...]], Link] = {}

        def make(label: str, ranks: tuple[int, ...], backend: str) -> None:
            pg = factory(tuple(sorted(ranks)), backend)
            if pg is not None and me in ranks:
                wire = bridge.wire_for(frozenset(layout.kinds[layout.kind_index(r)]
                                                 for r in ranks))
                links[(label, tuple(sorted(ranks)))] = Link(pg, ranks, me, backend, label, name,
                                                            wire)

        make("bridge", layout.ranks, bridge.backend)
        if bridge.backend != "gloo":  # debug descriptors and barriers stay on the host
            make("control", layout.ranks, "gloo")
        for kind, members in zip(layout.kinds, layout.members):
            make(f"native[{kind}]", members, native_backends[kind])
        for owners in layout.channels():
            make("channel", owners, bridge.backend)
        self._links = links
        self.scratch = Scratch()  # reusable buffers of the hierarchical algorithms
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

    def channel(self, owners: tuple[int, ...]) -> Link:
        """The bridge channel over ``owners`` (this rank must be one of them)."""
        return self._links[("channel", tuple(sorted(owners)))]

    def _member(self) -> None:
        if not self.is_member:
            raise ValueError(f"rank {self.me} is not a member of unified group '{self.name}' "
                             f"(ranks {list(self.ranks)})")

    def _check(self, op: str, tensor: torch.Tensor | None, argument: int = 0,
               argument_name: str = "", check_shape: bool = True) -> None:
        self._member()
        if self.debug:
            check_matching(self.control, op, tensor, argument, argument_name, check_shape)

    def _path(self) -> str:
        if not self.is_mixed:
            return "native"
        return "flat" if self.bridge.mode == "direct" else "hierarchical"

    # -- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> None:
        """In-place reduction of ``tensor`` over the group (every rank gets the result)."""
        name = reduce_op_name(op)
        self._check("all_reduce", tensor, REDUCE_OPS.index(name), "op")
        base = "sum" if name == "avg" else name
        _check_avg(name, tensor)
        with _flat_view(tensor) as flat:
            path = self._path()
            if path == "native":
                self.native.all_reduce(flat, base)
            elif path == "flat":
                hier.flat_all_reduce(self.flat, self.bridge, flat, base)
            else:
                hier.all_reduce(self, flat, base)
            if name == "avg":
                flat.div_(self.size)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` (``size * input.numel()`` elements, e.g. ``[size*d0, ...]``) receives every
        rank's ``input`` in group-rank order."""
        self._check("all_gather", input)
        if output.numel() != self.size * input.numel():
            raise ValueError(f"all_gather output has {output.numel()} elements, expected "
                             f"{self.size} x {input.numel()}")
        source = input.contiguous().view(-1)
        with _flat_view(output, copy_in=False) as out:
            path = self._path()
            if path == "native":
                ring.gather_on(self.native, out, source, "all_gather")
            elif path == "flat":
                hier.flat_all_gather(self.flat, self.bridge, out, source)
            else:
                hier.all_gather(self, out, source)

    def all_gather(self, tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor) -> None:
        """``tensor_list[i]`` receives group rank i's ``tensor`` (all the same shape)."""
        out = torch.empty(self.size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        self.all_gather_into_tensor(out, tensor)
        for i, dst in enumerate(tensor_list):
            dst.copy_(out[i * tensor.numel():(i + 1) * tensor.numel()].view(tensor.shape))

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor,
                              op: Any = "sum") -> None:
        """``input`` holds ``size`` blocks shaped like ``output``; block i reduced over the group
        lands in group rank i's ``output``."""
        name = reduce_op_name(op)
        self._check("reduce_scatter", input, REDUCE_OPS.index(name), "op")
        if input.numel() != self.size * output.numel():
            raise ValueError(f"reduce_scatter input has {input.numel()} elements, expected "
                             f"{self.size} x {output.numel()}")
        base = "sum" if name == "avg" else name
        _check_avg(name, input)
        source = input.contiguous().view(-1)
        with _flat_view(output, copy_in=False) as out:
            path = self._path()
            if path == "native":
                ring.reduce_scatter_on(self.native, out, source, base, self.scratch,
                                       "reduce_scatter")
            elif path == "flat":
                hier.flat_reduce_scatter(self.flat, self.bridge, out, source, base,
                                         self.scratch)
            else:
                hier.reduce_scatter(self, out, source, base)
            if name == "avg":
                out.div_(self.size)

    def reduce_scatter(self, output: torch.Tensor, input_list: Sequence[torch.Tensor],
                       op: Any = "sum") -> None:
        """List form of :meth:`reduce_scatter_tensor` (``input_list[i]`` goes to group rank i)."""
        if len(input_list) != self.size:
            raise ValueError(f"reduce_scatter needs {self.size} inputs, got {len(input_list)}")
        self.reduce_scatter_tensor(output, torch.cat([t.reshape(-1) for t in input_list]), op)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In-place broadcast from global rank ``src`` (a member of this group)."""
        self._check("broadcast", tensor, src, "src")
        if src not in self.ranks:
            raise ValueError(f"broadcast source {src} is not in unified group '{self.name}'")
        with _flat_view(tensor, copy_in=self.me == src) as flat:
            path = self._path()
            if path == "native":
                self.native.broadcast(flat, src)
            elif path == "flat":
                hier.flat_broadcast(self.flat, self.bridge, flat, src)
            else:
                hier.broadcast(self, flat, src)

    def all_to_all(self, output_list: Sequence[torch.Tensor],
                   input_list: Sequence[torch.Tensor]) -> None:
        """``output_list[i]`` receives group rank i's ``input_list[my rank]``; shapes may differ
        per pair, so output tensors must be preallocated (and contiguous) with the right size."""
        self._check("all_to_all", input_list[0] if input_list else None, check_shape=False)
        p2p.all_to_all(self, output_list, input_list)

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


class _flat_view:
    """Context manager yielding a 1-D contiguous view of ``tensor``; writes a temporary copy
    back on exit when ``tensor`` is not contiguous."""

    def __init__(self, tensor: torch.Tensor, copy_in: bool = True) -> None:
        self.tensor = tensor
        if tensor.is_contiguous():
            self.flat = tensor.view(-1)
        elif copy_in:
            self.flat = tensor.contiguous().view(-1)
        else:
            self.flat = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)

    def __enter__(self) -> torch.Tensor:
        return self.flat

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None and not self.tensor.is_contiguous():
            self.tensor.copy_(self.flat.view(self.tensor.shape))
