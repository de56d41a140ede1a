"""The elastic supervisor without processes: the cluster left after a loss, the failure record
and the relaunch it makes (the end-to-end run is in tests/test_faults_cli.py)."""

from __future__ import annotations

import json
import pathlib

import pytest

from megatron_het.arguments import build_parser
from megatron_het.cluster import ClusterSpec
from megatron_het.errors import UserError
from megatron_het.launcher.failure_record import read_failure, write_failure
from megatron_het.launcher.shrink import without_ranks
from megatron_het.launcher.supervisor import PRETRAIN, supervise
from megatron_het.launcher.supervisor_config import read_run_flags

REPO = pathlib.Path(__file__).resolve().parents[2]
EMULATED = REPO / "scripts" / "clusters" / "cpu_emulated.yaml"
HETHUB = REPO / "scripts" / "clusters" / "hethub_llama140b.yaml"


def test_a_lost_device_leaves_the_rest_with_their_links_and_colocation() -> None:
    cluster = ClusterSpec.load(EMULATED)
    left = without_ranks(cluster, [1])
    assert left.world_size == 3
    assert left.accelerator_counts() == {"emu-fast": 1, "emu-slow": 2}
    assert [(g.name, g.nodes, g.devices_per_node, g.colocate_with) for g in left.node_groups] == [
        ("fast-1of2", 1, 1, None),
        ("slow", 1, 2, "fast-1of2"),
    ]
    # the emulated link between the kinds (the colocated host's) is kept
    link = left.group_link("fast-1of2", "slow")
    assert (
        link.emulated and link.bandwidth_gbps == cluster.group_link("fast", "slow").bandwidth_gbps
    )
    # rebuilt from its own file form
    assert ClusterSpec.from_dict(left.to_dict()).to_dict() == left.to_dict()


def test_nodes_that_lost_devices_become_groups_of_their_own() -> None:
    cluster = ClusterSpec.load(HETHUB)  # 16 MI250X nodes, then 80 accelerator-a nodes, 8 each
    left = without_ranks(cluster, [3, 200, 201, 767])
    assert left.world_size == 764
    assert left.accelerator_counts() == {"MI250X": 127, "accelerator-a": 637}
    shapes = {g.name: (g.nodes, g.devices_per_node) for g in left.node_groups}
    assert shapes == {
        "amd-7of8": (1, 7),
        "amd": (15, 8),
        "accel_a": (78, 8),
        "accel_a-6of8": (1, 6),
        "accel_a-7of8": (1, 7),
    }
    # every derived group keeps the cross-kind link
    assert (
        left.group_link("amd-7of8", "accel_a-6of8").bandwidth_gbps
        == cluster.group_link("amd", "accel_a").bandwidth_gbps
    )
    # a whole node lost is gone
    gone = without_ranks(cluster, range(8))
    assert {g.name: g.nodes for g in gone.node_groups} == {"amd": 15, "accel_a": 80}


@pytest.mark.parametrize("lost", [[3, 200, 201, 767], list(range(8)) + [130], [9, 17, 25]])
def test_every_node_left_knows_its_place_in_the_new_cluster(lost: list) -> None:
    """Each node's supervisor of a multi-node job relaunches at the node rank the map gives
    it: that node of the new cluster holds exactly the old node's devices left, by kind."""
    from collections import Counter

    from megatron_het.launcher.shrink import shrink

    cluster = ClusterSpec.load(HETHUB)
    left, placed = shrink(cluster, lost)

    def kinds_by_node(spec: ClusterSpec, skip: set) -> dict[int, Counter]:
        out: dict[int, Counter] = {}
        for info in spec.rank_map():
            if info.rank not in skip:
                out.setdefault(info.node, Counter())[info.accelerator.name] += 1
        return out

    before, after = kinds_by_node(cluster, set(lost)), kinds_by_node(left, set())
    assert sorted(placed.values()) == list(range(left.num_nodes))
    assert set(placed) == set(before)  # a node with nothing left is not placed
    for old, new in placed.items():
        assert after[new] == before[old], (old, new)


def test_bad_losses_are_one_line_errors() -> None:
    cluster = ClusterSpec.load(EMULATED)
    with pytest.raises(UserError, match="not in cluster"):
        without_ranks(cluster, [4])
    with pytest.raises(UserError, match="no device"):
        without_ranks(cluster, range(4))


def _run_args(cmd: list[str]):
    """The run's flags of a launch command as pretrain_llama.py's parser reads them."""
    return build_parser().parse_args(cmd[cmd.index(PRETRAIN) + 1 :])


