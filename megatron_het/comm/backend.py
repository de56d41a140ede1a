"""The unified communicator as a torch.distributed backend named "unified".

After :func:`register_unified_backend`, ``dist.new_group(ranks, backend="unified")`` (or
``dist.init_process_group("unified")``) returns a process group whose operations run on a
:class:`UnifiedGroup`, so code written against torch.distributed (DDP, its communication hooks,
PowerSGD, ``Join``) runs unchanged over ranks of mixed accelerator types; docs/communicator.md
lists what is supported. torch's object collectives hand the backend CPU tensors, so they run
where the native backends are gloo.

torch calls the backend's creator only on the member ranks of the new group, so the creator
cannot call ``dist.new_group`` (that is collective over all ranks). It builds the group's links
straight from the group's store instead: every member walks the same list of links in the same
order and joins those it belongs to, under a store prefix numbered by that order.

Group ranks are torch's: position in the ``ranks`` given to ``dist.new_group`` (sorted unless
``sort_ranks=False``). The UnifiedGroup numbers its members in sorted order, so lists and blocks
indexed by group rank are reordered here, and roots and peers are mapped to global ranks.

Collectives are synchronous (the returned work is already complete). ``reduce`` runs as an
all-reduce whose result only the root keeps; ``gather`` and ``scatter`` are transfers to and
from the root; PRODUCT and the bitwise reductions gather every rank's tensor and reduce locally;
PREMUL_SUM scales, then sums. Sends and receives are asynchronous, so
``dist.isend``/``dist.irecv`` and ``dist.batch_isend_irecv`` work: one over a gloo link starts
at once; one over a device backend's link (same-kind NCCL peers, a direct bridge) is held until
something waits on any held transfer or the group's next operation starts, and then every held
transfer is issued as one coalesced batch (NCCL needs that, or a ring of sends would deadlock).
A receive from any source is refused (a sender of another kind arrives over another link).
``dist.monitored_barrier`` accepts gloo groups only; ``group.monitored_barrier(timeout,
wait_all_ranks)`` runs it on the group's gloo control link. Its links are gloo and NCCL (CUDA
and ROCm) only: on a cluster with Ascend ranks (HCCL) a group made with it fails with one line,
and code uses the communicator's own groups (:meth:`UnifiedCommunicator.new_group`), as the
trainer does.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

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
_T = TypeVar("_T")
_R = dist.ReduceOp
_GROUP_OPS = {_R.SUM: "sum", _R.AVG: "avg", _R.MAX: "max", _R.MIN: "min"}
# reductions the UnifiedGroup does not run: every rank's tensor is gathered and reduced here
_GATHERED_OPS: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    _R.PRODUCT: torch.mul,
    _R.BAND: torch.bitwise_and,
    _R.BOR: torch.bitwise_or,
    _R.BXOR: torch.bitwise_xor,
}


def _reduce_op(opts: Any) -> tuple[Any, Any]:
    """(the op's type, e.g. ``ReduceOp.SUM``, and the op itself) of an options object."""
    op = opts.reduceOp if opts is not None else _R.SUM
    return getattr(op, "op", op), op


def _refuse(what: str, instead: str) -> UserError:
    return UserError(f"the 'unified' torch.distributed backend cannot {what}; {instead}")


def _completed(result: list[torch.Tensor]) -> torch.futures.Future:
    """A completed future holding ``result``, typed as a tensor list where it has tensors.

    c10d's built-in communication hooks (DDP's FP16 compression) read a work's value as a
    tensor list; a future completed from Python holds an untyped Python object. The function
    behind ``torch.jit.fork`` (called directly: the public name warns that it is deprecated)
    runs a callable at once and types its value; an empty list has no type to infer."""
    fork = getattr(torch._C, "fork", None)
    if result and fork is not None:
        return fork(lambda: result)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return future


class _DoneWork(dist._Work):
    """A finished operation: ``wait()`` returns at once; the future holds ``result``."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._result = result
        self._future = _completed(result)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self._result

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

    def result(self) -> list[torch.Tensor]:
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        self.wait()
        return _completed(self._tensors)


class UnifiedProcessGroup(dist.ProcessGroup):
    """A ``ProcessGroup`` whose operations run on ``group``.

    c10d calls these methods in their list forms (torch's stubs also declare the single-tensor
    overloads, hence the ``type: ignore[override]`` marks).

    ``order`` lists the group's global ranks by torch group rank (``dist.new_group``'s ``ranks``
    as torch keeps them); ``group`` numbers the same ranks in sorted order. Lists and blocks
    that torch indexes by group rank are reordered between the two, and roots and peers given
    by torch (group ranks) are mapped to global ranks.
    """

    def __init__(self, group: UnifiedGroup, order: Sequence[int] | None = None) -> None:
        self.order = tuple(group.ranks if order is None else order)
        if sorted(self.order) != list(group.ranks):
            raise ValueError(f"order {list(self.order)} is not a permutation of {group.ranks}")
        super().__init__(self.order.index(group.me), group.size)  # type: ignore[call-arg]
        self.group = group
        # _by_torch[t]: the UnifiedGroup rank of torch group rank t; _by_group: the inverse
        self._by_torch = [group.ranks.index(r) for r in self.order]
        self._by_group = [self.order.index(r) for r in group.ranks]
        self._sorted = self.order == group.ranks
        self._held: list[tuple[P2POp, _P2PWork]] = []
        self._sequence = 0

    # -- bookkeeping -----------------------------------------------------------------------
    def flush(self) -> None:
        """Issue every held send and receive as one batch (see the module docstring)."""
        if not self._held:
            return
        held, self._held = self._held, []
        handles = self.group.batch_isend_irecv([op for op, _ in held])
        for (_, work), handle in zip(held, handles):
            work._handle = handle

    def _collective(self) -> None:
        """Every collective starts here: held transfers go first; the sequence number counts."""
        self.flush()
        self._sequence += 1

    def _get_sequence_number_for_group(self) -> int:
        return self._sequence

    def _set_sequence_number_for_group(self) -> None:
        return None

    def _global(self, group_rank: int) -> int:
        return self.order[group_rank]

    def _in_group_order(self, items: Sequence[_T]) -> list[_T]:
        """``items`` indexed by torch group rank, reindexed by the UnifiedGroup's ranks."""
        return [items[t] for t in self._by_group]

    def _blocks_in_group_order(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat``'s ``size`` equal blocks (torch group-rank order) in UnifiedGroup order."""
        if self._sorted:
            return flat
        return flat.reshape(self.group.size, -1)[self._by_group].reshape(-1)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # torch names a group after creating it; with no c10d backend inside, the base class
    # would keep the name in one, so it is kept here
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return getattr(self, "_group_desc", "")

    # -- reductions ------------------------------------------------------------------------
    def _all_reduce(self, tensor: torch.Tensor, opts: Any) -> None:
        """In-place all-reduce of ``tensor`` with the reduce op of ``opts`` (None: SUM)."""
        kind, op = _reduce_op(opts)
        if kind == _R.PREMUL_SUM:
            tensor.mul_(op.factor)
            kind = _R.SUM
        if kind in _GROUP_OPS:
            self.group.all_reduce(tensor, _GROUP_OPS[kind])
        elif kind in _GATHERED_OPS:
            n = self.group.size
            blocks = torch.empty(n, tensor.numel(), dtype=tensor.dtype, device=tensor.device)
            self.group.all_gather_into_tensor(blocks, tensor.reshape(-1))
            total = blocks[0]
            for block in blocks[1:]:
                total = _GATHERED_OPS[kind](total, block)
            tensor.copy_(total.view_as(tensor))
        else:
            raise _refuse(f"reduce with {kind}", "use SUM, AVG, MAX, MIN, PRODUCT or a bitwise op")

    def allreduce(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        self._collective()
        for tensor in tensors:
            self._all_reduce(tensor, opts)
        return _DoneWork(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:
        return self.allreduce(tensors, opts)

    def reduce(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        """Runs as an all-reduce; only the root's tensor takes the result."""
        self._collective()
        root = self._global(opts.rootRank if opts is not None else 0)
        for tensor in tensors:
            total = tensor.clone()
            self._all_reduce(total, opts)
            if self.group.me == root:
                tensor.copy_(total)
        return _DoneWork(tensors)

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist._Work:
        self._collective()
        for output, inputs in zip(outputs, input_lists):
            flat = torch.cat([t.reshape(-1) for t in self._in_group_order(inputs)])
            self._reduce_scatter(output, flat, opts)
        return _DoneWork(outputs)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist._Work:
        self._collective()
        self._reduce_scatter(output, self._blocks_in_group_order(input.reshape(-1)), opts)
        return _DoneWork([output])

    def _reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, opts: Any) -> None:
        """``flat``: ``size`` blocks in UnifiedGroup order; this rank's block reduced lands in
        ``output``."""
        kind, _ = _reduce_op(opts)
        if kind in _GROUP_OPS:
            self.group.reduce_scatter_tensor(output, flat, _GROUP_OPS[kind])
            return
        total = flat.clone()  # other reductions: reduce everything, keep this rank's block
        self._all_reduce(total, opts)
        mine = total.view(self.group.size, -1)[self.group.rank]
        output.copy_(mine.view_as(output))

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        for output, input in zip(outputs, inputs):
            self._reduce_scatter_base(output, input, opts)
        return _DoneWork(outputs)

    # torch.distributed's tensor-form collectives call these names in recent releases
    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    # -- gathers and scatters --------------------------------------------------------------
    def allgather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        self._collective()
        for outputs, tensor in zip(output_lists, inputs):
            self.group.all_gather(self._in_group_order(outputs), tensor)
        return _DoneWork([t for outputs in output_lists for t in outputs])

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        """``output_lists[r][i]`` receives group rank r's ``inputs[i]``."""
        self._collective()
        for i, tensor in enumerate(inputs):
            outputs = [per_rank[i] for per_rank in output_lists]
            self.group.all_gather(self._in_group_order(outputs), tensor)
        return _DoneWork([t for outputs in output_lists for t in outputs])

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist._Work:
        self._collective()
        if self._sorted:
            self.group.all_gather_into_tensor(output, input)
        else:
            gathered = torch.empty(output.numel(), dtype=output.dtype, device=output.device)
            self.group.all_gather_into_tensor(gathered, input)
            blocks = gathered.view(self.group.size, -1)[self._by_torch]
            output.copy_(blocks.view_as(output))
        return _DoneWork([output])

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        for output, input in zip(outputs, inputs):
            self._allgather_base(output, input, opts)
        return _DoneWork(outputs)

    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def gather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        """Every rank sends its tensor to the root, which receives one per rank."""
        self._collective()
        root = self._global(opts.rootRank if opts is not None else 0)
        (tensor,) = inputs
        if self.group.me != root:
            self._transfer([P2POp("isend", tensor.contiguous(), root)])
            return _DoneWork([])
        (outputs,) = output_lists
        ops = [P2POp("irecv", out, self._global(t)) for t, out in enumerate(outputs)]
        self._transfer([op for op in ops if op.peer != root])
        outputs[self.order.index(root)].copy_(tensor)
        return _DoneWork(outputs)

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist._Work:
        """The root sends block t of its list to group rank t."""
        self._collective()
        root = self._global(opts.rootRank if opts is not None else 0)
        (output,) = outputs
        if self.group.me != root:
            self._transfer([P2POp("irecv", output, root)])
            return _DoneWork(outputs)
        (inputs,) = input_lists
        ops = [P2POp("isend", t.contiguous(), self._global(i)) for i, t in enumerate(inputs)]
        self._transfer([op for op in ops if op.peer != root])
        output.copy_(inputs[self.order.index(root)])
        return _DoneWork(outputs)

    def _transfer(self, ops: list[P2POp]) -> None:
        """Run ``ops`` to completion; receives into non-contiguous tensors go through a copy."""
        staged = []
        for i, op in enumerate(ops):
            if op.op == "irecv" and not op.tensor.is_contiguous():
                staged.append((op.tensor, i))
                ops[i] = P2POp("irecv", op.tensor.contiguous(), op.peer, op.tag)
        for handle in self.group.batch_isend_irecv(ops):
            handle.wait()
        for target, i in staged:
            target.copy_(ops[i].tensor)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist._Work:
        if not (output.is_contiguous() and input.is_contiguous()):
            raise ValueError("Tensors must be contiguous")
        self._collective()
        n = self.group.size
        outs = output.split(list(output_split_sizes)) if output_split_sizes else output.chunk(n)
        ins = input.split(list(input_split_sizes)) if input_split_sizes else input.chunk(n)
        received = [torch.empty_like(t) for t in outs]
        self.group.all_to_all(self._in_group_order(received), self._in_group_order(list(ins)))
        for dst, src in zip(outs, received):
            dst.copy_(src)
        return _DoneWork([output])

    # the name torch.distributed's all_to_all_single calls before torch 2.13
    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        self._collective()
        self.group.all_to_all(self._in_group_order(outputs), self._in_group_order(inputs))
        return _DoneWork(outputs)

    def broadcast(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> dist._Work:
        self._collective()
        root = self._global(opts.rootRank if opts is not None else 0)
        for tensor in tensors:
            self.group.broadcast(tensor, root)
        return _DoneWork(tensors)

    # -- barriers --------------------------------------------------------------------------
    def barrier(self, opts: Any = None) -> dist._Work:
        self._collective()
        self.group.barrier()
        return _DoneWork([])

    def monitored_barrier(
        self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """gloo's monitored barrier on the group's gloo control link: raises naming the ranks
        (by position in sorted order) that did not arrive within ``timeout``."""
        self.flush()
        link = self.group.control
        if link.backend != "gloo":
            raise _refuse("run a monitored barrier without a gloo link", "use barrier()")
        link.pg.monitored_barrier(timeout or datetime.timedelta(minutes=30), wait_all_ranks)

    # -- point to point --------------------------------------------------------------------
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

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist._Work:
        return self._p2p("isend", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist._Work:
        return self._p2p("irecv", tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist._Work:
        raise _refuse(
            "recv from any source (dist.recv/irecv without src): ranks of another kind "
            "arrive over another link",
            "pass src",
        )


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


def group_order(opts: Any, world_size: int) -> tuple[list[int], int]:
    """The new group's global ranks by torch group rank, and this process's global rank, from
    the options torch passes an extended-API creator (``global_ranks_in_group`` holds the
    ranks as ``dist.new_group`` keeps them, sorted or not; empty for the default group)."""
    order = [int(r) for r in opts.global_ranks_in_group] or list(range(world_size))
    me = order[opts.group_rank]
    if dist.is_initialized() and dist.get_rank() != me:
        raise RuntimeError(f"group rank {opts.group_rank} of {order} is not this rank {me}")
    return order, me


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

    ``rank_kinds`` (one accelerator kind per global rank) and ``native_backends`` (kind ->
    "gloo" or "nccl") are those of the communicator; ``bridge``, ``debug``, ``direct_backend``
    and ``wire_hooks`` apply to every group made with ``backend="unified"``
    (``UnifiedCommunicator.register_torch_backend()`` passes its own). ``link_builder`` makes
    each backend object of a group's links (default :func:`build_backend`). Side effect: an
    entry in torch.distributed's backend registry of this process (torch keeps it globally).
    """
    kinds = tuple(rank_kinds)
    backends = dict(native_backends)
    bridge_obj = Bridge(bridge, direct_backend, wire_hooks)

    def create(opts: Any, _backend_options: Any) -> UnifiedProcessGroup:
        world_size = dist.get_world_size() if dist.is_initialized() else opts.group_size
        if world_size != len(kinds):
            raise UserError(
                f"the 'unified' backend was registered with {len(kinds)} rank kinds for a "
                f"world of {world_size} ranks; pass one kind per rank"
            )
        order, me = group_order(opts, world_size)
        layout = GroupLayout.build(order, kinds)
        factory = _StoreLinkFactory(opts.store, me, opts.timeout, link_builder)
        group = UnifiedGroup(
            layout, me, f"{BACKEND_NAME}:{opts.group_id}", bridge_obj, backends, factory, debug
        )
        return UnifiedProcessGroup(group, order)

    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu", "cuda"])
