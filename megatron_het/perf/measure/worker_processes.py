"""Running a measurement in worker processes of this host and collecting their results.

The profiler's communicator figures (:mod:`megatron_het.perf.measure.communicator_figures`) and CPU
emulation's host-sharing figures (:mod:`megatron_het.emulation.host_measure`) time code in
forked (or spawned) processes. Each worker reports once through a one-way pipe: ``("ok",
result)`` or ``("error", traceback text)``; :func:`run_measurement_processes` starts them,
waits for the reports and cleans up, and :func:`report_to_parent` is the worker's side.
:func:`gloo_pair` joins two workers into a 2-rank gloo group behind the unified communicator.
:func:`process_context` forks where :func:`fork_is_safe` says so, and spawns elsewhere.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import socket
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

_LOWEST_PORT = 10000
_ENOUGH_PORTS = 1000  # a range of fewer explicit ports than this makes collisions likely


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to sockets bound to port 0 (Linux's
    ip_local_port_range; 32768-60999 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_loopback_port(span: int = 1) -> int:
    """A TCP port P of 127.0.0.1 such that P .. P + span - 1 were all free a moment ago (for a
    rendezvous; a supervisor's relaunch k takes P + k).

    The port is drawn at random below the kernel's ephemeral range. A port the kernel handed
    out for binding port 0 and then released could be handed out again to another process's
    socket (a gloo pair, a store client) before the caller binds it; ports below the range are
    never handed out that way, so only another explicit pick can collide, and random picks
    among some 20,000 ports rarely do. Where the range leaves too few ports below it, they
    are drawn above it; where it leaves too few on either side, the kernel picks (port 0)."""
    import random

    low, high = _ephemeral_range()
    if low - _LOWEST_PORT - span >= _ENOUGH_PORTS:
        first, last = _LOWEST_PORT, low - span
    elif 65536 - (high + 1) - span >= _ENOUGH_PORTS:
        first, last = high + 1, 65536 - span
    else:
        return _kernel_port(span)
    chooser = random.Random()  # seeded from the OS: independent of any seeded global state
    for _ in range(200):
        port = chooser.randrange(first, last)
        if all(_bindable(port + k) for k in range(span)):
            return port
    raise RuntimeError(
        f"no {span} consecutive free TCP ports on 127.0.0.1 in {first}-{last + span - 1}"
    )


def _kernel_port(span: int) -> int:
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port + span <= 65536 and all(_bindable(port + k) for k in range(span)):
            return port
    raise RuntimeError(f"no {span} consecutive free TCP ports on 127.0.0.1")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# The variables that hide every GPU from a process when set to the empty string, before the
# driver is first asked: CUDA's, and ROCm's two (some ROCm releases ignore an empty
# HIP_VISIBLE_DEVICES; an empty ROCR_VISIBLE_DEVICES hides the devices there).
HIDING_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
# Device nodes of a host with an NVIDIA or an AMD GPU (a container given one has them too;
# /dev/dxg: CUDA under WSL2).
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def gpus_hidden(environ: Any | None = None) -> bool:
    """Whether ``environ`` (default this process's) hides every GPU from torch's build: an
    empty ``CUDA_VISIBLE_DEVICES`` on a CUDA build; on a ROCm build an empty
    ``ROCR_VISIBLE_DEVICES``, or empty ``HIP_VISIBLE_DEVICES`` and ``CUDA_VISIBLE_DEVICES``."""
    import torch

    env = os.environ if environ is None else environ
    if torch.version.hip is None:
        return env.get("CUDA_VISIBLE_DEVICES") == ""
    return (
        env.get("ROCR_VISIBLE_DEVICES") == ""
        or env.get("HIP_VISIBLE_DEVICES") == env.get("CUDA_VISIBLE_DEVICES") == ""
    )


def fork_is_safe(environ: Any | None = None) -> bool:
    """Whether a child forked from this process can run torch code: never once this process
    has initialised CUDA (the child could not use it), and not on a torch built for CUDA or
    ROCm with a device visible either. There the first backward pass, even of CPU tensors,
    starts autograd's per-device threads and marks every later fork as unable to run autograd
    ("Unable to handle autograd's threading in combination with fork-based multiprocessing").
    Forking is safe on a CPU-only torch, on a host without GPU device nodes
    (:data:`GPU_DEVICE_NODES`), and with the devices hidden from this process since its start
    (:func:`gpus_hidden`). Initialises nothing itself."""
    import torch

    if torch.cuda.is_initialized():
        return False
    if not torch.backends.cuda.is_built():
        return True
    if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return True
    return gpus_hidden(environ)


def process_context() -> Any:
    """multiprocessing's "fork" context where :func:`fork_is_safe`, else its "spawn" context
    (spawned workers need a module-level target and picklable arguments)."""
    return multiprocessing.get_context("fork" if fork_is_safe() else "spawn")


def run_measurement_processes(
    ctx: Any | None,
    target: Callable[..., None],
    worker_args: Sequence[tuple],
    reporters: int,
    timeout_s: float,
    timeout_message: str,
    failure_message: str,
    join_s: float = 5.0,
    died_message: str | None = None,
) -> list[Any]:
    """Start one daemon process of ``ctx`` (None: :func:`process_context`) per ``worker_args``
    entry, running ``target(*args, conn)``, and return the results of the ``reporters`` first
    ones, in the order they report.

    ``conn`` is the sending end of a pipe for the first ``reporters`` workers and None for the
    others (which must not report). Raises RuntimeError with ``timeout_message`` when a report
    does not come within ``timeout_s`` s, with ``"{failure_message}:\\n{traceback}"`` when a
    worker reports an error, and with ``died_message`` (when given) when the pipe closes before
    a report. Side effects: starts processes; joins them (killing those still alive after
    ``join_s`` s) before returning or raising.
    """
    ctx = ctx if ctx is not None else process_context()
    parent, child = ctx.Pipe(duplex=False)
    workers = [
        ctx.Process(target=target, daemon=True, args=(*args, child if i < reporters else None))
        for i, args in enumerate(worker_args)
    ]
    for w in workers:
        w.start()
    child.close()
    results: list[Any] = []
    try:
        for _ in range(reporters):
            if not parent.poll(timeout_s):
                raise RuntimeError(timeout_message)
            try:
                status, payload = parent.recv()
            except EOFError:
                if died_message is None:
                    raise
                raise RuntimeError(died_message) from None
            if status != "ok":
                raise RuntimeError(f"{failure_message}:\n{payload}")
            results.append(payload)
    finally:
        for w in workers:
            w.join(join_s)
            if w.is_alive():
                w.kill()
                w.join()
    return results


def report_to_parent(conn: Any, measure: Callable[[], Any]) -> None:
    """Run ``measure()`` and send ``("ok", its result)``, or ``("error", the traceback)`` when
    it raises, through ``conn`` (nothing is sent when ``conn`` is None); closes ``conn``."""
    result: tuple[str, Any]
    try:
        result = ("ok", measure())
    except BaseException:
        result = ("error", traceback.format_exc())
    if conn is not None:
        conn.send(result)
        conn.close()


@contextlib.contextmanager
def gloo_pair(rank: int, port: int, timeout_s: float) -> Iterator[Any]:
    """Join a 2-rank gloo process group on ``127.0.0.1:port`` as ``rank`` and yield a
    :class:`~megatron_het.comm.communicator.UnifiedCommunicator` of two "cpu" ranks over it.
    Side effects: initialises the default process group; destroys it on exit."""
    import torch.distributed as dist

    from megatron_het.comm.communicator import UnifiedCommunicator

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        yield UnifiedCommunicator(["cpu", "cpu"], {"cpu": "gloo"}, {"cpu": "cpu"})
    finally:
        dist.destroy_process_group()


__all__ = [
    "free_loopback_port",
    "gloo_pair",
    "process_context",
    "report_to_parent",
    "run_measurement_processes",
]
