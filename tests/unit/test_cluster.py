"""ClusterSpec: shipped YAML files, the rank map against torchrun's rule, links, validation."""

import copy
from pathlib import Path

import pytest

from megatron_het.cluster import AcceleratorRegistry, ClusterSpec
from megatron_het.emulation.emulated_links import emulated_link
from megatron_het.errors import UserError

CLUSTERS = Path(__file__).resolve().parents[2] / "scripts" / "clusters"
KNOWN = "A100-40G, A100-80G, H100, H200, MI250X, MI300X, Ascend910B, cpu, emu-fast, emu-slow"

# file -> (world size, nodes, devices per kind); written out by hand from the files' comments.
SHIPPED = {
    "cpu_emulated.yaml": (4, 1, {"emu-fast": 2, "emu-slow": 2}),
    "testnet_3nodes.yaml": (4, 3, {"emu-fast": 2, "emu-slow": 2}),
    "a100_mi250x.yaml": (64, 8, {"A100-80G": 32, "MI250X": 32}),
    "h100_mi300x.yaml": (64, 8, {"H100": 32, "MI300X": 32}),
    "a100_ascend910b.yaml": (96, 12, {"A100-80G": 32, "Ascend910B": 64}),
    "h100_a100.yaml": (64, 8, {"H100": 16, "A100-40G": 48}),
    "mi250x_ascend910b.yaml": (64, 8, {"MI250X": 32, "Ascend910B": 32}),
    "h200_mi300x.yaml": (48, 6, {"H200": 16, "MI300X": 32}),
    "hethub_llama140b.yaml": (768, 96, {"MI250X": 128, "accelerator-a": 640}),
    "h100_mi300x_a100_16k.yaml": (16384, 2048, {"H100": 8192, "MI300X": 4096, "A100-80G": 4096}),
}


def torchrun_ranks(nproc_per_node):
    """Ranks as torchrun's elastic agent assigns them: node by node (node_rank order), each node's
    workers taking the next local_world_size ranks; (node, local_rank) -> rank."""
    ranks, base = {}, 0
    for node, nproc in enumerate(nproc_per_node):
        for local in range(nproc):
            ranks[(node, local)] = base + local
        base += nproc
    return ranks


def two_groups(**changes):
    d = {
        "node_groups": [
            {
                "name": "a",
                "accelerator": "H100",
                "nodes": 2,
                "devices_per_node": 8,
                "nic_bandwidth_gbps": 50,
            },
            {
                "name": "b",
                "accelerator": "MI300X",
                "nodes": 1,
                "devices_per_node": 4,
                "nic_bandwidth_gbit_per_s": 200,
                "nic_latency_us": 8,
            },
        ],
        "links": [{"groups": ["a", "b"], "bandwidth_gbps": 12.5, "latency_us": 20}],
    }
    d.update(changes)
    return d


def test_every_cluster_file_is_tested():
    assert sorted(p.name for p in CLUSTERS.glob("*.yaml")) == sorted(SHIPPED)


@pytest.mark.parametrize("filename", sorted(SHIPPED))
def test_shipped_file_loads_and_maps_ranks(filename):
    world, nodes, counts = SHIPPED[filename]
    cluster = ClusterSpec.load(CLUSTERS / filename)
    assert cluster.name == filename[:-5]
    assert (cluster.world_size, cluster.num_nodes, cluster.accelerator_counts()) == (
        world,
        nodes,
        counts,
    )
    nproc = cluster.uniform_nproc_per_node
    assert (nproc is None) == (filename == "testnet_3nodes.yaml")  # 1, 1 and 2 ranks a node
    expected = torchrun_ranks([n.nproc for n in cluster.nodes()])
    for info in cluster.rank_map():
        assert info.rank == expected[(info.node, info.local_rank)]
        assert nproc is None or info.rank == info.node * nproc + info.local_rank
        assert cluster.accelerator_of(info.rank) is info.accelerator
    for name, count in counts.items():
        assert len(cluster.ranks_of_accelerator(name.upper())) == count
    text = cluster.describe()
    for group in cluster.node_groups:
        assert group.name in text and group.accelerator.label in text
    rebuilt = ClusterSpec.from_dict(cluster.to_dict())
    assert rebuilt.rank_map() == cluster.rank_map()
    assert rebuilt.describe() == text