def test_the_runs_flags_are_read_by_its_own_parser() -> None:
    run = read_run_flags(["--cluster", "a.yaml", "--plan=p.json", "--save", "ck"])
    assert (run.cluster, run.save, run.timeout_minutes) == ("a.yaml", "ck", 10.0)
    assert run.flags == ("--cluster", "a.yaml", "--plan=p.json", "--save", "ck")
    with pytest.raises(UserError, match="unrecognized arguments: --plna"):
        read_run_flags(["--cluster", "a.yaml", "--save", "ck", "--plna", "p.json"])


def test_the_supervisor_relaunches_on_the_devices_left(tmp_path: pathlib.Path) -> None:
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("4")
    launched: list[list[str]] = []

    def launch(cmd: list[str], env=None) -> int:
        launched.append(cmd)
        if len(launched) == 1:  # the first run loses rank 1
            write_failure(save, 7, 4, silent=[1], stuck=[], failed=[0, 3], line="lost")
            return 1
        assert read_failure(save) is None  # the stale record is gone before a launch
        return 0

    said: list[str] = []
    flags = ["--cluster", str(EMULATED), "--plan", "p.json", "--save", str(save)]
    assert supervise(read_run_flags(flags), {}, launch=launch, say=said.append) == 0
    first, second = launched
    assert first[first.index("--nproc_per_node") + 1] == "4"
    assert second[second.index("--nproc_per_node") + 1] == "3"
    assert second[second.index(PRETRAIN) + 1 :][: len(flags)] == flags  # the run's, as given
    relaunch = _run_args(second)
    cluster = relaunch.cluster
    assert cluster == str(save / "elastic" / "cluster_1.yaml")
    assert ClusterSpec.load(cluster).accelerator_counts() == {"emu-fast": 1, "emu-slow": 2}
    assert relaunch.plan == "auto" and relaunch.load == str(save)
    assert len(said) == 1 and "ranks [1] lost" in said[0] and "3 devices left" in said[0]


def test_a_resuming_relaunch_drops_the_first_loads_flags(tmp_path: pathlib.Path) -> None:
    """--finetune / --no-load-optim / --no-load-rng applied to the checkpoint the run started
    from; a relaunch resuming from the run's own checkpoint must not apply them again."""
    save = tmp_path / "ckpt"
    save.mkdir()
    launched: list[list[str]] = []

    def launch(cmd: list[str], env=None) -> int:
        launched.append(cmd)
        if len(launched) < 3:  # each of the first two runs loses a rank
            if len(launched) == 2:  # the second committed a checkpoint first
                (save / "latest_checkpointed_iteration.txt").write_text("4")
            write_failure(save, 7, 4, silent=[len(launched)], stuck=[], failed=[0], line="lost")
            return 1
        return 0

    first_load = ["--finetune", "--no-load-optim", "--no-load-rng"]
    flags = ["--cluster", str(EMULATED), "--save", str(save), "--load", "mlm", *first_load]
    assert supervise(read_run_flags(flags), {}, launch=launch, say=lambda line: None) == 0
    runs = [_run_args(cmd) for cmd in launched]
    # no checkpoint of its own yet: the relaunch starts from the same checkpoint, the same way
    assert [(r.load, r.finetune, r.no_load_optim, r.no_load_rng) for r in runs[:2]] == [
        ("mlm", True, True, True)
    ] * 2
    assert (runs[2].load, runs[2].finetune, runs[2].no_load_optim, runs[2].no_load_rng) == (
        str(save),
        False,
        False,
        False,
    )


def test_the_supervisor_stops_without_a_lost_peer_or_restarts(tmp_path: pathlib.Path) -> None:
    save = tmp_path / "ckpt"
    flags = read_run_flags(["--cluster", str(EMULATED), "--save", str(save)])
    assert supervise(flags, {}, launch=lambda cmd, env: 2, say=print) == 2  # a user error

    def always_lose(cmd: list[str], env=None) -> int:
        write_failure(save, 1, 4, silent=[0], stuck=[], failed=[], line="lost")
        return 1

    said: list[str] = []
    assert supervise(flags, {}, max_restarts=1, launch=always_lose, say=said.append) == 1
    assert "restart 1 of 1" in said[0] and "from the start" in said[0]
    assert "no restart left" in said[1]
    with pytest.raises(UserError, match="needs --cluster"):
        read_run_flags(["--save", str(save)])


# ---- a multi-node job: one supervisor per node --------------------------------------------
from bench.fault_jobs import TWO_NODE_CLUSTER as TWO_NODES  # noqa: E402


