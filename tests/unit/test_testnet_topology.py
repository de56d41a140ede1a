"""tools/testnet.py's plan: names, addresses and tc shapes from a cluster file, without root."""

from __future__ import annotations

import io
import pathlib

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.errors import UserError
from megatron_het.testnet import netns, network_faults
from megatron_het.testnet.launch import node_command, run_on_nodes
from megatron_het.testnet.topology import check_run_id, node_address, plan_testnet
from tools import testnet

REPO = pathlib.Path(__file__).resolve().parents[2]
THREE_NODES = REPO / "scripts" / "clusters" / "testnet_3nodes.yaml"


def test_every_node_gets_a_namespace_an_address_and_the_files_shapes() -> None:
    plan = plan_testnet(ClusterSpec.load(THREE_NODES), "ab1", scale=0.1)
    assert plan.bridge == "mhtbab1"
    assert [n.namespace for n in plan.nodes] == ["mht-ab1-n0", "mht-ab1-n1", "mht-ab1-n2"]
    assert [n.address for n in plan.nodes] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    assert all(len(n.veth) <= 15 for n in plan.nodes)  # Linux's limit on interface names
    fast, _, slow = plan.nodes
    # 10 Gbit/s NICs at scale 0.1: 1 Gbit/s; 5 us of NIC latency / 0.1
    assert (fast.nic.rate_bit, fast.nic.delay_us) == (10**9, pytest.approx(50.0))
    # the two kinds' link (0.5 GB/s, 200 us) from each fast node to the slow one, and back
    assert [(p.node, p.shape.rate_bit) for p in fast.peers] == [(2, 4 * 10**8)]
    assert fast.peers[0].shape.delay_us == pytest.approx(2000.0)
    assert [p.node for p in slow.peers] == [0, 1]
    assert fast.peers[0].why == "link fast <-> slow"


def test_groups_sharing_a_node_or_a_default_link_use_the_nic() -> None:
    plan = plan_testnet(ClusterSpec.load(REPO / "scripts/clusters/cpu_emulated.yaml"), "x")
    (node,) = plan.nodes  # two colocated groups: one host
    assert node.groups == ("fast", "slow") and node.peers == ()


def test_shaping_is_htb_per_destination_with_netem_where_the_kernel_has_it() -> None:
    fast = plan_testnet(ClusterSpec.load(THREE_NODES), "ab1", scale=0.1).nodes[0]
    with_netem = [" ".join(c) for c in netns.shaping_commands(fast, netem=True)]
    assert with_netem[0].startswith("tc -n mht-ab1-n0 qdisc replace dev eth0 root handle 1: htb")
    assert any("classid 1:100 htb rate 400000000bit" in c for c in with_netem)
    assert any("match ip dst 10.213.0.3/32 flowid 1:100" in c for c in with_netem)
    assert any("parent 1:100 handle 100: netem delay 2000us" in c for c in with_netem)
    without = [" ".join(c) for c in netns.shaping_commands(fast, netem=False)]
    assert not any("netem" in c for c in without)
    assert len(without) == len(with_netem) - 2  # the NIC's and the link's delays


def test_a_plan_survives_its_record() -> None:
    plan = plan_testnet(ClusterSpec.load(THREE_NODES), "r2", scale=0.5)
    assert netns.plan_from_dict({k: v for k, v in netns.plan_to_dict(plan).items()
                                 if k != "format"}) == plan  # fmt: skip


@pytest.mark.parametrize("run_id", ["", "ABC", "toolong7", "a-b"])
def test_a_bad_run_id_is_one_line(run_id: str) -> None:
    with pytest.raises(UserError, match="run id .* must be 1-6 lowercase letters or digits"):
        check_run_id(run_id)


def test_bad_scale_and_too_many_nodes_are_one_line() -> None:
    with pytest.raises(UserError, match="--scale must be positive"):
        plan_testnet(ClusterSpec.load(THREE_NODES), "a", scale=0)
    with pytest.raises(UserError, match="at most 62500 nodes"):
        node_address(62500)


