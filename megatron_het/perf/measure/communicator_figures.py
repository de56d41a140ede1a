"""The communicator's figures of this host for a profile: p2p and all-reduce between two local
gloo ranks, fitted to ``time = latency + bytes / bandwidth`` (:func:`measure_comm`, called by
:func:`megatron_het.perf.measure.profiler.profile_device` with ``comm=True``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from megatron_het.perf.measure.profile_format import CommEntry
from megatron_het.perf.measure.worker_processes import (
    free_loopback_port,
    gloo_pair,
    process_context,
    report_to_parent,
    run_measurement_processes,
)

# 1 KiB .. 16 MiB. The bandwidth is fitted through the largest message, so it should be as
# large as the buffers the figures price most: a DP gradient sync moves the whole model's
# gradients, which outgrow the caches (on a 2-core host gloo moved 4 MiB at 2-3.5 GB/s but
# 16-32 MiB at 1-1.3 GB/s, the figure a 20 MB ZeRO sync then ran at).
COMM_SIZES = tuple(4**k * 1024 for k in range(8))


def measure_comm(
    sizes: tuple[int, ...] = COMM_SIZES, warmup: int = 2, iters: int = 5, timeout_s: float = 120.0
) -> tuple[CommEntry, ...]:
    """p2p and all-reduce figures of the communicator between 2 gloo ranks on this host.

    Starts two worker processes (one thread each) on a free loopback port; each builds a
    :class:`~megatron_het.comm.communicator.UnifiedCommunicator` of two "cpu" ranks. p2p is
    timed as half a ping-pong, the all-reduce directly (median over ``iters``, per message
    size in bytes). ``time = latency + bytes / bandwidth`` is fitted to p2p and ``time =
    2 latency + bytes / bandwidth`` to the all-reduce (the predictor's 2-rank ring), through
    the smallest and the largest size. Returned with link kind "intra_node".
    """
    port = free_loopback_port()
    ((p2p, reduce),) = run_measurement_processes(
        process_context(),
        _comm_worker,
        [(rank, port, sizes, warmup, iters, timeout_s) for rank in range(2)],
        1,
        timeout_s,
        f"the communicator measurement did not finish in {timeout_s} s",
        "communicator measurement failed",
        died_message="a communicator measurement worker died before reporting",
    )
    entries = []
    for op, times, latencies in (("p2p", p2p, 1), ("collective", reduce, 2)):
        latency, seconds_per_byte = _fit_alpha_beta(sizes, times)
        entries.append(CommEntry(op, "intra_node", 1e-9 / seconds_per_byte, latency / latencies))
    return tuple(entries)


def _fit_alpha_beta(sizes: tuple[int, ...], times: list[float]) -> tuple[float, float]:
    """``(a, b)`` of ``t = a + b n`` through the smallest and the largest message (robust to a
    noisy middle); ``b`` from the largest message alone when the two do not grow."""
    (n0, t0), (n1, t1) = (sizes[0], times[0]), (sizes[-1], times[-1])
    if n1 > n0 and t1 > t0:
        b = (t1 - t0) / (n1 - n0)
        return max(t0 - b * n0, 0.0), b
    return min(t0, t1), t1 / n1


def _comm_worker(
    rank: int,
    port: int,
    sizes: tuple[int, ...],
    warmup: int,
    iters: int,
    timeout_s: float,
    conn: Any,
) -> None:
    torch.set_num_threads(1)

    def measure() -> tuple[list[float], list[float]]:
        with gloo_pair(rank, port, timeout_s) as comm:
            return _comm_times(comm, sizes, warmup, iters)

    report_to_parent(conn, measure)


def _comm_times(
    comm: Any, sizes: tuple[int, ...], warmup: int, iters: int
) -> tuple[list[float], list[float]]:
    """Median one-way p2p and all-reduce seconds per size, as rank 0 sees them."""
    p2p, reduce = [], []
    peer = 1 - comm.rank
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4))
        one_way, collective = [], []
        for i in range(warmup + iters):
            comm.barrier()
            start = time.perf_counter()
            if comm.rank == 0:
                comm.send(buf, peer)
                comm.recv(buf, peer)
            else:
                comm.recv(buf, peer)
                comm.send(buf, peer)
            middle = time.perf_counter()
            comm.barrier()
            before = time.perf_counter()
            comm.world.all_reduce(buf)
            end = time.perf_counter()
            if i >= warmup:
                one_way.append((middle - start) / 2)
                collective.append(end - before)
        p2p.append(statistics.median(one_way))
        reduce.append(statistics.median(collective))
    return p2p, reduce


__all__ = ["COMM_SIZES", "measure_comm"]