def test_cpu_emulated_layout():
    cluster = ClusterSpec.load(CLUSTERS / "cpu_emulated.yaml")
    got = [
        (r.rank, r.group, r.node, r.local_rank, r.accelerator.name, r.accelerator.native_backend)
        for r in cluster.rank_map()
    ]
    assert got == [
        (0, "fast", 0, 0, "emu-fast", "gloo"),
        (1, "fast", 0, 1, "emu-fast", "gloo"),
        (2, "slow", 0, 2, "emu-slow", "gloo"),
        (3, "slow", 0, 3, "emu-slow", "gloo"),
    ]
    assert cluster.accelerator_of(3).slowdown == 2.0 * cluster.accelerator_of(0).slowdown
    bridge = cluster.link_between(1, 2)
    assert (bridge.kind, bridge.bandwidth_gbps, bridge.latency_s, bridge.emulated) == (
        "bridge",
        2.0,
        50e-6,
        True,
    )
    assert emulated_link(bridge).delay(2_000_000) == pytest.approx(50e-6 + 1e-3)
    assert cluster.link_between(0, 1).kind == "intra_node"
    text = cluster.describe()
    assert text.splitlines()[0] == (
        "cluster cpu_emulated (emulation): 4 ranks on 1 node, 2 node groups"
    )
    assert "emu-fast (emulated)" in text and "emu-slow (emulated)" in text
    assert "link fast <-> slow: 2 GB/s, 50 us (emulated)" in text


def test_hethub_custom_accelerator():
    cluster = ClusterSpec.load(CLUSTERS / "hethub_llama140b.yaml")
    spec = cluster.accelerator_of(cluster.world_size - 1)
    assert (spec.name, spec.vendor, spec.memory_gib) == ("accelerator-a", "other", 64)
    assert cluster.to_dict()["accelerators"]["accelerator-a"]["peak_tflops_bf16"] == 280


def test_links_between_ranks():
    cluster = ClusterSpec.from_dict(two_groups())
    same_node, other_node, bridge = (cluster.link_between(*p) for p in ((0, 7), (0, 8), (15, 16)))
    assert (same_node.kind, same_node.bandwidth_gbps) == ("intra_node", 900)
    assert (other_node.kind, other_node.bandwidth_gbps, other_node.latency_s) == (
        "inter_node",
        50,
        5e-6,
    )
    assert (bridge.kind, bridge.bandwidth_gbps, bridge.latency_s, bridge.emulated) == (
        "bridge",
        12.5,
        20e-6,
        False,
    )
    assert cluster.link_between(16, 19).bandwidth_gbps == 896
    assert bridge.transfer_time_s(12_500_000) == pytest.approx(20e-6 + 1e-3)
    with pytest.raises(ValueError):
        cluster.link_between(3, 3)


def test_default_link_is_the_slower_nic():
    cluster = ClusterSpec.from_dict(two_groups(links=[]))
    link = cluster.link_between(0, 16)
    assert (link.kind, link.bandwidth_gbps, link.latency_s) == ("bridge", 25.0, 8e-6)
    assert "link a <-> b: 25 GB/s, 8 us (default)" in cluster.describe()
    assert cluster.to_dict()["links"] == []


def test_uneven_nodes_follow_torchrun_cumulative_ranks():
    cluster = ClusterSpec.from_dict(two_groups())
    assert cluster.uniform_nproc_per_node is None
    assert [n.nproc for n in cluster.nodes()] == [8, 8, 4]
    expected = torchrun_ranks([8, 8, 4])
    assert [expected[(r.node, r.local_rank)] for r in cluster.rank_map()] == list(range(20))
    assert [n.first_rank for n in cluster.nodes()] == [0, 8, 16]


def test_rank_order_puts_named_group_first():
    cluster = ClusterSpec.from_dict(two_groups(rank_order=["b", "a"]))
    infos = cluster.rank_map()
    assert [(r.group, r.node, r.local_rank) for r in infos[:5]] == [
        ("b", 0, 0),
        ("b", 0, 1),
        ("b", 0, 2),
        ("b", 0, 3),
        ("a", 1, 0),
    ]
    assert cluster.ranks_of_accelerator("mi300x") == [0, 1, 2, 3]
    assert cluster.ranks_of_accelerator("H200") == []


