"""Communication cost: hand-computed DP sync on a 2+2 cluster, rings, NIC sharing, profiles."""

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.perf.cost.comm_time import LINK_EFFICIENCY, CommCost
from megatron_het.perf.measure.profile_format import CommEntry, Profile, ProfileConditions

GB = 1e9


def two_plus_two() -> ClusterSpec:
    """Ranks 0-1: H100 on node 0; ranks 2-3: A100-80G on node 1; a 10 GB/s bridge."""
    return ClusterSpec.from_dict(
        {
            "name": "two_plus_two",
            "node_groups": [
                {
                    "name": "a",
                    "accelerator": "H100",
                    "nodes": 1,
                    "devices_per_node": 2,
                    "nic_bandwidth_gbps": 50,
                },
                {
                    "name": "b",
                    "accelerator": "A100-80G",
                    "nodes": 1,
                    "devices_per_node": 2,
                    "nic_bandwidth_gbps": 50,
                },
            ],
            "links": [{"groups": ["a", "b"], "bandwidth_gbps": 10, "latency_us": 10}],
        }
    )


def two_nodes() -> ClusterSpec:
    """4 H100 ranks on 2 nodes (2 each) with a 25 GB/s NIC per node, 5 us latency."""
    return ClusterSpec.from_dict(
        {
            "node_groups": [
                {
                    "name": "h",
                    "accelerator": "H100",
                    "nodes": 2,
                    "devices_per_node": 2,
                    "nic_bandwidth_gbps": 25,
                }
            ]
        }
    )


def test_hierarchical_dp_sync_on_two_plus_two_by_hand():
    comm = CommCost(two_plus_two())
    nbytes = 1e9
    cost = comm.dp_sync([0, 1, 2, 3], nbytes)
    # reduce-scatter and all-gather inside each kind (the A100 pair's NVLink is the slower):
    native = 0.5 * nbytes / (600 * GB * LINK_EFFICIENCY) + 1e-6
    # each rank all-reduces its half with one rank of the other kind; both ranks of a node
    # cross the bridge at once, so each gets half of it
    bridge = 10 * GB * LINK_EFFICIENCY / 2
    cross = (nbytes / 2) / bridge + 2 * 10e-6
    assert cost.time_s == pytest.approx(2 * native + cross, rel=1e-12)
    assert "hierarchical" in cost.algorithm


def test_single_kind_ring_runs_at_the_slowest_link():
    comm = CommCost(two_nodes())
    nbytes = 4e9
    nic = 25 * GB * LINK_EFFICIENCY
    ring = comm.dp_sync([0, 1, 2, 3], nbytes)
    assert ring.time_s == pytest.approx(2 * 3 / 4 * nbytes / nic + 2 * 3 * 5e-6)
    assert ring.algorithm == "ring all-reduce"
    # ZeRO-1: reduce-scatter fp32 grads, all-gather bf16 params
    zero = comm.dp_sync([0, 1, 2, 3], nbytes, nbytes / 2)
    assert zero.time_s == pytest.approx(3 / 4 * 1.5 * nbytes / nic + 2 * 3 * 5e-6)
    assert comm.dp_sync([3], nbytes).time_s == 0.0


def test_groups_crossing_the_same_nic_share_it():
    comm = CommCost(two_nodes())
    # [0, 2] and [1, 3] (e.g. tp=2 in a node, dp=2 across) both cross the NIC at once
    pair = comm.dp_sync([0, 2], 1e9)
    assert pair.time_s == pytest.approx(1e9 / (25 * GB * LINK_EFFICIENCY / 2) + 2 * 5e-6)


def test_tp_all_reduce_inside_a_node():
    comm = CommCost(two_nodes())
    assert comm.tp_all_reduce([0, 1], 1e8) == pytest.approx(
        1e8 / (900 * GB * LINK_EFFICIENCY) + 2 * 1e-6
    )
    assert comm.tp_all_reduce([2], 1e8) == 0.0


def test_profile_figures_replace_the_link_figures():
    conditions = ProfileConditions("H100", "2.5", 8, "2026-11-30")
    profile = Profile("H100", conditions, comm=(CommEntry("collective", "inter_node", 5.0, 2e-5),))
    comm = CommCost(two_nodes(), {"H100": profile})
    ring = comm.dp_sync([0, 1, 2, 3], 4e9)
    assert ring.time_s == pytest.approx(2 * 3 / 4 * 4e9 / 5e9 + 2 * 3 * 2e-5)
    # p2p has no measurement: the link figures stay
    path = comm.path(1, 2, "p2p")
    assert path.bandwidth == pytest.approx(25 * GB * LINK_EFFICIENCY)
