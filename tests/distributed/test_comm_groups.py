"""Building the communicator from a cluster file; group membership; user errors."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch

from megatron_het.cluster import ClusterSpec
from megatron_het.comm import UnifiedCommunicator
from megatron_het.emulation.emulated_links import EmulatedLink, EmulatedWires, emulated_wires
from megatron_het.errors import UserError
from tests.distributed.harness import run_ranks

CLUSTER = Path(__file__).resolve().parents[2] / "scripts" / "clusters" / "cpu_emulated.yaml"


def from_cluster_file(rank: int, world_size: int) -> dict:
    comm = UnifiedCommunicator.from_cluster(
        ClusterSpec.load(CLUSTER), timeout=datetime.timedelta(seconds=30)
    )
    out: dict = {
        "kind": comm.kind,
        "rank": comm.rank,
        "world_size": comm.world_size,
        "world_mixed": comm.world.is_mixed,
        "device": str(comm.device),
    }
    fast = comm.new_group([0, 1], name="fast-tp")
    cross = comm.new_group([1, 2], name="stage-boundary")
    if rank in (0, 1):
        t = torch.tensor([float(rank + 1)])
        fast.all_reduce(t)
        out["fast_sum"] = t.item()
        out["fast_group_rank"] = fast.rank
    else:
        try:
            fast.all_reduce(torch.ones(1))
        except ValueError as exc:
            out["not_member"] = str(exc)
    if rank == 1:
        comm.send(torch.arange(4.0), 2)  # world p2p across kinds
        cross.send(torch.full((3,), 7.0), 2)
    elif rank == 2:
        got = torch.empty(4)
        comm.recv(got, 1)
        again = torch.empty(3)
        cross.recv(again, 1)
        out["p2p"] = got.tolist() + again.tolist()
    comm.barrier()
    return out


def test_from_cluster_file_groups_and_membership() -> None:
    results = run_ranks(from_cluster_file, 4, timeout=60)
    assert [r["kind"] for r in results] == ["emu-fast", "emu-fast", "emu-slow", "emu-slow"]
    assert all(r["world_mixed"] and r["world_size"] == 4 and r["device"] == "cpu" for r in results)
    assert [results[r]["fast_sum"] for r in (0, 1)] == [3.0, 3.0]
    assert [results[r]["fast_group_rank"] for r in (0, 1)] == [0, 1]
    for r in (2, 3):
        assert results[r]["not_member"] == (
            f"rank {r} is not a member of unified group 'fast-tp' (ranks [0, 1])"
        )
    assert results[2]["p2p"] == [0.0, 1.0, 2.0, 3.0, 7.0, 7.0, 7.0]


def wrong_world(rank: int, world_size: int) -> str:
    try:
        UnifiedCommunicator(["a", "b", "b"], {"a": "gloo", "b": "gloo"}, {"a": "cpu", "b": "cpu"})
    except UserError as exc:
        return str(exc)
    return "no error"


def test_cluster_that_does_not_match_the_launch_is_a_user_error() -> None:
    results = run_ranks(wrong_world, 2, timeout=30)
    assert results[0] == (
        "the cluster describes 3 ranks but 2 were launched; launch 3 "
        "processes or fix the cluster file"
    )


def emulated_bridge(rank: int, world_size: int) -> dict:
    slept: list[float] = []
    link = EmulatedLink(bandwidth_gbps=1e-6, latency_s=1e-3, sleep=slept.append)
    kinds = ["fast", "fast", "slow", "slow"]
    comm = UnifiedCommunicator(
        kinds,
        {k: "gloo" for k in kinds},
        {k: "cpu" for k in kinds},
        wire_hooks=EmulatedWires({frozenset(kinds): link}),
    )
    fast = comm.new_group([0, 1])
    before = link.bytes_sent
    if rank < 2:
        fast.all_reduce(torch.ones(64))  # one kind: never touches the bridge
    native_bytes = link.bytes_sent - before
    before = link.bytes_sent
    comm.world.all_reduce(torch.ones(1000))  # float32: each rank's channel piece is 2000 B
    return {
        "native": native_bytes,
        "bridge": link.bytes_sent - before,
        "slept": sum(slept),
        "modelled": link.delay(2000),
    }


def test_emulated_bridge_slows_only_cross_kind_traffic() -> None:
    for r in run_ranks(emulated_bridge, 4, timeout=60):
        assert r["native"] == 0
        assert r["bridge"] == 2000  # a 2-rank all-reduce of 2000 B moves 2 x 1/2 x 2000 B
        # the sleep (recorded, not slept) covers the modelled transfer minus its real duration
        assert 0.5 * r["modelled"] < r["slept"] <= r["modelled"]


def cluster_wires(rank: int, world_size: int) -> dict:
    cluster = ClusterSpec.load(CLUSTER)
    hooks = emulated_wires(cluster)
    timeout = datetime.timedelta(seconds=30)
    paced = UnifiedCommunicator.from_cluster(cluster, timeout=timeout, wire_hooks=hooks)
    plain = UnifiedCommunicator.from_cluster(cluster, timeout=timeout)
    link = hooks.links[frozenset(("emu-fast", "emu-slow"))]
    paced.world.all_reduce(torch.ones(1000))
    plain.world.all_reduce(torch.ones(1000))
    return {
        "paced_bytes": link.bytes_sent,
        "plain_wire": plain.world.flat.wire,
        "native_wire": paced.world.native.wire,
        "links": repr(hooks),
    }


def test_the_cluster_emulated_links_pace_only_with_the_hooks() -> None:
    for r in run_ranks(cluster_wires, 4, timeout=60):
        assert r["paced_bytes"] == 2000  # one bridge channel piece, as above
        assert r["plain_wire"] is None and r["native_wire"] is None
        assert r["links"] == "EmulatedWires(emu-fast <-> emu-slow 2 GB/s, 50 us) (emulated)"


def direct_choice(rank: int, world_size: int) -> list[str]:
    kinds = ["fast", "slow"]
    comm = UnifiedCommunicator(
        kinds, {k: "gloo" for k in kinds}, {k: "cpu" for k in kinds}, bridge="direct"
    )
    out = [comm.bridge.backend]
    try:  # a GPU kind and a CPU kind share no backend: every rank says so, before any group
        UnifiedCommunicator(
            ["gpu", "cpu"],
            {"gpu": "nccl", "cpu": "gloo"},
            {"gpu": "cuda", "cpu": "cpu"},
            bridge="direct",
        )
    except UserError as exc:
        out.append(str(exc))
    comm.world.barrier()  # the failed construction left the ranks in step
    return out


def test_direct_bridge_chooses_the_shared_backend_or_says_to_relay() -> None:
    for backend, message in run_ranks(direct_choice, 2, timeout=30):
        assert backend == "gloo"
        assert message == (
            "bridge 'direct' needs one backend that spans every accelerator "
            "kind, but gpu uses nccl on cuda and cpu uses gloo on cpu; use "
            "--bridge relay"
        )