def _node_job(tmp_path: pathlib.Path, node_rank: int, lost: list, outcomes: list):
    """Node ``node_rank``'s supervisor of the two-node job; its first launch fails losing
    ``lost`` (the record written as the reporting rank would), later ones end with
    ``outcomes``. Returns (exit status, launched commands, lines said)."""
    from megatron_het.launcher.supervisor import supervise_node
    from megatron_het.launcher.supervisor_config import NodeLaunch

    save = tmp_path / "ckpt"
    save.mkdir(exist_ok=True)
    (save / "latest_checkpointed_iteration.txt").write_text("4")
    cluster = tmp_path / "two_nodes.yaml"
    cluster.write_text(TWO_NODES)
    # the other node's supervisor published its address (it runs elsewhere)
    (save / "elastic" / "nodes").mkdir(parents=True, exist_ok=True)
    for identity, addr in ((0, "host-a"), (1, "host-b")):
        (save / "elastic" / "nodes" / f"node{identity}.json").write_text(
            json.dumps({"node": identity, "addr": addr})
        )
    launched: list[list[str]] = []

    def launch(cmd: list[str], env=None) -> int:
        launched.append(cmd)
        if len(launched) == 1:
            write_failure(
                save,
                7,
                4,
                silent=lost,
                stuck=[],
                failed=[],
                line="lost",
                run_id=cmd[cmd.index("--rdzv_id") + 1],
            )
            return 1
        return outcomes[len(launched) - 2]

    said: list[str] = []
    node = NodeLaunch(node_rank, "host-a", 29500, "host-a" if node_rank == 0 else "host-b", "job7")
    flags = [
        "--cluster",
        str(cluster),
        "--plan",
        "p.json",
        "--save",
        str(save),
        "--distributed-timeout-minutes",
        "0.01",
    ]
    status = supervise_node(
        read_run_flags(flags), node, {}, launch=launch, say=said.append, sleep=lambda s: None
    )
    return status, launched, said


def _arg(cmd: list, name: str) -> str:
    """The value of ``name`` in ``cmd``: its last one, which pretrain_llama.py's parser (and
    torchrun's) keeps."""
    return cmd[len(cmd) - 1 - cmd[::-1].index(name) + 1]


def test_each_node_relaunches_at_its_place_in_the_cluster_left(tmp_path) -> None:
    status, launched, said = _node_job(tmp_path, 1, [3], [0])
    assert status == 0 and len(launched) == 2
    first, second = launched
    assert [
        _arg(first, n)
        for n in (
            "--nnodes",
            "--node_rank",
            "--nproc_per_node",
            "--master_addr",
            "--master_port",
            "--rdzv_id",
        )
    ] == ["2", "1", "2", "host-a", "29500", "job7-0"]
    # one emu-slow device lost: node 1 keeps one rank and its place; master and port move on
    assert [
        _arg(second, n)
        for n in (
            "--nnodes",
            "--node_rank",
            "--nproc_per_node",
            "--master_addr",
            "--master_port",
            "--rdzv_id",
        )
    ] == ["2", "1", "1", "host-a", "29501", "job7-1"]
    left = ClusterSpec.load(_arg(second, "--cluster"))
    assert left.accelerator_counts() == {"emu-fast": 2, "emu-slow": 1}
    assert _arg(second, "--plan") == "auto" and _arg(second, "--load") == str(tmp_path / "ckpt")
    assert said[0].startswith(
        "elastic_run: launch job7-0 ended with status 1; waiting up to 31 s for its failure record"
    )
    assert "this node now node 1 of 2 with 1 ranks, master host-a:29501" in said[1]


def test_when_node_0_is_lost_the_next_node_is_the_master(tmp_path) -> None:
    status, launched, said = _node_job(tmp_path, 1, [0, 1], [0])
    second = launched[1]
    assert [_arg(second, n) for n in ("--nnodes", "--node_rank", "--master_addr")] == [
        "1",
        "0",
        "host-b",
    ]
    (tmp_path / "node0").mkdir()
    status, launched, said = _node_job(tmp_path / "node0", 0, [0, 1], [0])
    assert len(launched) == 1 and status == 1  # node 0 has nothing left: it leaves
    assert "no device of this node (node 0 of the first launch) is left" in said[1]


