"""The unified communicator as a torch.distributed backend named "unified".

After :func:`register_unified_backend`, ``dist.new_group(ranks, backend="unified")`` returns a
process group whose collectives run on a :class:`UnifiedGroup`, so code written against
torch.distributed (DDP included) runs unchanged over ranks of mixed accelerator types.

torch calls the backend's creator only on the member ranks of the new group, so the creator
cannot call ``dist.new_group`` (that is collective over all ranks). It builds the group's links
straight from the group's store instead: every member walks the same list of links in the same
order and joins those it belongs to, under a store prefix numbered by that order.

Collectives are synchronous (the returned work is already complete). Sends and receives are
asynchronous, so ``dist.isend``/``dist.irecv`` and ``dist.batch_isend_irecv`` work: one over a
gloo link starts at once; one over a device backend's link (same-kind NCCL peers, a direct
bridge) is held until something waits on any held transfer or the group's next operation
starts, and then every held transfer is issued as one coalesced batch (NCCL needs that, or a
ring of sends would deadlock). ``reduce``, ``gather``, ``scatter`` and coalesced collective
variants are not provided. Its links are gloo and NCCL (CUDA and ROCm) only: on a cluster with
Ascend ranks (HCCL) a group made with it fails with one line, and code uses the communicator's
own groups (:meth:`UnifiedCommunicator.new_group`), as the trainer does.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_het.comm.groups import UnifiedGroup
from megatron_het.comm.layout import GroupLayout
from megatron_het.comm.p2p import P2PHandle, P2POp
from megatron_het.comm.pending import device_timeout
from megatron_het.comm.relay import Bridge
from megatron_het.comm.wire import WireHooks
from megatron_het.errors import UserError

BACKEND_NAME = "unified"


class _DoneWork(dist._Work):
    """A finished operation: ``wait()`` returns at once; the future holds ``result``."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class _P2PWork(dist._Work):
    """A send or receive; a held one is issued (with every other held one) on first wait."""

    def __init__(
        self,
        owner: UnifiedProcessGroup,
        tensors: list[torch.Tensor],
        handle: P2PHandle | None = None,
    ) -> None:
        super().__init__()
        self._owner, self._tensors, self._handle = owner, tensors, handle

    def _issued(self) -> P2PHandle:
        if self._handle is None:
            self._owner.flush()
        assert self._handle is not None
        return self._handle

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._issued().wait()
        return True

    def is_completed(self) -> bool:
        return self._issued().is_completed()

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._tensors)
        return future


