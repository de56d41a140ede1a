"""Host staging for the relay bridge: reusable host buffers, side-stream copies, chunk pipeline.

- :class:`HostPool` hands out 1-D host buffers by dtype and size class (powers of two), grown
  as needed and reused across calls; buffers for CUDA tensors are pinned, so copies are DMA.
  A buffer given back with a *fence* (the copy that still reads it) is only handed out again
  after that fence.
- A *copier* moves data between a device tensor and a host buffer. :class:`CudaCopier` copies
  on two side streams of the tensor's device (one per direction, so a device-to-host and a
  host-to-device copy can run at once), ordered after the work already queued on the current
  stream; :class:`HostCopier` copies on the calling thread (CPU tensors, devices without
  streams). Only a rank whose tensors are on a CUDA device ever builds a :class:`CudaCopier`
  or a pinned pool: a CPU rank never creates a CUDA context.
- :func:`relay_chunks` moves a tensor through host memory chunk by chunk, double-buffered:
  the device-to-host copy of chunk i+1 runs while chunk i is on the wire, and the copy of chunk
  i back to the device runs while chunk i+1 is on the wire.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import torch

# Blocks the calling thread until a copy has finished (None: it already has).
Fence = Callable[[], None] | None
# A point in a device's stream (a CUDA event; None: no such point, or a device without streams).
Marker = object | None
MIN_BUFFER_ELEMENTS = 1 << 12
WINDOW = 2  # chunks on the wire at once in relay_chunks


class Waitable(Protocol):
    def wait(self) -> None: ...


class Copier(Protocol):
    """Copies between a device tensor and a host buffer of the same numel and dtype."""

    def to_host(self, host: torch.Tensor, device: torch.Tensor) -> Fence:
        """Start copying ``device`` into ``host``; the fence says when ``host`` holds it."""

    def to_device(self, device: torch.Tensor, host: torch.Tensor, since: Marker = None) -> Fence:
        """Start copying ``host`` into ``device``; the fence says when ``host`` is free again.
        The copy waits for the device work queued before ``since`` (a :meth:`mark`), or, with
        None, for all work queued so far."""

    def mark(self) -> Marker:
        """The point the device's current stream has reached in program order now. A receive
        buffer marked when it is posted need not wait, when its data arrives, for the compute
        queued after it (which never touches it)."""

    def join(self) -> None:
        """Order the device's current stream after every copy to the device issued so far."""


def _run(fence: Fence) -> None:
    if fence is not None:
        fence()


def size_class(numel: int) -> int:
    """The capacity a buffer for ``numel`` elements is allocated with (a power of two)."""
    return max(MIN_BUFFER_ELEMENTS, 1 << max(0, numel - 1).bit_length())