def test_a_node_without_a_record_of_its_launch_ends_with_the_runs_status(tmp_path) -> None:
    from megatron_het.launcher.supervisor import supervise_node
    from megatron_het.launcher.supervisor_config import NodeLaunch

    save = tmp_path / "ckpt"
    cluster = tmp_path / "two_nodes.yaml"
    cluster.write_text(TWO_NODES)
    save.mkdir()
    # an older job's record with another id is not this launch's
    write_failure(save, 3, 4, silent=[2], stuck=[], failed=[], line="old", run_id="job6-0")
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    flags = ["--cluster", str(cluster), "--save", str(save), "--distributed-timeout-minutes", "0.1"]
    status = supervise_node(
        read_run_flags(flags),
        NodeLaunch(0, "127.0.0.1", 29500, "127.0.0.1", "job7"),
        {},
        launch=lambda cmd, env: 3,
        sleep=sleep,
        clock=lambda: now[0],
    )
    assert status == 3 and now[0] >= 36.0  # waited the timeout + 30 s for another node's


@pytest.mark.parametrize(
    "head, fragment",
    [
        (
            ["--node-rank", "0", "--master-addr", "a"],
            "needs --node-rank, --master-addr and --master-port together",
        ),
        (["--job-id", "j"], "--node-addr and --job-id are for a multi-node job"),
        (
            ["--node-rank", "x", "--master-addr", "a", "--master-port", "1"],
            "--node-rank: takes a non-negative integer",
        ),
        (["--nodes", "2"], "unrecognized arguments: --nodes 2"),
    ],
)
def test_supervisor_flags_that_do_not_make_a_job_are_one_line_errors(head, fragment) -> None:
    from megatron_het.launcher.supervisor import main

    with pytest.raises(UserError, match=fragment):
        main([*head, "--", "--cluster", str(EMULATED), "--save", "ckpt"], environ={})


