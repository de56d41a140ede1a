"""Measuring how a CPU host's processes slow each other: the host-sharing figures of a profile.

:func:`measure_host_sharing` runs one decoder layer's forward + backward (one TP rank's shard, as
:mod:`megatron_het.perf.measure.profiler` times it) in ``n = 1, 2, ..., max_processes`` forked
processes at once, one thread each, started together behind a barrier, and returns the median time
of a pass with ``n`` processes over the median alone (the
:attr:`~megatron_het.perf.measure.profile_format.Profile.host_sharing` figures, which
:class:`~megatron_het.emulation.host_sharing.HostSharing` reads). :func:`measure_host_collective`
times one TP collective between two computing processes, wall and CPU
(:attr:`~megatron_het.perf.measure.profile_format.Profile.host_collective_s`): gloo's copies and
reductions run on the same cores as the compute. All processes start in sessions of their own, as
torchrun starts ranks (see :func:`_worker`). These figures exist for CPU emulation, where ranks
share a host's cores.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.perf.cost.tp_collectives import tp_collectives
from megatron_het.perf.measure.worker_processes import (
    free_loopback_port,
    gloo_pair,
    process_context,
    report_to_parent,
    run_measurement_processes,
)


def measure_host_sharing(
    config: ModelConfig,
    seq: int,
    micro_batch: int,
    tp: int = 1,
    max_processes: int = 4,
    passes: int = 6,
    warmup: int = 1,
    rounds: int = 2,
    reference_s: float | None = None,
    timeout_s: float = 300.0,
) -> tuple[float, ...]:
    """The :attr:`Profile.host_sharing` figures of this host for 1 .. ``max_processes``.

    Per ``rounds`` (the counts go round, so a drift in outside load falls on all of them):
    ``n`` forked processes (one thread each) build one TP rank's layer of ``config``, run
    ``warmup`` passes, meet at a barrier and time ``passes`` forward + backward passes of a
    ``[micro_batch, seq]`` input. The figure for ``n`` is the median pass time over all its
    processes and rounds divided by ``reference_s``: by default the median of ``n = 1``;
    given the profile's own forward + backward time of that layer shape, the figures also
    carry how much slower (or faster) the host computes now than when the profile was
    measured (a host whose load from other work changes). Side effects: starts processes.
    """
    if max_processes < 1 or passes < 1 or rounds < 1:
        raise UserError(
            f"need max_processes, passes and rounds >= 1, got {max_processes}, {passes}, {rounds}"
        )
    times: dict[int, list[float]] = {n: [] for n in range(1, max_processes + 1)}
    for _ in range(rounds):
        for n in times:
            times[n] += _concurrent_passes(
                config, seq, micro_batch, tp, n, passes, warmup, timeout_s
            )
    alone = statistics.median(times[1]) if reference_s is None else reference_s
    return tuple(statistics.median(times[n]) / alone for n in sorted(times))


def measure_host_collective(
    config: ModelConfig,
    seq: int,
    micro_batch: int,
    passes: int = 8,
    rounds: int = 1,
    timeout_s: float = 300.0,
) -> tuple[float, float]:
    """The :attr:`Profile.host_collective_s` figures: (wall, CPU) seconds of one TP collective
    between two processes computing between their collectives, as TP ranks do.

    Two forked processes (own sessions, one thread each) form a gloo pair through the unified
    communicator and run one decoder layer's forward + backward as a real TP=2 pair (its 4
    all-reduces of the ``[micro_batch, seq, hidden]`` activations) and, alternating with it,
    the same shard with the collectives skipped (:class:`~megatron_het.perf.measure.profiler.
    ComputeOnlyGroup`, as the profile times it). One collective's wall time is the difference
    of the median pass times over 4 (the transfer, and the wait for a peer that finished its
    compute later); its CPU time the difference of the processes' CPU times over 4 (gloo's
    copies and reductions, which on a shared host compete with compute). Medians over
    ``rounds``. Side effects: starts processes and opens a loopback port.
    """
    if passes < 1 or rounds < 1:
        raise UserError(f"need passes and rounds >= 1, got {passes} and {rounds}")
    walls, cpus = [], []
    for _ in range(rounds):
        wall, cpu = _collective_round(config, seq, micro_batch, passes, timeout_s)
        walls.append(wall)
        cpus.append(cpu)
    wall = max(statistics.median(walls), 1e-9)
    return wall, min(max(statistics.median(cpus), 1e-9), wall)


def _collective_round(
    config: ModelConfig, seq: int, micro_batch: int, passes: int, timeout_s: float
) -> tuple[float, float]:
    port = free_loopback_port()
    (payload,) = run_measurement_processes(
        process_context(),
        _pair_worker,
        [(config, seq, micro_batch, rank, port, passes, timeout_s) for rank in range(2)],
        1,
        timeout_s,
        f"host collective measurement did not finish in {timeout_s} s",
        "host collective measurement failed",
        join_s=10.0,
    )
    return payload


# A decoder layer's all-reduces at TP > 1 (2 forward, 2 backward), as the cost model counts them.
_LAYER = tp_collectives(2, 1)
LAYER_TP_COLLECTIVES = _LAYER.forward + _LAYER.backward


def _pair_worker(
    config: ModelConfig,
    seq: int,
    micro_batch: int,
    rank: int,
    port: int,
    passes: int,
    timeout_s: float,
    conn: Any,
) -> None:
    os.setsid()
    torch.set_num_threads(1)

    def measure() -> tuple[float, float]:
        with gloo_pair(rank, port, timeout_s) as comm:
            return _collective_times(comm, config, seq, micro_batch, rank, passes)

    report_to_parent(conn, measure)


def _collective_times(
    comm: Any, config: ModelConfig, seq: int, micro_batch: int, rank: int, passes: int
) -> tuple[float, float]:
    """(wall, CPU) seconds of one TP collective, from passes with and without them."""
    from megatron_het.model.llama import build_model
    from megatron_het.perf.measure.shard_cases import ComputeOnlyGroup, layer_case
    from megatron_het.tensor_parallel import apply_tp

    device = torch.device("cpu")
    cases = []
    for group in (comm.world, ComputeOnlyGroup(2, rank)):
        stage = build_model(config, 1234, (0, 1), False, False, device=device)
        apply_tp(stage, group, config)
        cases.append(layer_case(stage, seq, micro_batch, 2, "fp32", device))
    times: list[list[float]] = [[], []]
    cpu = [0.0, 0.0]
    for i in range(passes + 1):
        for j, case in enumerate(cases):
            comm.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            case.backward(case.forward())
            if i:
                times[j].append(time.perf_counter() - start)
                cpu[j] += time.process_time() - start_cpu
    extra = statistics.median(times[0]) - statistics.median(times[1])
    extra_cpu = (cpu[0] - cpu[1]) / passes
    return extra / LAYER_TP_COLLECTIVES, extra_cpu / LAYER_TP_COLLECTIVES


def _concurrent_passes(
    config: ModelConfig,
    seq: int,
    micro_batch: int,
    tp: int,
    n: int,
    passes: int,
    warmup: int,
    timeout_s: float,
) -> list[float]:
    """Pass times (seconds) of ``n`` processes computing at once, all of them."""
    ctx = process_context()
    barrier = ctx.Barrier(n)
    reports = run_measurement_processes(
        ctx,
        _worker,
        [(config, seq, micro_batch, tp, passes, warmup, barrier, timeout_s)] * n,
        n,
        timeout_s,
        f"host sharing: {n} processes did not finish in {timeout_s} s",
        "host sharing measurement failed",
    )
    return [t for times in reports for t in times]


def _worker(
    config: ModelConfig,
    seq: int,
    micro_batch: int,
    tp: int,
    passes: int,
    warmup: int,
    barrier: Any,
    timeout_s: float,
    conn: Any,
) -> None:
    from megatron_het.perf.measure.shard_cases import layer_case, rank_stage

    # Each in its own session, as torchrun starts ranks: under Linux's autogroup scheduling a
    # session is one scheduling group, so the workers compete with each other and with other
    # load exactly as the ranks of a run do.
    os.setsid()
    torch.set_num_threads(1)

    def measure() -> list[float]:
        device = torch.device("cpu")
        stage = rank_stage(config, tp, (0, 1), False, False, device, seed=1234)
        case = layer_case(stage, seq, micro_batch, tp, "fp32", device)
        for _ in range(warmup):
            case.backward(case.forward())
        barrier.wait(timeout_s)
        times = []
        for _ in range(passes):
            start = time.perf_counter()
            case.backward(case.forward())
            times.append(time.perf_counter() - start)
        return times

    report_to_parent(conn, measure)


__all__ = ["LAYER_TP_COLLECTIVES", "measure_host_collective", "measure_host_sharing"]