def test_without_root_it_says_so() -> None:
    with pytest.raises(UserError, match="testnet needs root"):
        netns.check_host(euid=1000)


def test_the_plan_command_prints_without_root() -> None:
    out = io.StringIO()
    assert testnet.main(["plan", "--cluster", str(THREE_NODES), "--scale", "0.1",
                         "--run-id", "p1"], out) == 0  # fmt: skip
    text = out.getvalue()
    assert "testnet p1: 3 node(s) of testnet_3nodes on bridge mhtbp1" in text
    assert "node 2 (slow; 2 rank(s)): mht-p1-n2 10.213.0.3, NIC 125 MB/s, 50 us" in text
    assert "to node 2 (link fast <-> slow): 50 MB/s, 2000 us" in text


def test_a_nodes_command_gets_its_placeholders() -> None:
    plan = plan_testnet(ClusterSpec.load(THREE_NODES), "c1")
    template = ["torchrun", "--nnodes", "{nnodes}", "--node-rank", "{node}",
                "--nproc-per-node", "{nproc}", "--master-addr={master_addr}", "{address}", "{x}"]  # fmt: skip
    assert node_command(template, plan, plan.nodes[2]) == [
        "torchrun", "--nnodes", "3", "--node-rank", "2", "--nproc-per-node", "2",
        "--master-addr=10.213.0.1", "10.213.0.3", "{x}",
    ]  # fmt: skip


def test_run_without_a_run_or_a_command_is_one_line(tmp_path: pathlib.Path) -> None:
    with pytest.raises(UserError, match="run needs --run-id"):
        testnet.main(["run", "--", "true"])
    plan = plan_testnet(ClusterSpec.load(THREE_NODES), "c1")
    with pytest.raises(UserError, match="needs a command after '--'"):
        run_on_nodes(plan, [], tmp_path, 10.0)


def test_faults_are_the_nodes_cable_rates_and_nftables_drops() -> None:
    plan = plan_testnet(ClusterSpec.load(THREE_NODES), "f1", scale=0.1)
    fast = plan.nodes[0]
    assert network_faults.link_state_commands(fast, up=False) == [
        ["ip", "link", "set", "mhtf1n0", "down"]
    ]
    cut = [" ".join(c) for c in network_faults.rate_commands(fast, 0.1)]
    assert len(cut) == 3  # the NIC's total, its default class and the link to node 2
    assert "classid 1:10 htb rate 100000000bit" in cut[1]
    assert "classid 1:100 htb rate 40000000bit" in cut[2]
    (only,) = network_faults.rate_commands(fast, 0.5, to_node=2)
    assert "classid 1:100 htb rate 200000000bit" in " ".join(only)
    with pytest.raises(UserError, match="node 0 has no shaped link to node 1"):
        network_faults.rate_commands(fast, 0.5, to_node=1)
    loss = [" ".join(c) for c in network_faults.loss_commands(plan, fast, 1.0, to_node=2)]
    assert loss[0].endswith("nft delete table inet megatron_het_testnet")
    assert loss[-1].endswith("ip daddr 10.213.0.3 numgen random mod 10000 < 100 drop")
    assert len(network_faults.loss_commands(plan, fast, 0)) == 1  # only the removal
    with pytest.raises(UserError, match="--loss must be a percentage"):
        network_faults.loss_commands(plan, fast, 120)


def test_a_fault_waits_for_its_iteration(tmp_path: pathlib.Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"iteration": 1}\n{"iteration": 2}\n{"iter')  # a line being written
    network_faults.wait_for_iteration(metrics, 2, timeout_s=5)
    with pytest.raises(UserError, match="did not log iteration 3 within 0.2 s"):
        network_faults.wait_for_iteration(metrics, 3, timeout_s=0.2)


def test_a_fault_without_a_run_is_one_line() -> None:
    with pytest.raises(UserError, match="fault needs --run-id"):
        testnet.main(["fault", "--node", "0", "--link", "down"])
