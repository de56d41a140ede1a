"""The elastic supervisor without processes: the cluster left after a loss, the failure record
and the relaunch it makes (the end-to-end run is in tests/test_faults_cli.py)."""
from __future__ import annotations

import pathlib

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.cluster.shrink import without_ranks
from megatron_het.errors import UserError
from megatron_het.training.supervisor import (flag_value, read_failure, supervise, with_flag,
                                              write_failure)

REPO = pathlib.Path(__file__).resolve().parents[2]
EMULATED = REPO / "scripts" / "clusters" / "cpu_emulated.yaml"
HETHUB = REPO / "scripts" / "clusters" / "hethub_llama140b.yaml"


def test_a_lost_device_leaves_the_rest_with_their_links_and_colocation() -> None:
    cluster = ClusterSpec.load(EMULATED)
    left = without_ranks(cluster, [1])
    assert left.world_size == 3
    assert left.accelerator_counts() == {"emu-fast": 1, "emu-slow": 2}
    assert [(g.name, g.nodes, g.devices_per_node, g.colocate_with) for g in left.node_groups] \
        == [("fast-1of2", 1, 1, None), ("slow", 1, 2, "fast-1of2")]
    # the emulated link between the kinds (the colocated host's) is kept
    link = left.group_link("fast-1of2", "slow")
    assert link.emulated and link.bandwidth_gbps == cluster.group_link("fast", "slow") \
        .bandwidth_gbps
    # rebuilt from its own file form
    assert ClusterSpec.from_dict(left.to_dict()).to_dict() == left.to_dict()


def test_nodes_that_lost_devices_become_groups_of_their_own() -> None:
    cluster = ClusterSpec.load(HETHUB)  # 16 MI250X nodes, then 80 accelerator-a nodes, 8 each
    left = without_ranks(cluster, [3, 200, 201, 767])
    assert left.world_size == 764
    assert left.accelerator_counts() == {"MI250X": 127, "accelerator-a": 637}
    shapes = {g.name: (g.nodes, g.devices_per_node) for g in left.node_groups}
    assert shapes == {"amd-7of8": (1, 7), "amd": (15, 8), "accel_a": (78, 8),
                      "accel_a-6of8": (1, 6), "accel_a-7of8": (1, 7)}
    # every derived group keeps the cross-kind link
    assert left.group_link("amd-7of8", "accel_a-6of8").bandwidth_gbps == \
        cluster.group_link("amd", "accel_a").bandwidth_gbps
    # a whole node lost is gone
    gone = without_ranks(cluster, range(8))
    assert {g.name: g.nodes for g in gone.node_groups} == {"amd": 15, "accel_a": 80}


def test_bad_losses_are_one_line_errors() -> None:
    cluster = ClusterSpec.load(EMULATED)
    with pytest.raises(UserError, match="not in cluster"):
        without_ranks(cluster, [4])
    with pytest.raises(UserError, match="no device"):
        without_ranks(cluster, range(4))


def test_flags_are_read_and_replaced() -> None:
    flags = ["--cluster", "a.yaml", "--plan=p.json", "--save", "ck"]
    assert flag_value(flags, "--plan") == "p.json" and flag_value(flags, "--load") is None
    assert with_flag(flags, "--plan", "auto") == ["--cluster", "a.yaml", "--save", "ck",
                                                   "--plan", "auto"]
    assert with_flag(flags, "--cluster", "b.yaml")[-2:] == ["--cluster", "b.yaml"]


def test_the_supervisor_relaunches_on_the_devices_left(tmp_path: pathlib.Path) -> None:
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("4")
    launched: list[list[str]] = []

    def launch(cmd: list[str]) -> int:
        launched.append(cmd)
        if len(launched) == 1:  # the first run loses rank 1
            write_failure(save, 7, 4, silent=[1], stuck=[], failed=[0, 3], line="lost")
            return 1
        assert read_failure(save) is None  # the stale record is gone before a launch
        return 0

    said: list[str] = []
    flags = ["--cluster", str(EMULATED), "--plan", "p.json", "--save", str(save)]
    assert supervise(flags, launch=launch, say=said.append) == 0
    first, second = launched
    assert first[first.index("--nproc_per_node") + 1] == "4"
    assert second[second.index("--nproc_per_node") + 1] == "3"
    cluster = flag_value(second, "--cluster")
    assert cluster == str(save / "elastic" / "cluster_1.yaml")
    assert ClusterSpec.load(cluster).accelerator_counts() == {"emu-fast": 1, "emu-slow": 2}
    assert flag_value(second, "--plan") == "auto" and flag_value(second, "--load") == str(save)
    assert len(said) == 1 and "ranks [1] lost" in said[0] and "3 devices left" in said[0]


def test_the_supervisor_stops_without_a_lost_peer_or_restarts(tmp_path: pathlib.Path) -> None:
    save = tmp_path / "ckpt"
    flags = ["--cluster", str(EMULATED), "--save", str(save)]
    assert supervise(flags, launch=lambda cmd: 2, say=print) == 2  # a user error: no record

    def always_lose(cmd: list[str]) -> int:
        write_failure(save, 1, 4, silent=[0], stuck=[], failed=[], line="lost")
        return 1

    said: list[str] = []
    assert supervise(flags, max_restarts=1, launch=always_lose, say=said.append) == 1
    assert "restart 1 of 1" in said[0] and "from the start" in said[0]
    assert "no restart left" in said[1]
    with pytest.raises(UserError, match="needs --cluster"):
        supervise(["--save", str(save)], launch=always_lose)
