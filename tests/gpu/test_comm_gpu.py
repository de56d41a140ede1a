"""The communicator on a real CUDA/ROCm device (skipped without one; see tests/gpu/__init__.py).

Nothing here touches CUDA at import time. The two-process tests start (spawn, in the GPU
session: see tests/distributed/harness.py) one rank that uses GPU 0 and one CPU rank: they
cross the relay bridge (pinned pool, side-stream copies, chunk pipeline) and check that the
CPU rank never creates a CUDA context. One GPU cannot hold two NCCL ranks,
so NCCL links here have one member each (still built, connected eagerly and used).
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.gpu

KINDS = ["gpu", "cpu"]
BACKENDS = {"gpu": "nccl", "cpu": "gloo"}
DEVICES = {"gpu": "cuda", "cpu": "cpu"}
BIG = 3 * (1 << 19) + 7  # several relay chunks (see comm/ring.py chunks())


def test_pinned_pool_round_trip_and_reuse() -> None:
    from megatron_het.comm.relay import Bridge

    bridge = Bridge("relay")
    x = torch.arange(10_000, device="cuda", dtype=torch.float32) * 3  # queued on the stream
    staged = bridge.stage(x)
    assert staged.host.device.type == "cpu" and staged.host.is_pinned()
    assert torch.equal(staged.host, x.cpu())
    staged.host.add_(1)
    staged.finish()
    assert torch.equal(x, torch.arange(10_000, device="cuda", dtype=torch.float32) * 3 + 1)
    again = bridge.stage(x, copy_in=False)
    assert again.host.data_ptr() == staged.host.data_ptr()  # the pinned buffer came back
    again.release()
    pool = bridge.pool(x)
    assert pool.allocated == 1 and pool.reused == 1 and pool.outstanding == 0


def test_a_received_buffer_reaches_the_device_without_waiting_for_compute_queued_after_it() -> None:
    """A receive buffer posted before more compute is queued: when its data arrives, the copy
    to the device runs beside that compute, and the work queued after finish() sees it."""
    from megatron_het.comm.relay import Bridge

    bridge = Bridge("relay")
    got = torch.empty(1 << 20, device="cuda")
    staged = bridge.stage(got, copy_in=False)  # posted: marks the stream here
    torch.cuda._sleep(2_000_000_000)  # about a second of compute queued after the post
    staged.host.copy_(torch.arange(1 << 20, dtype=torch.float32))  # the data arrives
    copier = bridge.copier(got.device)
    staged.finish()
    done = torch.cuda.Event()
    done.record(copier._to_device)
    done.synchronize()  # the copy finished ...
    assert not torch.cuda.current_stream().query()  # ... while the compute still runs
    torch.testing.assert_close(
        got + 0, torch.arange(1 << 20, dtype=torch.float32, device="cuda"), rtol=0, atol=0
    )


def test_relay_chunks_through_side_streams() -> None:
    from megatron_het.comm.relay import Bridge
    from megatron_het.comm.ring import chunks

    class Doubling:
        def __init__(self, host: torch.Tensor) -> None:
            self.host = host

        def wait(self) -> None:
            self.host.mul_(2)

    bridge = Bridge("relay")
    x = torch.arange(BIG, device="cuda", dtype=torch.float32).remainder_(1000)
    want = x * 2
    bridge.relay(x, chunks(BIG), Doubling)
    y = x + 0  # a kernel on the current stream right after: must see the copied-back data
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    assert bridge.pool(x).outstanding == 0


def mixed_world(rank: int, world_size: int) -> dict:
    if rank == 0:
        torch.cuda.set_device(0)
    from megatron_het.comm.communicator import UnifiedCommunicator

    comm = UnifiedCommunicator(KINDS, BACKENDS, DEVICES, timeout=datetime.timedelta(seconds=60))
    dev = comm.device
    out: dict = {}
    x = torch.full((BIG,), float(rank + 1), device=dev)
    comm.world.all_reduce(x)
    out["all_reduce"] = bool((x == 3).all())
    y = torch.arange(1000, device=dev, dtype=torch.float32) + rank
    handle = comm.world.all_reduce(y, async_op=True)
    z = torch.ones(5, device=dev) * (rank + 1)
    comm.world.all_reduce(z, op="max")  # a sync op while the async one is pending
    handle.wait()
    out["async"] = torch.equal(y.cpu(), torch.arange(1000.0) * 2 + 1) and bool((z == 2).all())
    w = torch.full((BIG,), float(rank + 1), device=dev)
    if rank == 0:
        torch.cuda._sleep(1_000_000_000)  # about half a second of device work queued first
    handle = comm.world.all_reduce(w, async_op=True)
    # the call did not wait for the device: its copy to the host is started by the bridge's
    # start queue once the device gets there
    out["async_without_host_sync"] = rank == 1 or not torch.cuda.current_stream().query()
    handle.wait()
    out["async_after_device_work"] = bool((w == 3).all())
    b = (
        torch.arange(BIG, device=dev, dtype=torch.float32)
        if rank == 1
        else torch.zeros(BIG, device=dev)
    )
    comm.world.broadcast(b, src=1)
    out["broadcast"] = torch.equal(b.cpu(), torch.arange(BIG, dtype=torch.float32))
    g = torch.empty(2 * 7, device=dev)
    comm.world.all_gather_into_tensor(g, torch.full((7,), float(rank), device=dev))
    out["all_gather"] = g.cpu().tolist() == [0.0] * 7 + [1.0] * 7
    rs = torch.empty(4, device=dev)
    comm.world.reduce_scatter_tensor(rs, torch.arange(8.0, device=dev) + rank, async_op=True).wait()
    out["reduce_scatter"] = rs.cpu().tolist() == [2 * i + 1 for i in range(4 * rank, 4 * rank + 4)]
    if rank == 0:
        comm.send(torch.arange(9.0, device=dev), 1)
        back = torch.empty(9, device=dev)
        comm.recv(back, 1)
        out["p2p"] = torch.equal(back.cpu(), torch.arange(9.0) * 2)
    else:
        got = torch.empty(9)
        comm.recv(got, 0)
        comm.send(got * 2, 0)
        out["p2p"] = True
    comm.barrier()
    out["cuda_initialised"] = torch.cuda.is_initialized()
    return out


def test_relay_between_a_gpu_rank_and_a_cpu_rank() -> None:
    gpu, cpu = run_ranks(mixed_world, 2, timeout=180)
    assert gpu.pop("cuda_initialised") is True
    assert cpu.pop("cuda_initialised") is False  # the CPU rank never created a CUDA context
    assert all(gpu.values()), gpu
    assert all(cpu.values()), cpu


def unified_backend(rank: int, world_size: int) -> list[str]:
    if rank == 0:
        torch.cuda.set_device(0)
    from megatron_het.comm.backend import register_unified_backend

    register_unified_backend(KINDS, BACKENDS)  # the GPU rank's native link: a raw NCCL backend
    group = dist.new_group([0, 1], backend="unified")
    dev = torch.device("cuda", 0) if rank == 0 else torch.device("cpu")
    bad = []
    x = torch.full((6,), float(rank + 1), device=dev)
    dist.all_reduce(x, group=group)
    bad += [] if bool((x == 3).all()) else ["all_reduce"]
    mine, theirs = torch.full((4,), 10.0 * rank, device=dev), torch.empty(4, device=dev)
    ops = [
        dist.P2POp(dist.irecv, theirs, 1 - rank, group),
        dist.P2POp(dist.isend, mine, 1 - rank, group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    bad += [] if bool((theirs == 10.0 * (1 - rank)).all()) else ["batch_isend_irecv"]
    out = torch.empty(3, device=dev)
    dist.reduce_scatter_tensor(out, torch.arange(6.0, device=dev), group=group)
    bad += (
        []
        if out.cpu().tolist() == [2.0 * i for i in range(3 * rank, 3 * rank + 3)]
        else ["reduce_scatter"]
    )
    return bad


def test_unified_torch_backend_with_a_raw_nccl_native_link() -> None:
    assert run_ranks(unified_backend, 2, timeout=180) == [[], []]
