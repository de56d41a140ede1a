"""A ``Link``: one backend group (native, bridge or channel) over a fixed set of global ranks.

A link wraps either a ``ProcessGroup`` made by ``dist.new_group`` or a backend object built
straight from a store (the registered ``unified`` backend does that, because it may only talk to
its own members). Both expose the same c10d methods, which the link calls directly with option
objects, so the algorithms above do not care how the link was made. Every call is guarded: a
backend failure becomes a :class:`CommError` naming the unified group, the op and this link.

Peers and roots are given as *global* ranks; the link maps them to its own group ranks (its ranks
are kept sorted, as ``dist.new_group`` orders them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from megatron_het.comm import pending
from megatron_het.comm.faults import CommError, guarded
from megatron_het.comm.start_queue import Fence, StartQueue
from megatron_het.comm.wire import Settle, Wire

# Options structs hold a ReduceOp; the bare enum members convert to one only implicitly.
_NATIVE_OPS = {
    name: dist.ReduceOp(member)
    for name, member in (
        ("sum", dist.ReduceOp.SUM),
        ("max", dist.ReduceOp.MAX),
        ("min", dist.ReduceOp.MIN),
    )
}


class Work:
    """Handle of an asynchronous link operation; ``wait()`` raises a :class:`CommError`.

    ``settle`` (what the link's wire booking returned) runs once the backend has finished, then
    ``then`` (e.g. the copy of a staged receive back to the device). ``device`` (a device
    backend's type, e.g. "cuda") notes the operation in :data:`~megatron_het.comm.pending.
    PENDING` once waited for: such a ``wait()`` returns before the operation completes."""

    def __init__(
        self,
        work: Any,
        group: str,
        op: str,
        where: str,
        then: Callable[[], None] | None = None,
        settle: Settle | None = None,
        watch: bool = False,
        device: str | None = None,
    ) -> None:
        self._work, self._group, self._op, self._where = work, group, op, where
        self._then, self._settle, self._done = then, settle, False
        self._device = device
        self._error: BaseException | None = None
        self._watcher: threading.Thread | None = None
        if watch:  # gloo p2p works report completion only once waited on: wait in a thread
            self._watcher = threading.Thread(target=self._watch, daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        try:
            self._work.wait()
        except BaseException as exc:
            self._error = exc

    def _backend_wait(self) -> None:
        if self._watcher is None:
            self._work.wait()
            return
        self._watcher.join()
        if self._error is not None:
            raise self._error

    def wait(self) -> None:
        """Block until the operation (and any copy back to the device) has finished."""
        if self._done:
            return
        guarded(self._group, self._op, self._where, self._backend_wait)
        if self._device is not None:
            marker = pending.stream_marker(self._device)
            if marker is not None:
                pending.PENDING.add(marker, self._group, self._op, self._where)
        if self._settle is not None:
            self._settle()
        if self._then is not None:
            self._then()
        self._done = True

    def is_completed(self) -> bool:
        """True once finished; completes the copy back to the device when the transfer is done."""
        if not self._done:
            finished = (
                not self._watcher.is_alive()
                if self._watcher is not None
                else self._work.is_completed()
            )
            if finished:
                self.wait()
        return self._done


class Link:
    """A backend group over ``ranks`` (global); ``me`` is this process's global rank.

    ``wire`` (the wire hook, :mod:`megatron_het.comm.wire`) is booked once per operation with
    the bytes this rank moves, counted as a ring would move them: all-reduce 2(n-1)/n of the
    buffer, all-gather and reduce-scatter (n-1)/n of the full buffer, broadcast and p2p the
    buffer.

    ``starts`` (a bridge link's, see :mod:`megatron_het.comm.start_queue`): an operation given
    a fence (``after``, the copy that fills its host buffer) is started from that queue's
    thread once the fence has passed, and any operation of this link that arrives while one
    is queued is queued behind it. Without ``starts`` an operation's fence is waited for at the
    call.
    """

    def __init__(
        self,
        pg: Any,
        ranks: Sequence[int],
        me: int,
        backend: str,
        label: str,
        group_name: str,
        wire: Wire | None = None,
        starts: StartQueue | None = None,
    ) -> None:
        self.pg = pg
        self.ranks = tuple(sorted(ranks))
        self.me = me
        self.backend = backend
        self.label = label
        self.group_name = group_name
        self.wire = wire
        self.size = len(self.ranks)
        self.rank = self.ranks.index(me)
        self.starts = starts

    @property
    def where(self) -> str:
        return f"{self.label} ({self.backend} over ranks {list(self.ranks)})"

    def _start(
        self,
        op: str,
        fn: Callable[[], Any],
        nbytes: float = 0,
        then: Callable[[], None] | None = None,
        direction: str = "tx",
        watch: bool = False,
        after: Fence = None,
    ) -> Work:
        settle = self.wire.book(int(nbytes), direction) if self.wire is not None else None
        starts = self.starts
        if (
            starts is not None
            and not starts.on_worker()
            and (after is not None or starts.broken or starts.busy(self))
        ):
            work = starts.submit(
                after, lambda: guarded(self.group_name, op, self.where, fn), key=self
            )
        else:
            if after is not None:
                after()
            work = guarded(self.group_name, op, self.where, fn)
        return Work(work, self.group_name, op, self.where, then, settle, watch, self.pending_device)

    def _ring_bytes(self, tensor: torch.Tensor, factor: float) -> float:
        return tensor.numel() * tensor.element_size() * factor * (self.size - 1) / self.size

    def to_group_rank(self, rank: int) -> int:
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not in {self.where}")
        return self.ranks.index(rank)

    def run_async(self, job: Callable[[], None], name: str, after: Fence = None) -> Work:
        """Run ``job`` (a whole algorithm of this link's operations, e.g. a ring) as one
        operation: from the start queue's thread once ``after`` has passed, where the link has
        a queue and there is a fence or queued work; else here, now. ``wait()`` returns once
        it has run and raises what it raised."""

        def run() -> _Ran:
            job()
            return _Ran()

        return self._start(name, run, after=after)

    def all_reduce_async(
        self,
        tensor: torch.Tensor,
        op: str,
        name: str = "all_reduce",
        then: Callable[[], None] | None = None,
        after: Fence = None,
    ) -> Work:
        """Start an in-place all-reduce (``op`` in sum/max/min) once ``after`` (the copy that
        fills ``tensor``) has passed; ``then`` runs once it is done."""
        opts = c10d.AllreduceOptions()
        opts.reduceOp = _NATIVE_OPS[op]
        return self._start(
            name,
            lambda: self.pg.allreduce([tensor], opts),
            self._ring_bytes(tensor, 2),
            then,
            after=after,
        )

    def all_reduce(self, tensor: torch.Tensor, op: str, name: str = "all_reduce") -> None:
        self.all_reduce_async(tensor, op, name).wait()

    def reduce_scatter_tensor_async(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str,
        name: str = "reduce_scatter",
        then: Callable[[], None] | None = None,
    ) -> Work:
        """Start: ``input`` holds ``size`` equal blocks; block ``rank`` reduced over the ranks
        lands in ``output``."""
        opts = c10d.ReduceScatterOptions()
        opts.reduceOp = _NATIVE_OPS[op]
        return self._start(
            name,
            lambda: self.pg._reduce_scatter_base(output, input, opts),
            self._ring_bytes(input, 1),
            then,
        )

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: str, name: str = "reduce_scatter"
    ) -> None:
        self.reduce_scatter_tensor_async(output, input, op, name).wait()

    def all_gather_tensor_async(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        name: str = "all_gather",
        then: Callable[[], None] | None = None,
    ) -> Work:
        """Start: ``output`` receives ``size`` blocks shaped like ``input``, in link-rank order."""
        opts = c10d.AllgatherOptions()
        return self._start(
            name,
            lambda: self.pg._allgather_base(output, input, opts),
            self._ring_bytes(output, 1),
            then,
        )

    def all_gather_tensor(
        self, output: torch.Tensor, input: torch.Tensor, name: str = "all_gather"
    ) -> None:
        self.all_gather_tensor_async(output, input, name).wait()

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str = "broadcast") -> Work:
        """Start a broadcast in place from global rank ``root``."""
        opts = c10d.BroadcastOptions()
        opts.rootRank = self.to_group_rank(root)
        opts.rootTensor = 0
        return self._start(
            name, lambda: self.pg.broadcast([tensor], opts), tensor.numel() * tensor.element_size()
        )

    def broadcast(self, tensor: torch.Tensor, root: int, name: str = "broadcast") -> None:
        self.broadcast_async(tensor, root, name).wait()

    @property
    def is_native_device_link(self) -> bool:
        """True for a device backend (nccl, hccl, ...): everything but gloo."""
        return self.backend != "gloo"

    @property
    def pending_device(self) -> str | None:
        """The device type whose waits on this link are noted as pending operations
        (:mod:`megatron_het.comm.pending`): a device backend's; None for gloo."""
        return _device_type(self.backend) if self.is_native_device_link else None

    def warm_up(self) -> None:
        """Initialise the backend's communicator now, with one tiny all-reduce on this rank's
        device (collective over the link). Device backends such as NCCL otherwise create it on
        the first operation, for the whole link: a batch of point-to-point transfers that not
        every member joins would then hang."""
        self.all_reduce(torch.zeros(1, device=_device_of(self.backend)), "sum", "connect")

    def barrier(self, name: str = "barrier") -> None:
        if self.backend == "gloo":
            self._start(name, lambda: self.pg.barrier(c10d.BarrierOptions())).wait()
        else:  # a one-element all-reduce works on every backend without a device id
            self.all_reduce(torch.zeros(1, device=_device_of(self.backend)), "sum", name)

    def isend(
        self,
        tensor: torch.Tensor,
        dst: int,
        tag: int,
        name: str = "send",
        pollable: bool = False,
        then: Callable[[], None] | None = None,
        after: Fence = None,
    ) -> Work:
        """Start sending to global rank ``dst`` once ``after`` (the copy that fills ``tensor``)
        has passed; ``then`` runs once it has gone. ``pollable`` makes ``is_completed()`` work
        on gloo (a watcher thread per transfer; internal rings leave it off)."""
        peer = self.to_group_rank(dst)
        return self._start(
            f"{name} to rank {dst}",
            lambda: self.pg.send([tensor], peer, tag),
            tensor.numel() * tensor.element_size(),
            then,
            watch=pollable and self.backend == "gloo",
            after=after,
        )

    def irecv(
        self,
        tensor: torch.Tensor,
        src: int,
        tag: int,
        name: str = "recv",
        then: Callable[[], None] | None = None,
        pollable: bool = False,
    ) -> Work:
        """Start receiving from global rank ``src``; ``then`` runs once the data is in."""
        peer = self.to_group_rank(src)
        return self._start(
            f"{name} from rank {src}",
            lambda: self.pg.recv([tensor], peer, tag),
            tensor.numel() * tensor.element_size(),
            then,
            direction="rx",
            watch=pollable and self.backend == "gloo",
        )


class _Ran:
    """The backend work of a job that has already run to its end."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _device_type(backend: str) -> str:
    """The device type a backend's tensors live on."""
    return {"nccl": "cuda", "hccl": "npu"}.get(backend, "cpu")


def _device_of(backend: str) -> torch.device:
    kind = _device_type(backend)
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


__all__ = ["Link", "Work", "CommError"]