class UnifiedProcessGroup(dist.ProcessGroup):
    """A ``ProcessGroup`` whose operations run on ``group``; ranks given by torch (roots, peers)
    are group ranks and are mapped to global ranks here."""

    def __init__(self, group: UnifiedGroup) -> None:
        super().__init__(group.rank, group.size)
        self.group = group
        self._held: list[tuple[P2POp, _P2PWork]] = []

    def flush(self) -> None:
        """Issue every held send and receive as one batch (see the module docstring)."""
        if not self._held:
            return
        held, self._held = self._held, []
        handles = self.group.batch_isend_irecv([op for op, _ in held])
        for (_, work), handle in zip(held, handles):
            work._handle = handle

    def _p2p(self, kind: str, tensors: list[torch.Tensor], peer: int, tag: int) -> _P2PWork:
        if len(tensors) != 1:
            raise ValueError(f"the unified backend's {kind} takes one tensor, got {len(tensors)}")
        op = P2POp(kind, tensors[0], self._global(peer), tag)
        if self.group.p2p_link(op.peer).backend == "gloo":
            start = self.group.isend if kind == "isend" else self.group.irecv
            return _P2PWork(self, tensors, start(op.tensor, op.peer, tag))
        work = _P2PWork(self, tensors)
        self._held.append((op, work))
        return work

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def _global(self, group_rank: int) -> int:
        return self.group.ranks[group_rank]

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:
        self.flush()
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for tensor in tensors:
            self.group.all_reduce(tensor, op)
        return _DoneWork(tensors)

    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        self.flush()
        for outputs, tensor in zip(output_lists, inputs):
            self.group.all_gather(outputs, tensor)
        return _DoneWork([t for outputs in output_lists for t in outputs])

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist._Work:
        self.flush()
        self.group.all_gather_into_tensor(output, input)
        return _DoneWork([output])

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist._Work:
        self.flush()
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for output, inputs in zip(outputs, input_lists):
            self.group.reduce_scatter(output, inputs, op)
        return _DoneWork(outputs)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist._Work:
        self.flush()
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        self.group.reduce_scatter_tensor(output, input, op)
        return _DoneWork([output])

    # torch.distributed's tensor-form collectives call these names in recent releases
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:
        return self.allreduce(tensors, opts)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist._Work:
        self.flush()
        n = self.group.size
        outs = output.split(list(output_split_sizes)) if output_split_sizes else output.chunk(n)
        ins = input.split(list(input_split_sizes)) if input_split_sizes else input.chunk(n)
        received = [torch.empty_like(t) for t in outs]
        self.group.all_to_all(received, list(ins))
        for dst, src in zip(outs, received):
            dst.copy_(src)
        return _DoneWork([output])

    # the name torch.distributed's all_to_all_single calls before torch 2.13
    alltoall_base = all_to_all_single

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:
        self.flush()
        root = self._global(opts.rootRank if opts is not None else 0)
        for tensor in tensors:
            self.group.broadcast(tensor, root)
        return _DoneWork(tensors)

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        self.flush()
        self.group.all_to_all(outputs, inputs)
        return _DoneWork(outputs)

    def barrier(self, opts: Any = None) -> dist._Work:
        self.flush()
        self.group.barrier()
        return _DoneWork([])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist._Work:
        return self._p2p("isend", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist._Work:
        return self._p2p("irecv", tensors, src, tag)


# Builds one backend object of ``backend`` for link rank ``rank`` of ``size`` from ``store``.
LinkBuilder = Callable[[Any, int, int, datetime.timedelta, str], Any]


def build_backend(
    store: Any, rank: int, size: int, timeout: datetime.timedelta, backend: str
) -> Any:
    """A gloo or NCCL backend straight from a store (torch's own classes; c10d does not
    register it as a process group, so the links call it directly)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = device_timeout(timeout)  # the backstop (comm/pending.py)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise UserError(
        f"the 'unified' torch.distributed backend cannot build {backend!r} "
        "groups; use UnifiedCommunicator.new_group for this cluster"
    )


class _StoreLinkFactory:
    """Builds links from a group's store on member ranks only (see module docstring)."""

    def __init__(
        self, store: Any, me: int, timeout: datetime.timedelta, builder: LinkBuilder = build_backend
    ) -> None:
        self.store, self.me, self.timeout, self.builder = store, me, timeout, builder
        self.count = 0

    def __call__(self, ranks: tuple[int, ...], backend: str) -> Any:
        self.count += 1
        if self.me not in ranks:
            return None
        store = dist.PrefixStore(f"unified-link{self.count}/", self.store)
        return self.builder(store, ranks.index(self.me), len(ranks), self.timeout, backend)


def register_unified_backend(
    rank_kinds: Sequence[str],
    native_backends: Mapping[str, str],
    bridge: str = "relay",
    debug: bool = False,
    direct_backend: str = "gloo",
    wire_hooks: WireHooks | None = None,
    link_builder: LinkBuilder = build_backend,
) -> None:
    """Register (or re-register) the "unified" backend with torch.distributed.

    ``rank_kinds``/``native_backends`` are those of the communicator; ``bridge``, ``debug``,
    ``direct_backend`` and ``wire_hooks`` apply to every group made with ``backend="unified"``
    (``UnifiedCommunicator.register_torch_backend()`` passes its own). ``link_builder`` makes
    each backend object of a group's links (default :func:`build_backend`). Side effect: an entry in
    torch.distributed's backend registry of this process (torch keeps it globally).
    """
    kinds = tuple(rank_kinds)
    backends = dict(native_backends)
    bridge_obj = Bridge(bridge, direct_backend, wire_hooks)

    def create(opts: Any, _backend_options: Any) -> UnifiedProcessGroup:
        ranks = sorted(opts.global_ranks_in_group) or list(range(len(kinds)))
        me = ranks[opts.group_rank]
        layout = GroupLayout.build(ranks, kinds)
        factory = _StoreLinkFactory(opts.store, me, opts.timeout, link_builder)
        group = UnifiedGroup(
            layout, me, f"{BACKEND_NAME}:{opts.group_id}", bridge_obj, backends, factory, debug
        )
        return UnifiedProcessGroup(group)

    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu", "cuda"])
