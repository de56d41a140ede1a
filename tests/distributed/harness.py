"""The project's multi-process test harness.

``run_ranks(fn, world_size)`` forks ``world_size`` workers on this machine, gives each one thread
and a torch.distributed process group on a free loopback port, runs ``fn(rank, world_size, ...)``
in every worker and returns the per-rank return values. A worker's exception is re-raised in the
parent with the rank and the worker's traceback; a hang is killed at the timeout and reported.

Workers are forked where a forked child can run torch code
(:func:`megatron_het.perf.measure.worker_processes.fork_is_safe`: not once this process has initialised
CUDA, nor on a GPU build of torch with a device visible, where autograd's device threads forbid
it; the test suite hides the GPU outside its GPU session, see tests/conftest.py). Elsewhere they
are spawned, which needs a picklable ``fn`` and arguments; a closure is refused there with an
error that says so.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import pickle
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from megatron_het.perf.measure.worker_processes import free_loopback_port, process_context

# After the first failure, how long the other ranks get to report their own error before they are
# killed (their error often names the real cause, e.g. the peer that hung up).
_GRACE_AFTER_FAILURE_S = 3.0


class RankFailure(RuntimeError):
    """One or more workers raised, died, or did not finish within the timeout."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 free when this ran, below the kernel's ephemeral range."""
    return free_loopback_port()


def _check_spawnable(fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise RuntimeError(
            "a child forked from this process could not run torch code (CUDA is initialised "
            "here, or a GPU is visible to autograd), so run_ranks spawns its workers instead, "
            f"which needs fn and its arguments to be picklable: {exc}. Make "
            f"{getattr(fn, '__qualname__', fn)!r} a module-level function"
        ) from None


def _worker(
    conn: Connection,
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    timeout: float,
    args: tuple,
    kwargs: dict,
) -> None:
    torch.set_num_threads(1)
    status, payload = "ok", None
    try:
        if backend is None:  # fn builds what it needs on the port
            payload = fn(rank, world_size, *args, port=port, **kwargs)
        else:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
            try:
                payload = fn(rank, world_size, *args, **kwargs)
            finally:
                dist.destroy_process_group()
    except BaseException:
        status, payload = "error", traceback.format_exc()
    try:
        # Plain pickle copies tensor storage into the message; multiprocessing's own pickler
        # would pass shared-memory handles that die with this process.
        data = pickle.dumps((status, payload))
    except Exception:
        data = pickle.dumps(("error", f"result could not be pickled:\n{traceback.format_exc()}"))
    conn.send_bytes(data)
    conn.close()
    # Skip the parent's atexit handlers and buffered state inherited through fork.
    os._exit(0)


def _collect(
    procs: list, conns: list[Connection], deadline: float
) -> tuple[dict[int, Any], dict[int, str]]:
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pending = {conn: rank for rank, conn in enumerate(conns)}
    while pending:
        now = time.monotonic()
        if now >= deadline:
            break
        for conn in wait(list(pending), timeout=min(0.2, deadline - now)):
            rank = pending.pop(conn)
            try:
                status, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(timeout=5)  # the pipe closes before the exit status is reaped
                status, payload = (
                    "error",
                    (f"worker exited with code {procs[rank].exitcode} without a result"),
                )
            (results if status == "ok" else errors)[rank] = payload
        if errors:
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
    return results, errors


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60,
    backend: str | None = "gloo",
    start_method: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` forked workers.

    Each worker sets one intra-op thread, then joins a process group of ``backend`` over
    ``tcp://127.0.0.1:<free port>`` whose collective timeout is ``timeout`` seconds, and destroys
    it after ``fn`` returns. ``backend=None`` builds no group: ``fn`` gets the free port as
    keyword ``port`` instead. ``fn`` may be a closure (fork start, nothing is pickled on the way
    in), except where a forked child could not run torch
    (:func:`~megatron_het.perf.measure.worker_processes.fork_is_safe`: CUDA initialised here, or a GPU
    visible to autograd): the workers are spawned then and ``fn`` and its arguments must be
    picklable (RuntimeError before any worker starts otherwise). ``start_method="spawn"``
    spawns them anyway, for code that cannot run in a fork of this process (megatron-core,
    once this process has set up its model-parallel state). Its return value must be
    picklable.

    Returns the return values ordered by rank. Raises :class:`RankFailure` naming every rank that
    raised (with its traceback) or that had not finished after ``timeout`` seconds (those are
    killed).
    """
    # fork where it is safe (it initialises nothing), else spawn
    ctx = multiprocessing.get_context(start_method) if start_method else process_context()
    if ctx.get_start_method() == "spawn":
        _check_spawnable(fn, args, kwargs)
    port = free_port()
    procs, conns = [], []
    # Objects this process no longer reaches may still hold backend groups (a run in this
    # process left a reference cycle). Collected in a forked child, their destructors would
    # wait for backend threads that only exist here: collect them here, and keep the child's
    # collector off everything inherited.
    gc.collect()
    gc.freeze()
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker,
                daemon=True,
                args=(child_conn, fn, rank, world_size, port, backend, timeout, args, kwargs),
            )
            proc.start()
            child_conn.close()
            procs.append(proc)
            conns.append(parent_conn)
    finally:
        gc.unfreeze()
    try:
        results, errors = _collect(procs, conns, time.monotonic() + timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        for conn in conns:
            conn.close()
    missing = [r for r in range(world_size) if r not in results and r not in errors]
    if errors or missing:
        parts = [f"rank {rank} failed:\n{text}" for rank, text in sorted(errors.items())]
        if missing:
            parts.append(f"rank(s) {missing} did not finish within {timeout:g} s and were killed")
        raise RankFailure("\n".join(parts))
    return [results[rank] for rank in range(world_size)]
