"""The per-node launch without processes: what a node of each mix would run (its per-vendor
environment and its torchrun, supervisor or Slurm commands), the mix settings files, and the
one-line errors of a launch that cannot work. The scripts themselves, the dry runs and the
Slurm steps' processes are in tests/test_launch_scripts.py."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from megatron_het.errors import UserError
from megatron_het.launcher.launch_options import launch_config, parse_flags
from megatron_het.launcher.mix import KEYS, load_mix
from megatron_het.launcher.node_launch import Launch, perform, plan_launch

REPO = Path(__file__).resolve().parents[2]
_NODE = {"NODE_RANK": "0", "MASTER_ADDR": "n0", "DATA_PATH": "/d", "CHECKPOINT_DIR": "/c"}
_TRAINING = {"DATA_PATH": "/data/corpus_text_document", "CHECKPOINT_DIR": "/ckpt"}


def mix_file(mix: str) -> Path:
    found = sorted((REPO / "scripts" / mix).glob("mix_*.yaml"))
    assert found, f"no settings file for mix {mix}"
    return found[0]


def _no_shell(path: str, environ: dict) -> dict:
    raise AssertionError(f"nothing is sourced in this launch, but {path} was")


def launch(mix: str, *args: str, source=_no_shell, **env: str) -> Launch:
    """What a node of ``mix`` runs with the script's ``args`` and exactly the variables
    ``env`` (this host's name: ``thishost``); ``source=None`` sources shell files for real."""
    flags = parse_flags([str(mix_file(mix)), *args])
    config = launch_config(flags, env, "python")
    sourcing = {} if source is None else {"source": source}
    return plan_launch(config, REPO, env, "thishost.example.org", **sourcing)


def node(mix: str, *args: str, **env: str) -> tuple[dict, str]:
    """(the environment changes, the command line) of a node of ``mix`` (MASTER_ADDR node0)."""
    done = launch(mix, *args, **{**_TRAINING, "MASTER_ADDR": "node0", **env})
    assert len(done.commands) == 1
    return dict(done.changes), " ".join(done.commands[0])


def test_vendor_settings_follow_the_node_group() -> None:
    nvidia, cmd = node("a100_mi250x", NODE_RANK="0")
    assert nvidia["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert "NCCL_IB_TIMEOUT" in nvidia and not any(k.startswith("HSA_") for k in nvidia)
    assert "--nnodes 8 --nproc_per_node 8 --node_rank 0 --master_addr node0" in cmd
    assert "--rdzv_backend static pretrain_llama.py" in cmd
    amd, cmd = node("a100_mi250x", NODE_RANK="5")
    assert amd["HIP_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and amd["HSA_NO_SCRATCH_RECLAIM"]
    assert "CUDA_VISIBLE_DEVICES" not in amd and "--node_rank 5" in cmd
    ascend, _ = node("a100_ascend910b", NODE_RANK="11")
    assert ascend["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert "HCCL_CONNECT_TIMEOUT" in ascend and "NCCL_IB_TIMEOUT" not in ascend
    site, _ = node("h100_mi300x", NODE_RANK="4", HET_SOCKET_IFNAME="ib0", NCCL_IB_GID_INDEX="5")
    assert site["NCCL_SOCKET_IFNAME"] == "ib0" and site["GLOO_SOCKET_IFNAME"] == "ib0"
    # A site's own value is kept: the launcher does not change it (changes are what it lists).
    assert "NCCL_IB_GID_INDEX" not in site
    assert set(site) == {
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "GLOO_SOCKET_IFNAME",
        "HIP_VISIBLE_DEVICES",
        "HSA_FORCE_FINE_GRAIN_PCIE",
        "HSA_NO_SCRATCH_RECLAIM",
        "NCCL_DEBUG",
        "NCCL_SOCKET_IFNAME",
        "OMP_NUM_THREADS",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }


def test_an_ascend_node_sources_cann_and_every_node_the_sites_file_last(tmp_path) -> None:
    """CANN's set_env.sh (beside ASCEND_TOOLKIT_HOME) before the Ascend settings, whose
    defaults it may set; HET_EXTRA_ENV through bash after everything: what it exports, changes
    or unsets is the ranks' environment."""
    toolkit = tmp_path / "ascend" / "latest"
    toolkit.mkdir(parents=True)
    (tmp_path / "ascend" / "set_env.sh").write_text(
        'export HCCL_BUFFSIZE=400\nexport LD_LIBRARY_PATH="/cann/lib${LD_LIBRARY_PATH:+:}"\n'
    )
    extra = tmp_path / "site.sh"
    extra.write_text(
        'if [ -n "$HCCL_BUFFSIZE" ]; then export SITE_SAW=$HCCL_EXEC_TIMEOUT; fi\n'
        "export NCCL_DEBUG=INFO\nunset OMP_NUM_THREADS\nplain=not-exported\n"
    )
    env = launch(
        "a100_ascend910b",
        source=None,
        **{**_NODE, "NODE_RANK": "4"},
        ASCEND_TOOLKIT_HOME=str(toolkit),
        HET_EXTRA_ENV=str(extra),
        PATH="/usr/bin:/bin",
    ).env
    assert env["HCCL_BUFFSIZE"] == "400" and env["LD_LIBRARY_PATH"] == "/cann/lib"
    assert env["HCCL_CONNECT_TIMEOUT"] == "1200" and env["SITE_SAW"] == "1800"
    assert env["NCCL_DEBUG"] == "INFO" and "OMP_NUM_THREADS" not in env and "plain" not in env
    broken = tmp_path / "broken.sh"
    broken.write_text("echo 'no such tool' >&2\nfalse\n")
    with pytest.raises(UserError, match=f"sourcing {broken} failed with status 1: no such tool"):
        launch("h100_a100", source=None, **_NODE, HET_EXTRA_ENV=str(broken), PATH="/bin")


def test_training_command_carries_the_megatron_flags() -> None:
    _, cmd = node(
        "h200_mi300x", "--train-iters", "20", NODE_RANK="2", TOKENIZER_MODEL="/tok/tokenizer.model"
    )
    for flag in (
        "--plan scripts/h200_mi300x/plan_70b.json",
        "--cluster scripts/clusters/h200_mi300x.yaml",
        "--data-path /data/corpus_text_document",
        "--tokenizer-model /tok/tokenizer.model",
        "--save /ckpt",
        "--load /ckpt",
        "--lr-decay-style cosine",
        "--tensorboard-dir /ckpt/logs/tensorboard",
        "--metrics-file /ckpt/logs/metrics.jsonl",
        "--bridge relay",
    ):
        assert flag in cmd, flag
    assert cmd.endswith("--train-iters 20")
    _, cmd = node("h100_a100", NODE_RANK="0")
    assert "--bridge direct" in cmd  # one vendor: NCCL spans both kinds
    # after "--" everything is pretrain_llama.py's, a flag the launcher knows too
    _, cmd = node("h100_a100", "--", "--dry-run", NODE_RANK="0", DATA_PATH="w1 /a w2 /b")
    assert "--data-path w1 /a w2 /b --split" in cmd and cmd.endswith("--dry-run")


def test_a_dry_run_needs_no_data_or_checkpoints() -> None:
    done = launch("h100_mi300x", "--dry-run")
    (cmd,) = done.commands
    assert cmd[:2] == ("python", "pretrain_llama.py") and cmd[-1] == "--dry-run"
    assert "--mock-data" in cmd and "--save" not in cmd and not done.changes


_SLURM = {"LAUNCHER": "slurm", "SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "6"}


def test_slurm_fans_out_one_task_per_node_then_runs_torchrun() -> None:
    done = launch("h200_mi300x", "--train-iters", "5", **_TRAINING, **_SLURM)
    (cmd,) = done.commands
    assert " ".join(cmd).startswith("srun --nodes=6 --ntasks=6 --ntasks-per-node=1")
    assert cmd[-4:] == (
        "bash",
        str(REPO / "scripts/h200_mi300x/pretrain_llama_70b.sh"),
        "--train-iters",
        "5",
    )
    env, cmd = node("h200_mi300x", HET_SLURM_NODE="1", SLURM_NODEID="3", **_SLURM)
    assert "--nnodes 6 --nproc_per_node 8 --node_rank 3" in cmd and "HIP_VISIBLE_DEVICES" in env


def test_slurm_nodes_take_their_place_in_node_order() -> None:
    """Slurm numbers nodes in its own order; NODE_ORDER puts them in the cluster file's."""
    slurm = {**_SLURM, "HET_SLURM_NODE": "1", "SLURM_NODEID": "0"}
    order = "h200-1,h200-2 mi-1 mi-2,mi-3,mi-4"
    env, cmd = node("h200_mi300x", SLURMD_NODENAME="mi-2", NODE_ORDER=order, **slurm)
    assert "--node_rank 3 --master_addr node0" in cmd and "HIP_VISIBLE_DEVICES" in env, cmd
    done = launch("h200_mi300x", **_TRAINING, SLURMD_NODENAME="h200-2", NODE_ORDER=order, **slurm)
    cmd = " ".join(done.commands[0])
    assert "--node_rank 1 --master_addr h200-1" in cmd and "CUDA_VISIBLE_DEVICES" in done.changes
    # without NODE_ORDER: Slurm's node index and the allocation's first host
    done = launch("h200_mi300x", **_TRAINING, **slurm, SLURM_JOB_NODELIST="a1,a2,m1,m2,m3,m4")
    assert "--node_rank 0 --master_addr a1" in " ".join(done.commands[0])
    # SLURMD_NODENAME defaults to this host's short name
    done = launch("h200_mi300x", **_TRAINING, **slurm, NODE_ORDER="x thishost y z w v")
    assert "--node_rank 1 --master_addr x" in " ".join(done.commands[0])


def test_slurm_fanout_of_an_elastic_job_outlives_a_lost_node() -> None:
    (cmd,) = launch("h200_mi300x", **_TRAINING, **_SLURM).commands
    assert "--kill-on-bad-exit=1 --export=ALL,HET_SLURM_NODE=1" in " ".join(cmd)
    assert "--no-kill" not in cmd
    (cmd,) = launch("h200_mi300x", **_TRAINING, **_SLURM, ELASTIC="1").commands
    assert "--kill-on-bad-exit=0 --no-kill --export=ALL,HET_SLURM_NODE=1" in " ".join(cmd)


_HET_JOB = {
    "LAUNCHER": "slurm",
    "SLURM_JOB_ID": "42",
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "h200-1,h200-2",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "mi-1,mi-2,mi-3,mi-4",
}


def test_a_heterogeneous_slurm_job_runs_one_step_per_component() -> None:
    """sbatch --nodes=2 ... : --nodes=4 ...: one srun step per component, and the components'
    hosts in order as the node order every node task takes its place in."""
    done = launch("h200_mi300x", **_NODE, **_HET_JOB)
    steps = [" ".join(step) for step in done.commands]
    assert [step.split(" --kill-on-bad-exit")[0] for step in steps] == [
        "srun --het-group=0 --nodes=2 --ntasks=2 --ntasks-per-node=1",
        "srun --het-group=1 --nodes=4 --ntasks=4 --ntasks-per-node=1",
    ]
    assert all(step.endswith("scripts/h200_mi300x/pretrain_llama_70b.sh") for step in steps)
    assert done.changes == {"NODE_ORDER": "h200-1 h200-2 mi-1 mi-2 mi-3 mi-4"}
    assert done.env["NODE_ORDER"] == done.changes["NODE_ORDER"] and not done.elastic
    reordered = "mi-1 h200-2 h200-1 mi-2 mi-3 mi-4"  # given: the same hosts, kept as given
    done = launch("h200_mi300x", **_NODE, **_HET_JOB, NODE_ORDER=reordered)
    assert len(done.commands) == 2 and not done.changes
    env, cmd = node(
        "h200_mi300x",
        HET_SLURM_NODE="1",
        SLURMD_NODENAME="mi-1",
        NODE_ORDER="h200-1 h200-2 mi-1 mi-2 mi-3 mi-4",
        **{**_HET_JOB, "MASTER_ADDR": ""},
    )
    assert "--node_rank 2 --master_addr h200-1" in cmd and "HIP_VISIBLE_DEVICES" in env, cmd


def test_bracketed_host_lists_are_expanded_by_scontrol() -> None:
    from megatron_het.launcher.slurm import host_names

    calls = []

    def scontrol(cmd, **kwargs):
        import subprocess

        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="a1\na2\nm1\n")

    assert host_names("a[1-2],m1", run=scontrol) == ["a1", "a2", "m1"]
    assert calls == [["scontrol", "show", "hostnames", "a[1-2],m1"]]
    assert host_names(" a1, a2 m1 ", run=scontrol) == ["a1", "a2", "m1"] and len(calls) == 1


def test_elastic_runs_one_supervisor_per_node() -> None:
    _, cmd = node("h200_mi300x", NODE_RANK="3", ELASTIC="1", NODE_ADDR="node3", MAX_RESTARTS="2")
    assert (
        "tools/elastic_run.py --max-restarts 2 --node-rank 3 --master-addr node0 "
        "--master-port 29500 --node-addr node3 -- --model"
    ) in cmd, cmd
    assert "torch.distributed.run" not in cmd and "pretrain_llama.py" not in cmd
    assert "--save /ckpt" in cmd and "--cluster scripts/clusters/h200_mi300x.yaml" in cmd
    _, cmd = node("h200_mi300x", NODE_RANK="3", ELASTIC="1")
    assert "--max-restarts 3 " in cmd and "--node-addr thishost.example.org --" in cmd


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"LAUNCHER": "slurm", "SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "3"}, "needs 6"),
        ({"LAUNCHER": "slurm"}, "Slurm allocation"),
        ({"LAUNCHER": "mpirun"}, "torchrun or slurm"),
        ({"NODE_RANK": "6"}, "NODE_RANK 6 is outside"),
        ({"NODE_RANK": "x"}, "NODE_RANK must be an integer of at least 0, got 'x'"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT must be an integer of at least 1"),
        ({"DATA_PATH": ""}, "DATA_PATH is not set"),
        ({"CHECKPOINT_DIR": ""}, "CHECKPOINT_DIR is not set"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
        ({"NODE_RANK": ""}, "NODE_RANK is not set"),
        ({"PLAN": "/nonexistent/plan.json"}, "plan file"),
        ({"CLUSTER": "/nonexistent/c.yaml"}, "cluster file /nonexistent/c.yaml not found"),
        (
            {
                "LAUNCHER": "slurm",
                "SLURM_JOB_ID": "1",
                "SLURM_JOB_NUM_NODES": "6",
                "NODE_ORDER": "a b c",
            },
            "NODE_ORDER lists 3 hosts but cluster h200_mi300x.yaml has 6",
        ),
        (
            {
                "LAUNCHER": "slurm",
                "SLURM_JOB_ID": "1",
                "HET_SLURM_NODE": "1",
                "SLURMD_NODENAME": "x",
                "NODE_ORDER": "a b c d e f",
            },
            "this node (x) is not in NODE_ORDER",
        ),
        (
            {"LAUNCHER": "slurm", "SLURM_JOB_ID": "1", "HET_SLURM_NODE": "1"},
            "SLURM_NODEID is not set",
        ),
        (
            {**_HET_JOB, "SLURM_JOB_NODELIST_HET_GROUP_1": "mi-1,mi-2"},
            "the heterogeneous job's 2 components have 4 nodes (2 2) but cluster h200_mi300x.yaml "
            "needs 6",
        ),
        (
            {**_HET_JOB, "SLURM_JOB_NODELIST_HET_GROUP_1": ""},
            "SLURM_JOB_NODELIST_HET_GROUP_1 is not",
        ),
        (
            {**_HET_JOB, "NODE_ORDER": "h200-1 h200-2 mi-1 mi-2 mi-3 mi-9"},
            "NODE_ORDER (h200-1 h200-2 mi-1 mi-2 mi-3 mi-9) does not list the heterogeneous job's "
            "hosts (h200-1 h200-2 mi-1 mi-2 mi-3 mi-4)",
        ),
        (
            {
                **_HET_JOB,
                "SLURM_JOB_NODELIST_HET_GROUP_0": "a,b,c",
                "SLURM_JOB_NODELIST_HET_GROUP_1": "d,e,f",
            },
            "component 0 ends at node 3 of cluster h200_mi300x.yaml, inside a run of nodes "
            "of one kind (runs of 2 4 nodes",
        ),
        (
            {
                "LAUNCHER": "slurm",
                "SLURM_JOB_ID": "1",
                "HET_SLURM_NODE": "1",
                "SLURM_NODEID": "0",
                "SLURM_GPUS_ON_NODE": "4",
            },
            "Slurm gave node 0 4 GPUs but it runs 8 GPU ranks; submit with sbatch --gpus-per-node=8",
        ),
    ],
)
def test_launch_mistakes_are_one_line_errors(env: dict[str, str], expected: str) -> None:
    with pytest.raises(UserError) as error:
        launch("h200_mi300x", **{**_NODE, **env})
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_node_of_gpu_and_cpu_ranks_exposes_and_counts_its_gpus_only() -> None:
    """The GPU check's pair (one H200 rank and one CPU rank on one node): one GPU visible,
    Slurm's GPU count compared with the one GPU rank, not with both ranks."""
    env, cmd = node(
        "h200_mi300x",
        CLUSTER="scripts/gpu_check/h200_cpu_pair.yaml",
        PLAN="scripts/gpu_check/pair_pp2.json",
        SLURM_GPUS_ON_NODE="1",
        LAUNCHER="slurm",
        SLURM_JOB_ID="1",
        HET_SLURM_NODE="1",
        SLURM_NODEID="0",
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and "--nproc_per_node 2" in cmd, (env, cmd)


def test_print_only_lists_the_changes_and_the_commands(capsys) -> None:
    done = Launch(
        (("srun", "--het-group=0", "a b"), ("srun", "--het-group=1")),
        {"X": "1"},
        {"NODE_ORDER": "h1 h2", "A": "x"},
        note="[launch] a node",
    )
    out = io.StringIO()
    assert perform(done, print_only=True, cwd=REPO, out=out) == 0
    assert out.getvalue().splitlines() == [
        "export NODE_ORDER='h1 h2'",
        "export A=x",
        "+ srun --het-group=0 'a b'",
        "+ srun --het-group=1",
    ]
    assert capsys.readouterr().err == "[launch] a node\n"


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda text: text.replace("bridge: relay", "bridge: tcp"), "bridge must be relay or"),
        (lambda text: text + "nodes: 8\n", "unknown key(s) nodes; the keys are name, size"),
        (lambda text: text.replace("warmup_iters", "# warmup"), "lacks warmup_iters; add"),
        (lambda text: text.replace("seq_length: 4096", "seq_length: 4k"), "seq_length must be"),
        (lambda text: text.replace("lr: 1.5e-4", "lr: fast"), "lr must be a number, got 'fast'"),
        (lambda text: "- a list\n", "must map setting names to values"),
    ],
)
def test_mix_file_mistakes_are_one_line_errors(tmp_path, edit, expected) -> None:
    text = mix_file("h100_mi300x").read_text()
    assert "bridge: relay" in text and "lr: 1.5e-4" in text
    broken = tmp_path / "mix_70b.yaml"
    broken.write_text(edit(text))
    with pytest.raises(UserError) as error:
        load_mix(broken)
    assert expected in str(error.value) and "\n" not in str(error.value), error.value


def test_every_mix_setting_is_a_key_of_every_mix_file() -> None:
    import yaml

    for path in sorted(REPO.glob("scripts/*/mix_*.yaml")):
        assert tuple(yaml.safe_load(path.read_text())) == KEYS, path


def test_the_launcher_does_not_import_training() -> None:
    from tests.unit.test_import_graph import import_graph

    found = {
        name: sorted(t for t in targets if t.startswith("megatron_het.training"))
        for name, targets in import_graph().items()
        if name.startswith("megatron_het.launcher")
    }
    assert {name: targets for name, targets in found.items() if targets} == {}