def test_colocated_groups_share_nodes():
    d = {
        "node_groups": [
            {
                "name": "f",
                "accelerator": "emu-fast",
                "nodes": 2,
                "devices_per_node": 1,
                "nic_bandwidth_gbps": 1,
            },
            {
                "name": "s",
                "accelerator": "emu-slow",
                "nodes": 2,
                "devices_per_node": 2,
                "nic_bandwidth_gbps": 1,
                "colocate_with": "f",
            },
        ]
    }
    cluster = ClusterSpec.from_dict(d)
    assert [(r.group, r.node, r.local_rank) for r in cluster.rank_map()] == [
        ("f", 0, 0),
        ("s", 0, 1),
        ("s", 0, 2),
        ("f", 1, 0),
        ("s", 1, 1),
        ("s", 1, 2),
    ]
    assert cluster.uniform_nproc_per_node == 3
    assert cluster.link_between(1, 4).kind == "inter_node"
    assert cluster.nodes()[1].groups == ("f", "s")


def test_accelerator_overrides_in_cluster_yaml(tmp_path):
    kinds = tmp_path / "kinds.yaml"
    kinds.write_text("accelerators:\n  MI300X: {memory_gib: 191, intra_node_bandwidth_gbps: 800}\n")
    path = tmp_path / "c.yaml"
    path.write_text(
        "accelerators_file: kinds.yaml\n"
        "accelerators:\n  h100: {memory_gib: 94}\n"
        "node_groups:\n"
        "  - {name: a, accelerator: H100, nodes: 1, devices_per_node: 2, nic_bandwidth_gbps: 5}\n"
        "  - {name: b, accelerator: mi300x, nodes: 1, devices_per_node: 2, "
        "nic_bandwidth_gbps: 5, intra_node_bandwidth_gbps: 700}\n"
    )
    cluster = ClusterSpec.load(path)
    assert cluster.accelerator_of(0).memory_gib == 94
    assert cluster.accelerator_of(0).peak_tflops_bf16 == 989
    assert cluster.accelerator_of(2).memory_gib == 191
    assert cluster.link_between(2, 3).bandwidth_gbps == 700
    assert cluster.to_dict()["accelerators"]["H100"]["memory_gib"] == 94
    plain = tmp_path / "plain.yaml"
    plain.write_text(path.read_text().split("node_groups:")[1].join(["node_groups:", ""]))
    assert ClusterSpec.load(plain, accelerators_file=kinds).accelerator_of(2).memory_gib == 191
    assert (
        ClusterSpec.load(plain, registry=AcceleratorRegistry.builtin()).accelerator_of(2).memory_gib
        == 192
    )


def _set(path, value):
    def change(d):
        target = d
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return d

    return change


_DELETE = object()


