"""The relay bridge (:mod:`megatron_het.comm.relay`) from a CUDA tensor.

``relay.stage``: in this process, a CUDA tensor through :meth:`Bridge.relay`, the bridge's
chunked staging (device -> pinned host buffers -> device, double-buffered on side streams, as
its collectives run it) with a host-side negation standing in for the wire; timed as
device->host + host->device bytes per second.

``relay.cross-kind``: two ranks under torchrun on the mixed pair's cluster (rank 0 the GPU,
rank 1 the host CPU) send a CUDA tensor through the unified communicator to the CPU rank and
back (staging + gloo over loopback), then all-reduce across the kinds; rank 0 writes the
figures. Bandwidth counts the bytes of both directions over the round trip's time.

Threshold > 1 GB/s for both: pinned PCIe copies run at tens of GB/s and loopback gloo at a few
GB/s; less means unpinned staging or a transport problem.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence

import torch

from megatron_het.cluster import ClusterSpec
from megatron_het.comm import UnifiedCommunicator
from megatron_het.comm.relay import Bridge
from megatron_het.comm.ring import chunks
from megatron_het.launcher.launch_env import read_launch_env
from megatron_het.launcher.rank_device import rank_device_index
from megatron_het.launcher.world import init_world, shutdown_world
from megatron_het.pipeline.timing import synchronize
from tools.gpu_check.context import CheckContext
from tools.gpu_check.device_checks import skip_all
from tools.gpu_check.pair_files import pair_files
from tools.gpu_check.report import FAIL, SKIP, status_of

MIN_GBPS = 1.0
STAGE_BYTES = 256 * 2**20
WIRE_BYTES = 64 * 2**20
ROUNDS = 3
WORKER_S = 60.0


class _Done:
    """The Waitable of a transfer that has already happened."""

    def wait(self) -> None:
        return None


def _negate(host_chunk: torch.Tensor) -> _Done:
    """The stand-in for the wire: changes the host chunk in place, so that the result shows
    the data went out through host memory and came back."""
    host_chunk.neg_()
    return _Done()


def relay_round_trip(
    device: str, nbytes: int = STAGE_BYTES, rounds: int = ROUNDS
) -> tuple[bool, float]:
    """(data intact, GB/s) of ``rounds`` trips of an fp32 tensor of ``nbytes`` on ``device``
    through :meth:`Bridge.relay` (chunks staged to host buffers and back, as the bridge's
    collectives run them) with a host-side negation as the wire; the first trip is an untimed
    warm-up. Intact: the tensor came back negated, every trip."""
    bridge = Bridge("relay")
    source = torch.arange(nbytes // 4, dtype=torch.float32, device=device)
    work = torch.empty_like(source)
    intact, seconds = True, 0.0
    for trip in range(rounds + 1):
        work.copy_(source)
        synchronize(torch.device(device))
        start = time.perf_counter()
        bridge.relay(work, chunks(work.numel()), _negate)
        synchronize(torch.device(device))
        if trip:
            seconds += time.perf_counter() - start
        intact = intact and bool(torch.equal(work, -source))
    return intact, 2 * nbytes * rounds / max(seconds, 1e-9) / 1e9


def check_relay(ctx: CheckContext) -> None:
    """Rows ``relay.stage`` and ``relay.cross-kind`` (see the module docstring)."""
    if ctx.options.pair_kind.lower() == "cpu":
        ctx.rows.add("relay.stage", SKIP, "a CPU tensor is its own host buffer")
    elif not torch.cuda.is_available():
        skip_all(ctx, ("relay.stage", "relay.cross-kind"))
        return
    else:
        intact, gbps = relay_round_trip("cuda")
        ctx.rows.add(
            "relay.stage",
            status_of(intact and gbps > MIN_GBPS),
            f"{gbps:.2f} GB/s D2H+H2D, data intact: {intact}",
            f"> {MIN_GBPS:g} GB/s",
            nbytes=STAGE_BYTES,
            rounds=ROUNDS,
        )
    files = pair_files(ctx.options.pair_kind, ctx.work / "files")
    result_path = ctx.work / "cross_kind.json"
    run = ctx.run(
        [
            *ctx.torchrun(2),
            "-m",
            "tools.gpu_check.relay_check",
            "--cluster",
            str(files.cluster),
            "--result",
            str(result_path),
        ],
        WORKER_S,
        "cross_kind.log",
        {**ctx.env, "OMP_NUM_THREADS": "2"},
    )
    if not run.ok or not result_path.exists():
        ctx.rows.add(
            "relay.cross-kind",
            FAIL,
            f"2-rank run {run.why()}",
            f"> {MIN_GBPS:g} GB/s",
            log_tail=run.tail(),
        )
        return
    figures = json.loads(result_path.read_text())
    ok = figures["intact"] and figures["all_reduce_ok"] and figures["gbps"] > MIN_GBPS
    ctx.rows.add(
        "relay.cross-kind",
        status_of(ok),
        f"{figures['gbps']:.2f} GB/s round trip "
        f"{figures['kinds']}, data intact: {figures['intact']}, mixed all-reduce ok: "
        f"{figures['all_reduce_ok']}",
        f"> {MIN_GBPS:g} GB/s",
        **figures,
    )


def worker_main(argv: Sequence[str], environ: dict) -> None:
    """One rank of the cross-kind round trip (run by torchrun; rank 0 writes ``--result``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args(list(argv))
    env = read_launch_env(environ)
    cluster = ClusterSpec.load(args.cluster)

    def device_type(rank: int) -> str:
        return cluster.accelerator_of(rank).device_type

    init_world(
        env,
        device_type=device_type(env.rank),
        device_index=rank_device_index(device_type, env.rank, env.local_rank),
    )
    try:
        comm = UnifiedCommunicator.from_cluster(cluster, bridge="relay")
        figures = _round_trips(comm)
        if comm.rank == 0:
            figures["kinds"] = "+".join(comm.rank_kinds)
            pathlib.Path(args.result).write_text(json.dumps(figures) + "\n")
    finally:
        shutdown_world()


def _round_trips(comm: UnifiedCommunicator) -> dict:
    device = comm.device
    source = torch.arange(WIRE_BYTES // 4, dtype=torch.float32, device=device)
    buffer = torch.empty_like(source)
    seconds = 0.0
    for trip in range(ROUNDS + 1):
        comm.barrier()
        start = time.perf_counter()
        if comm.rank == 0:
            comm.send(source, 1)
            comm.recv(buffer, 1)
        elif comm.rank == 1:
            comm.recv(buffer, 0)
            comm.send(buffer, 0)
        synchronize(torch.device(device))
        if trip:
            seconds += time.perf_counter() - start
    ones = torch.full((1 << 20,), float(comm.rank + 1), device=device)
    comm.world.all_reduce(ones)
    expected = comm.world_size * (comm.world_size + 1) / 2
    return {
        "intact": bool(torch.equal(buffer, source)),
        "gbps": 2 * WIRE_BYTES * ROUNDS / max(seconds, 1e-9) / 1e9,
        "nbytes": WIRE_BYTES,
        "rounds": ROUNDS,
        "all_reduce_ok": bool((ones == expected).all()),
    }


if __name__ == "__main__":
    worker_main(sys.argv[1:], dict(os.environ))