def test_a_relaunch_leaves_the_lost_device_out_of_the_visible_devices(
    tmp_path,
) -> None:
    """A rank lost with its GPU: the relaunch must not put a rank back on that device."""
    from megatron_het.launcher.supervisor import supervise_node
    from megatron_het.launcher.supervisor_config import NodeLaunch

    cluster = ClusterSpec.load(HETHUB)  # MI250X nodes first, 8 devices each
    environ = {"HIP_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    (tmp_path / "elastic" / "nodes").mkdir(parents=True)
    for identity in range(cluster.num_nodes):
        (tmp_path / "elastic" / "nodes" / f"node{identity}.json").write_text(
            json.dumps({"node": identity, "addr": f"h{identity}"})
        )
    launched: list = []

    def launch(cmd: list[str], env=None) -> int:
        launched.append(env)
        now = ClusterSpec.load(_arg(cmd, "--cluster"))
        mine = [r.rank for r in now.rank_map() if r.node == int(_arg(cmd, "--node_rank"))]
        if len(launched) > 2:
            return 0
        # first the node's device 3 (rank 11) is lost, then the sixth device left
        write_failure(
            tmp_path,
            3,
            now.world_size,
            silent=[mine[3 if len(launched) == 1 else 5]],
            stuck=[],
            failed=[],
            line="lost",
            run_id=_arg(cmd, "--rdzv_id"),
        )
        return 1

    flags = [
        "--cluster",
        str(HETHUB),
        "--save",
        str(tmp_path),
        "--distributed-timeout-minutes",
        "1",
    ]
    assert (
        supervise_node(
            read_run_flags(flags),
            NodeLaunch(1, "h0", 29500, "h1", "j"),
            environ,
            launch=launch,
            say=lambda line: None,
            sleep=lambda s: None,
        )
        == 0
    )
    # the first launch keeps the devices; every launch's ranks record their own errors
    assert launched[0]["HIP_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert all(env["MEGATRON_HET_RECORD_ERRORS"] == "1" for env in launched)
    assert launched[1]["HIP_VISIBLE_DEVICES"] == "0,1,2,4,5,6,7"
    assert launched[2]["HIP_VISIBLE_DEVICES"] == "0,1,2,4,5,7"


def test_cpu_and_emulated_ranks_have_no_devices_to_leave_out() -> None:
    from megatron_het.launcher.supervisor import HostDevices

    cluster = ClusterSpec.load(EMULATED)
    devices = HostDevices(cluster.rank_map(), {"PATH": "/bin"})
    devices.drop([1], without_ranks(cluster, [1]).rank_map())
    assert devices.env() == {"PATH": "/bin", "MEGATRON_HET_RECORD_ERRORS": "1"}


def test_the_first_record_of_a_launch_stands(tmp_path: pathlib.Path) -> None:
    from megatron_het.launcher.failure_record import forget_record

    assert write_failure(tmp_path, 5, 4, [2], [], [], "first", run_id="job-0")
    assert not write_failure(tmp_path, 5, 4, [1, 2], [], [], "second", run_id="job-0")
    assert read_failure(tmp_path)["line"] == "first"
    # the launch's own record holds the content too (a writer killed before the last_failure
    # copy leaves it whole), and nothing else is left in the records directory
    (tmp_path / "last_failure.json").unlink()
    assert read_failure(tmp_path, "job-0")["line"] == "first"
    assert read_failure(tmp_path, "job-9") is None and read_failure(tmp_path) is None
    assert [p.name for p in (tmp_path / "elastic" / "records").iterdir()] == ["job-0"]
    assert write_failure(tmp_path, 9, 3, [1], [], [], "next launch", run_id="job-1")
    assert read_failure(tmp_path)["run_id"] == "job-1"
    assert write_failure(tmp_path, 9, 3, [1], [], [], "no id", run_id="")  # no launch to claim
    assert write_failure(tmp_path, 9, 3, [1], [], [], "no id again", run_id="")
    forget_record(str(tmp_path), "job-0")  # the job id used again by a later job
    assert write_failure(tmp_path, 1, 4, [3], [], [], "reused id", run_id="job-0")
    assert read_failure(tmp_path)["line"] == "reused id"


def test_a_rank_records_its_own_error_only_under_a_supervisor(tmp_path: pathlib.Path) -> None:
    from megatron_het.launcher.failure_record import RECORD_ERRORS_VAR, record_own_error

    save = str(tmp_path)
    env = {"RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "job-0"}
    assert not record_own_error(save, env, UserError("no plan file p.json"))
    assert read_failure(tmp_path) is None  # a run without a supervisor leaves --save alone
    env[RECORD_ERRORS_VAR] = "1"
    assert not record_own_error(None, env, UserError("x"))  # no --save
    assert record_own_error(save, env, UserError("no plan file p.json"))
    record = read_failure(tmp_path)
    assert record["lost_ranks"] == [] and record["failed"] == [3] and record["world_size"] == 4
    assert record["line"] == "rank 3: no plan file p.json" and record["run_id"] == "job-0"
    assert not record_own_error(save, {**env, "RANK": "0"}, SystemExit(2))  # rank 3's stands
    assert record_own_error(save, {**env, "TORCHELASTIC_RUN_ID": "job-1"}, SystemExit(2))
    assert read_failure(tmp_path)["line"] == "rank 3: exited with status 2"


def test_an_error_every_rank_raises_alike_is_recorded_with_the_ranks_it_names(
    tmp_path: pathlib.Path,
) -> None:
    """A start-up problem agreed by every rank: whichever rank records it first, the record
    names the ranks with the problem and its line once."""
    from megatron_het.errors import RanksError
    from megatron_het.launcher.failure_record import RECORD_ERRORS_VAR, record_own_error

    save = str(tmp_path)
    env = {"RANK": "0", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "job-0", RECORD_ERRORS_VAR: "1"}
    line = "ranks 2-3: data file /d.idx does not exist"
    assert record_own_error(save, env, RanksError(line, (2, 3)))
    record = read_failure(tmp_path)
    assert record["failed"] == [2, 3] and record["line"] == line and record["lost_ranks"] == []
    assert record_own_error(
        save, {**env, "TORCHELASTIC_RUN_ID": "job-1"}, RanksError("every rank's problem")
    )
    assert read_failure(tmp_path)["failed"] == [0, 1, 2, 3]


def test_a_node_supervisor_stops_at_once_when_the_run_failed_on_its_own(
    tmp_path: pathlib.Path,
) -> None:
    from megatron_het.launcher.supervisor import supervise_node
    from megatron_het.launcher.supervisor_config import NodeLaunch

    save = tmp_path / "ckpt"
    cluster = tmp_path / "two_nodes.yaml"
    cluster.write_text(TWO_NODES)
    waited: list[float] = []

    def launch(cmd: list[str], env=None) -> int:
        write_failure(
            save, -1, 4, [], [], [2], "rank 2: CUDA out of memory", run_id=_arg(cmd, "--rdzv_id")
        )
        return 1

    said: list[str] = []
    flags = ["--cluster", str(cluster), "--save", str(save)]  # a 10-minute timeout
    status = supervise_node(
        read_run_flags(flags),
        NodeLaunch(0, "host-a", 29500, "host-a", "j"),
        {},
        launch=launch,
        say=said.append,
        sleep=waited.append,
    )
    assert status == 1 and waited == []  # the record was there: no wait for a lost peer's
    assert said[-1] == (
        "elastic_run: the run ended with an error of its own (rank 2: CUDA out "
        "of memory), not a lost peer: no relaunch; exit status 1"
    )