@pytest.mark.parametrize(
    "change, message",
    [
        (
            _set(("nodegroups",), []),
            "cluster: unknown key 'nodegroups'; known keys: name, accelerators_file, accelerators, "
            "node_groups, links, rank_order",
        ),
        (_set(("node_groups",), []), "cluster: node_groups must list at least one node group"),
        (
            _set(("node_groups", 0, "gpus"), 8),
            "node group 'a': unknown key 'gpus'; known keys: name, accelerator, nodes, devices_per_node, "
            "nic_bandwidth_gbps, nic_bandwidth_gbit_per_s, nic_latency_us, intra_node_bandwidth_gbps, "
            "colocate_with",
        ),
        (
            _set(("node_groups", 0, "accelerator"), "A100"),
            f"node group 'a': unknown accelerator 'A100'; known: {KNOWN}",
        ),
        (
            _set(("node_groups", 0, "nodes"), 0),
            "node group 'a': nodes must be a positive integer, got 0",
        ),
        (
            _set(("node_groups", 1, "devices_per_node"), -2),
            "node group 'b': devices_per_node must be a positive integer, got -2",
        ),
        (
            _set(("node_groups", 1, "devices_per_node"), 2.5),
            "node group 'b': devices_per_node must be a positive integer, got 2.5",
        ),
        (
            _set(("node_groups", 0, "accelerator"), _DELETE),
            "node group 'a': missing key 'accelerator'",
        ),
        (
            _set(("node_groups", 0, "nic_bandwidth_gbps"), _DELETE),
            "node group 'a': missing key 'nic_bandwidth_gbps' (GB/s; or nic_bandwidth_gbit_per_s in Gb/s)",
        ),
        (
            _set(("node_groups", 0, "nic_bandwidth_gbit_per_s"), 400),
            "node group 'a': give nic_bandwidth_gbps (GB/s) or nic_bandwidth_gbit_per_s (Gb/s), not both",
        ),
        (
            _set(("node_groups", 0, "nic_bandwidth_gbps"), 0),
            "node group 'a': nic_bandwidth_gbps must be positive, got 0",
        ),
        (
            _set(("node_groups", 1, "nic_latency_us"), -1),
            "node group 'b': nic_latency_us must be zero or more, got -1",
        ),
        (
            _set(("node_groups", 1, "name"), "a"),
            "node group name 'a' is used twice; give each node group a unique name",
        ),
        (
            _set(("node_groups", 1, "name"), ""),
            "node group #1: needs a mapping with a non-empty name",
        ),
        (
            _set(("links", 0, "groups"), ["a", "c"]),
            "link a <-> c: unknown node group 'c'; node groups: a, b",
        ),
        (
            _set(("links", 0, "groups"), ["a", "a"]),
            "link #0: groups must name two different node groups, got ['a', 'a']",
        ),
        (
            _set(("links", 0, "bandwidth"), 3),
            "link a <-> b: unknown key 'bandwidth'; known keys: groups, bandwidth_gbps, "
            "bandwidth_gbit_per_s, latency_us, emulated",
        ),
        (
            _set(("links", 0, "bandwidth_gbps"), -5),
            "link a <-> b: bandwidth_gbps must be positive, got -5",
        ),
        (
            _set(("links", 0, "emulated"), True),
            "link a <-> b: emulated: true needs both node groups to use emulated accelerators",
        ),
        (
            _set(
                ("links",),
                [
                    {"groups": ["a", "b"], "bandwidth_gbps": 1},
                    {"groups": ["b", "a"], "bandwidth_gbps": 2},
                ],
            ),
            "link b <-> a is given twice; keep one",
        ),
        (
            _set(("rank_order",), ["a"]),
            "rank_order ['a'] must list every node group exactly once: a, b",
        ),
        (
            _set(("rank_order",), ["a", "b", "a"]),
            "rank_order ['a', 'b', 'a'] must list every node group exactly once: a, b",
        ),
        (
            _set(("node_groups", 1, "colocate_with"), "z"),
            "node group 'b': colocate_with names unknown node group 'z'; other node groups: a",
        ),
        (
            _set(("node_groups", 1, "colocate_with"), "a"),
            "node group 'b': colocate_with 'a' needs nodes: 2 (the same nodes), got 1",
        ),
    ],
)
def test_validation_messages(change, message):
    d = change(copy.deepcopy(two_groups()))
    with pytest.raises(UserError) as exc:
        ClusterSpec.from_dict(d)
    assert str(exc.value) == message


def test_chained_colocation_is_rejected():
    d = two_groups()
    d["node_groups"].append(
        {
            "name": "c",
            "accelerator": "cpu",
            "nodes": 1,
            "devices_per_node": 1,
            "nic_bandwidth_gbps": 1,
            "colocate_with": "b",
        }
    )
    d["node_groups"][1]["colocate_with"] = "c"
    with pytest.raises(UserError) as exc:
        ClusterSpec.from_dict(d)
    assert str(exc.value) == (
        "node group 'b': colocate_with 'c', which is itself colocated; "
        "name the group that owns the nodes"
    )


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(UserError) as exc:
        ClusterSpec.load(tmp_path / "none.yaml")
    assert str(exc.value) == f"cluster file '{tmp_path / 'none.yaml'}' not found; check the path"
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(UserError) as exc:
        ClusterSpec.load(listed)
    assert str(exc.value) == f"cluster file '{listed}' must hold a mapping at the top level"


def test_rank_queries_reject_bad_input():
    cluster = ClusterSpec.from_dict(two_groups())
    with pytest.raises(UserError) as exc:
        cluster.accelerator_of(20)
    assert str(exc.value) == "rank 20 is outside the cluster's 20 ranks"
    with pytest.raises(UserError) as exc:
        cluster.group("c")
    assert str(exc.value) == "unknown node group 'c'; node groups: a, b"
