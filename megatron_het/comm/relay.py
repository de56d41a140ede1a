"""The bridge between accelerator types.

Two modes:

- ``relay``: a device tensor is copied into a host buffer (pinned where CUDA is present, so the
  copy is a DMA), moved by the CPU backend (gloo over TCP) and copied back onto the device. Works
  between any two vendors, since only host memory and sockets are involved.
- ``direct``: the site has one backend that spans the vendors (see :mod:`~megatron_het.comm.direct`
  for how it is chosen); tensors go to it unstaged and a mixed group's operations run flat on
  one group of that backend. A direct bridge on gloo still stages device tensors through host
  memory, since gloo moves host memory only.

Host buffers come from a pool per bridge and copies run on side streams
(:mod:`megatron_het.comm.staging`). On CPU ranks staging is free: a contiguous CPU tensor is its
own host buffer, and nothing here touches CUDA on a rank whose tensors are on the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from megatron_het.comm.staging import (
    Copier,
    CudaCopier,
    Fence,
    HostCopier,
    HostPool,
    Marker,
    Waitable,
    relay_chunks,
)
from megatron_het.comm.start_queue import StartQueue
from megatron_het.comm.wire import Wire, WireHooks
from megatron_het.errors import UserError

BRIDGE_MODES = ("relay", "direct")

# Gives the copier of a device (the default: a CudaCopier on CUDA devices, else a HostCopier).
CopierFactory = Callable[[torch.device], Copier]


def default_copier(device: torch.device) -> Copier:
    return CudaCopier(device) if device.type == "cuda" else HostCopier()


class Staged:
    """A host buffer standing in for a device tensor during one transfer.

    ``finish()`` copies received data back to the device (and gives the buffer back);
    ``release()`` gives it back without copying (after a send). Both are no-ops when ``host``
    is the device tensor itself; the buffer goes back to its pool once. ``ready`` is the fence
    of the copy into ``host`` when :meth:`Bridge.stage` was asked not to wait for it (None: the
    host buffer holds the data). ``posted`` marks the device's stream when a receive buffer was
    staged: the copy back waits only for the work queued before it.
    """

    def __init__(
        self,
        host: torch.Tensor,
        device: torch.Tensor,
        pool: HostPool | None = None,
        copier: Copier | None = None,
        lease: torch.Tensor | None = None,
        ready: Fence = None,
        posted: Marker = None,
    ) -> None:
        self.host, self.device, self.ready = host, device, ready
        self._pool, self._copier, self._lease = pool, copier, lease
        self._posted = posted

    def finish(self) -> None:
        if self.host is self.device:
            return
        if self._copier is None:
            self.device.copy_(self.host)
            return
        fence = self._copier.to_device(self.device, self.host, since=self._posted)
        self._copier.join()
        self._give_back(fence)

    def release(self) -> None:
        self._give_back(None)

    def _give_back(self, fence: Callable[[], None] | None) -> None:
        pool, self._pool = self._pool, None
        if pool is not None and self._lease is not None:
            pool.release(self._lease, fence)


class Bridge:
    """How cross-type traffic moves: ``mode`` is "relay" or "direct"; ``backend`` carries it.

    ``wire_hooks`` give the wire that links spanning several kinds book their transfers on (see
    :mod:`megatron_het.comm.wire`; None: no booking). ``copier_for`` makes the copier of a
    device (tests inject recording copiers; default :func:`default_copier`). ``host_only``:
    every kind of the world runs on the CPU, so nothing is staged and transfers go whole.
    ``starts`` starts the bridge links' operations whose host data is still being copied
    (:mod:`megatron_het.comm.start_queue`); the groups give it to every link over this bridge's
    backend.
    """

    def __init__(
        self,
        mode: str,
        backend: str = "gloo",
        wire_hooks: WireHooks | None = None,
        copier_for: CopierFactory | None = None,
        host_only: bool = False,
    ) -> None:
        if mode not in BRIDGE_MODES:
            raise UserError(f"unknown bridge mode {mode!r}; use one of {', '.join(BRIDGE_MODES)}")
        self.mode = mode
        self.backend = backend if mode == "direct" else "gloo"
        self.wire_hooks = wire_hooks
        self.host_only = host_only
        self._copier_for = copier_for or default_copier
        self._copiers: dict[torch.device, Copier] = {}
        self._pools: dict[bool, HostPool] = {}
        self._lock = threading.Lock()
        self.starts = StartQueue()

    def wire_for(self, kinds: frozenset[str]) -> Wire | None:
        """The wire of a backend link over ranks of ``kinds`` (None: none, or a single kind)."""
        if self.wire_hooks is None or len(kinds) < 2:
            return None
        return self.wire_hooks.wire_for(kinds)

    @property
    def stages(self) -> bool:
        """True when cross-type tensors pass through host memory (the bridge backend is gloo)."""
        return self.backend == "gloo"

    def needs_staging(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` must be copied to a host buffer before the bridge backend sees it."""
        return self.stages and not (tensor.device.type == "cpu" and tensor.is_contiguous())

    def pool(self, tensor: torch.Tensor) -> HostPool:
        """The host pool for staging ``tensor`` (pinned only for CUDA tensors)."""
        pin = tensor.device.type == "cuda"
        with self._lock:
            if pin not in self._pools:
                self._pools[pin] = HostPool(pin=pin)
            return self._pools[pin]

    def copier(self, device: torch.device) -> Copier:
        """The copier of ``device`` (one per device, made on first use)."""
        with self._lock:
            if device not in self._copiers:
                self._copiers[device] = self._copier_for(device)
            return self._copiers[device]

    def stage(self, tensor: torch.Tensor, copy_in: bool = True, wait: bool = True) -> Staged:
        """Host buffer for ``tensor`` (the tensor itself when no staging is needed).

        ``copy_in=False`` skips copying the device data in (for receive buffers: nothing queued
        on the device after this call may use ``tensor`` until the transfer is waited for, so
        the copy back waits only for the work queued before this call). The copy in
        has finished when this returns, unless ``wait=False``: then the returned ``ready``
        fence says when (give it to the operation as its ``after``), and the device's stream is
        not ordered after the copy, so ``tensor`` must not be written before the operation has
        been waited for. Call ``finish()`` or ``release()`` when done.
        """
        if not self.needs_staging(tensor):
            return Staged(tensor, tensor)
        pool, copier = self.pool(tensor), self.copier(tensor.device)
        lease = pool.acquire(tensor.numel(), tensor.dtype)
        host = lease.view(tensor.shape)
        fence = copier.to_host(host, tensor) if copy_in else None
        if wait and fence is not None:
            fence()
            fence = None
        return Staged(
            host, tensor, pool, copier, lease, fence, posted=None if copy_in else copier.mark()
        )

    def relay(
        self,
        tensor: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        launch: Callable[[torch.Tensor], Waitable],
        copy_in: bool = True,
        copy_out: bool = True,
    ) -> None:
        """Run the asynchronous in-place transfer ``launch`` over the 1-D contiguous ``tensor``
        and wait.

        When the bridge stages (gloo) and some kind has a device, the transfer is cut into
        ``spans`` on every rank alike (a CPU rank launches them on views of its tensor; a device
        rank pipelines them through host chunks, see
        :func:`~megatron_het.comm.staging.relay_chunks`); otherwise it is one transfer of the
        whole tensor. ``copy_in``/``copy_out``: whether this rank's data goes
        out / the result comes back (False for a broadcast's receivers / its source).
        """
        if not self.stages or self.host_only:  # no rank stages: nothing to pipeline
            launch(tensor).wait()
        elif not self.needs_staging(tensor):
            relay_chunks(tensor, spans, launch, None, HostCopier())
        else:
            relay_chunks(
                tensor,
                spans,
                launch,
                self.pool(tensor),
                self.copier(tensor.device),
                copy_in=copy_in,
                copy_out=copy_out,
            )

    def then_finish(self, staged: Staged) -> Callable[[], None] | None:
        """Callback that copies a staged receive back to the device, or None when not needed."""
        return None if staged.host is staged.device else staged.finish

    def then_release(self, staged: Staged) -> Callable[[], None] | None:
        """Callback that gives a staged send's buffer back, or None when not needed."""
        return None if staged.host is staged.device else staged.release