class HostPool:
    """Reusable host buffers; ``pin`` allocates page-locked memory (only for CUDA tensors).

    ``allocate(numel, dtype)`` makes a new buffer (default: ``torch.empty`` on the CPU).
    ``allocated``/``reused`` count how often :meth:`acquire` made or recycled a buffer. Safe to
    share between threads (a bridge serves every group of a communicator). At most
    ``max_free`` free buffers of a dtype are kept (the largest), enough for the pieces of a
    few gradient buckets in flight at once (a 25 MB bucket crosses in about 13), and at most
    ``max_free_bytes`` in all (page-locked memory is the host's, and every rank of a node has
    a pool), the smallest going first but the largest always kept: dropping one first waits
    for the copy still reading it.
    """

    def __init__(
        self,
        pin: bool = False,
        max_free: int = 64,
        max_free_bytes: int = 2 << 30,
        allocate: Callable[[int, torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        self.pin, self.max_free, self.max_free_bytes = pin, max_free, max_free_bytes
        self._allocate = allocate or self._empty
        self._free: dict[torch.dtype, list[tuple[torch.Tensor, Fence]]] = {}
        self._out: dict[int, torch.Tensor] = {}  # id of a handed-out view -> its buffer
        self._lock = threading.Lock()
        self.allocated = self.reused = 0

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pin)

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host tensor of ``numel`` elements (contents undefined) until :meth:`release`."""
        with self._lock:
            free = self._free.setdefault(dtype, [])
            fits = [i for i, (buf, _) in enumerate(free) if buf.numel() >= numel]
            entry = free.pop(min(fits, key=lambda i: free[i][0].numel())) if fits else None
            if entry is not None:
                self.reused += 1
            else:
                self.allocated += 1
        if entry is not None:
            buf, fence = entry
            _run(fence)
        else:
            buf = self._allocate(size_class(numel), dtype)
        view = buf[:numel]
        with self._lock:
            self._out[id(view)] = buf
        return view

    def release(self, view: torch.Tensor, fence: Fence = None) -> None:
        """Give back a buffer from :meth:`acquire`; ``fence`` is a copy still reading it."""
        with self._lock:
            buf = self._out.pop(id(view))
            free = self._free.setdefault(buf.dtype, [])
            free.append((buf, fence))
            dropped = []
            if len(free) > self.max_free:  # keep the largest buffers
                free.sort(key=lambda entry: entry[0].numel())
                dropped.append(free.pop(0))
            dropped += self._over_bytes()
        for entry in dropped:
            _run(entry[1])  # its last copy must finish before the memory goes
        if dropped and self.pin:
            # torch keeps freed page-locked blocks in a cache of its own: once the last
            # references are gone, give them back to the host
            del entry
            dropped.clear()
            release_cached = getattr(torch._C, "_host_emptyCache", None)
            if release_cached is not None:
                release_cached()

    def _over_bytes(self) -> list[tuple[torch.Tensor, Fence]]:
        """Take the smallest free buffers out until at most ``max_free_bytes`` are free or one
        buffer is left (under the lock)."""
        entries = sorted(
            (
                (entry[0].numel() * entry[0].element_size(), dtype, entry)
                for dtype, free in self._free.items()
                for entry in free
            ),
            key=lambda e: e[0],
        )
        total = sum(size for size, _, _ in entries)
        out = []
        for size, dtype, entry in entries[:-1]:
            if total <= self.max_free_bytes:
                break
            self._free[dtype] = [e for e in self._free[dtype] if e is not entry]
            out.append(entry)
            total -= size
        return out

    @property
    def outstanding(self) -> int:
        """Buffers handed out and not given back yet."""
        return len(self._out)


class HostCopier:
    """Copies on the calling thread; every copy has finished when it returns."""

    def to_host(self, host: torch.Tensor, device: torch.Tensor) -> Fence:
        host.copy_(device)
        return None

    def to_device(self, device: torch.Tensor, host: torch.Tensor, since: Marker = None) -> Fence:
        device.copy_(host)
        return None

    def mark(self) -> Marker:
        return None

    def join(self) -> None:
        return None


class CudaCopier:
    """Copies between a CUDA device and pinned host memory on two side streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._to_host = torch.cuda.Stream(device)
        self._to_device = torch.cuda.Stream(device)

    def _copy(
        self,
        stream: torch.cuda.Stream,
        dst: torch.Tensor,
        src: torch.Tensor,
        device_tensor: torch.Tensor,
        since: Marker = None,
    ) -> Fence:
        # Start after what the current stream has queued (it produced or still reads the data),
        # or, for a buffer marked when it was posted, after what was queued before that.
        if since is None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        else:  # a marker handed to this copier is one its own mark() made: a CUDA event
            stream.wait_event(cast(torch.cuda.Event, since))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        device_tensor.record_stream(stream)  # the allocator must not reuse it before the copy
        event = torch.cuda.Event()
        event.record(stream)
        device = self.device

        def fence() -> None:  # on the tensor's device: another thread has none of its own
            with torch.cuda.device(device):
                event.synchronize()

        return fence

    def to_host(self, host: torch.Tensor, device: torch.Tensor) -> Fence:
        return self._copy(self._to_host, host, device, device)

    def to_device(self, device: torch.Tensor, host: torch.Tensor, since: Marker = None) -> Fence:
        return self._copy(self._to_device, device, host, device, since)

    def mark(self) -> Marker:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def join(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self._to_device)


def relay_chunks(
    tensor: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    launch: Callable[[torch.Tensor], Waitable],
    pool: HostPool | None,
    copier: Copier,
    copy_in: bool = True,
    copy_out: bool = True,
    window: int = WINDOW,
) -> None:
    """Run ``launch(host_chunk)`` (an asynchronous transfer in place on the chunk) on every span
    ``[a, b)`` of the 1-D ``tensor``, in span order, staging each chunk through a host buffer.

    ``copy_in`` copies the device data into the chunk first, ``copy_out`` copies the chunk back
    afterwards. At most ``window`` transfers are in flight. ``pool`` None: ``tensor`` is its own
    host memory (a contiguous CPU tensor) and the chunks are views of it, launched at once.
    """
    if pool is None:
        works = [launch(tensor[a:b]) for a, b in spans]
        for work in works:
            work.wait()
        return
    hosts: list[torch.Tensor] = []
    fences: list[Fence] = []

    def copy_chunk_in(i: int) -> None:
        a, b = spans[i]
        hosts.append(pool.acquire(b - a, tensor.dtype))
        fences.append(copier.to_host(hosts[i], tensor[a:b]) if copy_in else None)

    in_flight: list[tuple[int, Waitable]] = []

    def complete_oldest() -> None:
        i, work = in_flight.pop(0)
        work.wait()
        a, b = spans[i]
        fence = copier.to_device(tensor[a:b], hosts[i]) if copy_out else None
        pool.release(hosts[i], fence)

    if spans:
        copy_chunk_in(0)
    for i in range(len(spans)):
        _run(fences[i])
        in_flight.append((i, launch(hosts[i])))
        if i + 1 < len(spans):
            copy_chunk_in(i + 1)  # runs while chunk i is on the wire
        if len(in_flight) >= window:
            complete_oldest()
    while in_flight:
        complete_oldest()
    if copy_out:
        copier.join()


__all__ = ["Copier", "CudaCopier", "Fence", "HostCopier", "HostPool", "relay_chunks", "size_class"]
