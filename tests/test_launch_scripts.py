"""The per-mix launch scripts: shape, syntax, dry runs against their plans, per-vendor settings.

Every scripts/<mix>/pretrain_llama_<size>.sh is a short file of the mix's settings that sources
the shared body (scripts/common/launch.sh); it must pass ``bash -n`` and its dry run
(``DRY_RUN=1``: pretrain_llama.py --dry-run validates plan, cluster, model and batch together);
an edited, broken copy of a plan must make the dry run fail with one ``error:`` line.
``--print-only`` shows what a node would run, which checks the vendor settings chosen by the
node's group and the torchrun/Slurm commands without any process being started.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(REPO.glob("scripts/*/pretrain_llama_*.sh"))
# Clusters that are not launched from here: the emulated one (make demo runs it) and the
# 16,384-device one, an example for planning at scale.
NOT_LAUNCHED = {"cpu_emulated", "h100_mi300x_a100_16k"}
MIXES = sorted(
    p.stem for p in (REPO / "scripts" / "clusters").glob("*.yaml") if p.stem not in NOT_LAUNCHED
)
# Variables the scripts read or export: the tests start from an environment without them.
_SCRUB_PREFIXES = ("NCCL_", "HSA_", "HCCL_", "ASCEND_", "SLURM_", "HET_", "TORCH_NCCL_")
_SCRUB = {
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DATA_PATH",
    "TOKENIZER_MODEL",
    "CHECKPOINT_DIR",
    "LOG_DIR",
    "TENSORBOARD_DIR",
    "CLUSTER",
    "PLAN",
    "BRIDGE",
    "LAUNCHER",
    "DRY_RUN",
    "PRINT_ONLY",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "TRAIN_ITERS",
    "NULL_VOCAB_SIZE",
    "PYTHON",
    "OMP_NUM_THREADS",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "ELASTIC",
    "MAX_RESTARTS",
    "NODE_ADDR",
    "NODE_ORDER",
    "SLURMD_NODENAME",
}


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith(_SCRUB_PREFIXES)
    }
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


def _run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args],
        cwd=REPO,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _script(mix: str) -> Path:
    found = sorted((REPO / "scripts" / mix).glob("pretrain_llama_*.sh"))
    assert found, f"no launch script for mix {mix}"
    return found[0]


def _dry_run_available() -> bool:
    from megatron_het.arguments import build_parser

    return "--dry-run" in build_parser().format_help()


def test_every_mix_has_a_script_and_plan() -> None:
    assert len(MIXES) >= 7
    for mix in MIXES:
        script = _script(mix)
        size = script.stem.removeprefix("pretrain_llama_")
        assert (REPO / "scripts" / mix / f"plan_{size}.json").is_file()
        assert os.access(script, os.X_OK), f"{script} is not executable"


# What a mix script sets before it sources the shared body.
SETTINGS = (
    "HET_MIX",
    "HET_SIZE",
    "HET_CLUSTER",
    "HET_PLAN",
    "HET_MODEL",
    "HET_SEQ_LENGTH",
    "HET_NULL_VOCAB",
    "HET_BRIDGE",
    "HET_LR",
    "HET_MIN_LR",
    "HET_WARMUP_ITERS",
)


def _settings(script: Path) -> dict[str, str]:
    out = {}
    for line in script.read_text().splitlines():
        name, eq, value = line.partition("=")
        if eq and name in SETTINGS:
            out[name] = value.split("#")[0].strip()
    return out


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.parent.name)
def test_mix_script_is_its_settings_and_the_shared_body(script: Path) -> None:
    from megatron_het.cluster import ClusterSpec

    text = script.read_text()
    assert len(text.splitlines()) <= 40 and 'het_main "$@"' in text
    assert "common/launch.sh" in text and "het_env_" not in text and "HET_ARGS" not in text
    settings = _settings(script)
    assert set(settings) == set(SETTINGS), set(SETTINGS) - set(settings)
    assert script == REPO / "scripts" / settings["HET_MIX"] / (
        f"pretrain_llama_{settings['HET_SIZE']}.sh"
    )
    assert (REPO / settings["HET_PLAN"]).is_file()
    cluster = ClusterSpec.load(REPO / settings["HET_CLUSTER"])
    assert f"#SBATCH --nodes={cluster.num_nodes}\n" in text
    # Slurm's cgroups hide devices a job did not request: a mix of GPUs only asks for them
    vendors = {cluster.accelerator_of(r).vendor for r in range(cluster.world_size)}
    per_node = {node.nproc for node in cluster.nodes()}
    if vendors <= {"nvidia", "amd"} and len(per_node) == 1:
        assert f"#SBATCH --gpus-per-node={per_node.pop()}\n" in text
    else:
        # ... and one of other GRES shows the heterogeneous job, a component per node group
        assert "--gpus-per-node" not in text and "submit a heterogeneous job" in text
        lines = text.splitlines()
        first = next(i for i, line in enumerate(lines) if line.startswith("#   sbatch "))
        example = " ".join(line.lstrip("# ").rstrip(" \\") for line in lines[first : first + 3])
        parts = example.removeprefix("sbatch ").split(" : ")
        assert [re.sub(r" --gres=\S+", "", part) for part in parts[:-1]] + [
            re.sub(r" --gres=\S+ \S+$", "", parts[-1])
        ] == [
            f"--nodes={group.nodes} --exclusive --ntasks-per-node=1"
            for group in cluster.node_groups
        ], example
        assert example.endswith(f" {script.relative_to(REPO)}"), example


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.parent.name)
def test_bash_syntax_and_strict_mode(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "set -euo pipefail" in script.read_text()


def test_common_helpers_bash_syntax() -> None:
    for helper in sorted((REPO / "scripts" / "common").glob("*.sh")):
        result = subprocess.run(["bash", "-n", str(helper)], capture_output=True, text=True)
        assert result.returncode == 0, f"{helper}: {result.stderr}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.parent.name)
@pytest.mark.slow
def test_dry_run_validates_plan_cluster_and_model(script: Path) -> None:
    if not _dry_run_available():
        pytest.skip("pretrain_llama.py has no --dry-run yet")
    result = _run(script, DRY_RUN="1")
    assert result.returncode == 0, result.stderr
    assert "plan, cluster, model and batch are consistent" in result.stdout
    assert f"on cluster {script.parent.name}" in result.stdout


def _drop_last_layer(plan: dict) -> None:
    for pipeline in plan["pipelines"]:
        pipeline["stages"][-1]["layers"][1] -= 1


def _drop_a_pipeline(plan: dict) -> None:
    plan["pipelines"].pop()


@pytest.mark.parametrize(
    "break_plan, expected",
    [(_drop_last_layer, "on no stage"), (_drop_a_pipeline, "give every rank")],
)
@pytest.mark.slow
def test_broken_plan_fails_with_one_error_line(
    tmp_path: Path, break_plan: Callable[[dict], None], expected: str
) -> None:
    if not _dry_run_available():
        pytest.skip("pretrain_llama.py has no --dry-run yet")
    script = _script("h100_mi300x")
    plan = json.loads(next(script.parent.glob("plan_*.json")).read_text())
    break_plan(plan)
    broken = tmp_path / "broken_plan.json"
    broken.write_text(json.dumps(plan))
    result = _run(script, "--dry-run", PLAN=str(broken))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


def _print_only(mix: str, *args: str, **env: str) -> tuple[dict[str, str], str]:
    """(exported variables, command line) that the script prints with PRINT_ONLY=1."""
    base = {
        "DATA_PATH": "/data/corpus_text_document",
        "CHECKPOINT_DIR": "/ckpt",
        "MASTER_ADDR": "node0",
        "PRINT_ONLY": "1",
    }
    base.update(env)
    result = _run(_script(mix), *args, **base)
    assert result.returncode == 0, result.stderr
    exported, command = {}, ""
    for line in result.stdout.splitlines():
        if line.startswith("declare -x ") and "=" in line:
            name, _, value = line[len("declare -x ") :].partition("=")
            exported[name] = value.strip('"')
        elif line.startswith("+ "):
            command = line
    return exported, command


def test_vendor_settings_follow_the_node_group() -> None:
    nvidia, cmd = _print_only("a100_mi250x", NODE_RANK="0")
    assert nvidia["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert "NCCL_IB_TIMEOUT" in nvidia and not any(k.startswith("HSA_") for k in nvidia)
    assert "--nnodes 8 --nproc_per_node 8 --node_rank 0 --master_addr node0" in cmd
    amd, cmd = _print_only("a100_mi250x", NODE_RANK="5")
    assert amd["HIP_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and amd["HSA_NO_SCRATCH_RECLAIM"]
    assert "CUDA_VISIBLE_DEVICES" not in amd and "--node_rank 5" in cmd
    ascend, _ = _print_only("a100_ascend910b", NODE_RANK="11")
    assert ascend["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert "HCCL_CONNECT_TIMEOUT" in ascend and "NCCL_IB_TIMEOUT" not in ascend
    site, _ = _print_only(
        "h100_mi300x", NODE_RANK="4", HET_SOCKET_IFNAME="ib0", NCCL_IB_GID_INDEX="5"
    )
    assert site["NCCL_SOCKET_IFNAME"] == "ib0" and site["GLOO_SOCKET_IFNAME"] == "ib0"
    # A site's own value is kept: the script does not change it (changes are what it lists).
    assert "NCCL_IB_GID_INDEX" not in site


def test_training_command_carries_the_megatron_flags() -> None:
    _, cmd = _print_only(
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
    _, cmd = _print_only("h100_a100", NODE_RANK="0")
    assert "--bridge direct" in cmd  # one vendor: NCCL spans both kinds


def test_slurm_fans_out_one_task_per_node_then_runs_torchrun() -> None:
    slurm = {"LAUNCHER": "slurm", "SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "6"}
    _, cmd = _print_only("h200_mi300x", **slurm)
    assert cmd.startswith("+ srun --nodes=6 --ntasks=6 --ntasks-per-node=1")
    assert cmd.endswith("scripts/h200_mi300x/pretrain_llama_70b.sh")
    env, cmd = _print_only("h200_mi300x", HET_SLURM_NODE="1", SLURM_NODEID="3", **slurm)
    assert "--nnodes 6 --nproc_per_node 8 --node_rank 3" in cmd and "HIP_VISIBLE_DEVICES" in env


def test_slurm_nodes_take_their_place_in_node_order() -> None:
    """Slurm numbers nodes in its own order; NODE_ORDER puts them in the cluster file's."""
    slurm = {
        "LAUNCHER": "slurm",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NUM_NODES": "6",
        "HET_SLURM_NODE": "1",
        "SLURM_NODEID": "0",
        "MASTER_ADDR": "",
        "NODE_ORDER": "h200-1,h200-2 mi-1 mi-2,mi-3,mi-4",
    }
    env, cmd = _print_only("h200_mi300x", SLURMD_NODENAME="mi-2", **slurm)
    assert "--node_rank 3 --master_addr h200-1" in cmd and "HIP_VISIBLE_DEVICES" in env, cmd
    env, cmd = _print_only("h200_mi300x", SLURMD_NODENAME="h200-2", **slurm)
    assert "--node_rank 1 --master_addr h200-1" in cmd and "CUDA_VISIBLE_DEVICES" in env, cmd


def test_slurm_fanout_of_an_elastic_job_outlives_a_lost_node() -> None:
    slurm = {"LAUNCHER": "slurm", "SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "6"}
    _, cmd = _print_only("h200_mi300x", **slurm)
    assert "--kill-on-bad-exit=1 --export" in cmd and "--no-kill" not in cmd
    _, cmd = _print_only("h200_mi300x", ELASTIC="1", **slurm)
    assert "--kill-on-bad-exit=0 --no-kill --export" in cmd


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
    result = _run(
        _script("h200_mi300x"), **{**_NODE, "MASTER_ADDR": "", "PRINT_ONLY": "1", **_HET_JOB}
    )
    assert result.returncode == 0, result.stderr
    steps = [line for line in result.stdout.splitlines() if line.startswith("+ ")]
    assert [step.split(" --kill-on-bad-exit")[0] for step in steps] == [
        "+ srun --het-group=0 --nodes=2 --ntasks=2 --ntasks-per-node=1",
        "+ srun --het-group=1 --nodes=4 --ntasks=4 --ntasks-per-node=1",
    ]
    assert all(step.endswith("scripts/h200_mi300x/pretrain_llama_70b.sh") for step in steps)
    assert 'declare -x NODE_ORDER="h200-1 h200-2 mi-1 mi-2 mi-3 mi-4"' in result.stdout
    reordered = "mi-1 h200-2 h200-1 mi-2 mi-3 mi-4"  # given: the same hosts, kept as given
    result = _run(
        _script("h200_mi300x"),
        **{**_NODE, "MASTER_ADDR": "", "PRINT_ONLY": "1", **_HET_JOB, "NODE_ORDER": reordered},
    )
    assert result.returncode == 0 and "--het-group=1" in result.stdout, result.stderr
    env, cmd = _print_only(
        "h200_mi300x",
        HET_SLURM_NODE="1",
        SLURMD_NODENAME="mi-1",
        NODE_ORDER="h200-1 h200-2 mi-1 mi-2 mi-3 mi-4",
        **{**_HET_JOB, "MASTER_ADDR": ""},
    )
    assert "--node_rank 2 --master_addr h200-1" in cmd and "HIP_VISIBLE_DEVICES" in env, cmd


def _fake_srun(tmp_path: Path) -> dict[str, str]:
    """An srun on PATH whose step for component FAKE_FAIL_GROUP fails with status 3 after
    0.2 s and whose other steps run for FAKE_STEP_S seconds (ending early, status 143, on
    SIGTERM); each writes its start and end to tmp_path/steps."""
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(f"""#!/usr/bin/env bash
group="${{1#--het-group=}}"
log="{tmp_path}/steps"
echo "$group started" >> "$log"
if [ "$group" = "$FAKE_FAIL_GROUP" ]; then sleep 0.2; echo "$group failed" >> "$log"; exit 3; fi
sleep "$FAKE_STEP_S" &
trap 'kill $!; sleep 0.3; echo "$group stopped" >> "$log"; exit 143' TERM
wait $!
echo "$group done" >> "$log"
""")
    srun.chmod(0o755)
    return {"PATH": f"{srun.parent}:{os.environ['PATH']}"}


@pytest.mark.parametrize("elastic", ["0", "1"])
def test_a_failed_component_step_ends_a_plain_job_and_not_an_elastic_one(
    tmp_path: Path, elastic: str
) -> None:
    env = {
        **_NODE,
        "MASTER_ADDR": "",
        **_HET_JOB,
        **_fake_srun(tmp_path),
        "ELASTIC": elastic,
        "FAKE_FAIL_GROUP": "1",
        "FAKE_STEP_S": "60" if elastic == "0" else "1",
    }
    result = _run(_script("h200_mi300x"), **env)
    assert result.returncode == 3, result.stdout + result.stderr
    ends = sorted(
        line
        for line in (tmp_path / "steps").read_text().splitlines()
        if not line.endswith("started")
    )
    assert ends == (["0 stopped", "1 failed"] if elastic == "0" else ["0 done", "1 failed"])


@pytest.mark.parametrize("whom", ["batch-shell", "job-step"])
def test_a_signal_reaches_every_component_step_and_the_batch_step_waits_for_them(
    tmp_path: Path, whom: str
) -> None:
    """scancel -b -s TERM or sbatch --signal=B:TERM@... (the batch shell alone), or a job's
    cancel or time limit (every process of the step): each step's srun gets it, so the run
    saves and exits as under one srun, and the batch step ends only after the steps (each
    takes 0.3 s to stop)."""
    env = _env(
        **{
            **_NODE,
            "MASTER_ADDR": "",
            **_HET_JOB,
            **_fake_srun(tmp_path),
            "FAKE_FAIL_GROUP": "none",
            "FAKE_STEP_S": "60",
        }
    )
    output = tmp_path / "output"
    with output.open("w") as out:  # a file, not a pipe: the steps would hold a pipe open
        job = subprocess.Popen(
            ["bash", str(_script("h200_mi300x"))],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    log = tmp_path / "steps"
    deadline = time.monotonic() + 60
    while not (log.exists() and len(log.read_text().splitlines()) == 2):
        assert time.monotonic() < deadline and job.poll() is None, output.read_text()
        time.sleep(0.05)
    if whom == "batch-shell":
        job.send_signal(signal.SIGTERM)
    else:
        os.killpg(job.pid, signal.SIGTERM)
    assert job.wait(timeout=30) == 143, output.read_text()
    assert sorted(log.read_text().splitlines()) == [
        "0 started",
        "0 stopped",
        "1 started",
        "1 stopped",
    ]


def test_elastic_runs_one_supervisor_per_node() -> None:
    _, cmd = _print_only(
        "h200_mi300x", NODE_RANK="3", ELASTIC="1", NODE_ADDR="node3", MAX_RESTARTS="2"
    )
    assert (
        "tools/elastic_run.py --max-restarts 2 --node-rank 3 --master-addr node0 "
        "--master-port 29500 --node-addr node3 -- --model"
    ) in cmd, cmd
    assert "torch.distributed.run" not in cmd and "pretrain_llama.py" not in cmd
    assert "--save /ckpt" in cmd and "--cluster scripts/clusters/h200_mi300x.yaml" in cmd


_NODE = {"NODE_RANK": "0", "MASTER_ADDR": "n0", "DATA_PATH": "/d", "CHECKPOINT_DIR": "/c"}


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"LAUNCHER": "slurm", "SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "3"}, "needs 6"),
        ({"LAUNCHER": "slurm"}, "Slurm allocation"),
        ({"LAUNCHER": "mpirun"}, "torchrun or slurm"),
        ({"NODE_RANK": "6"}, "NODE_RANK 6 is outside"),
        ({"DATA_PATH": ""}, "DATA_PATH is not set"),
        ({"CHECKPOINT_DIR": ""}, "CHECKPOINT_DIR is not set"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
        ({"NODE_RANK": ""}, "NODE_RANK is not set"),
        ({"PLAN": "/nonexistent/plan.json"}, "plan file"),
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
def test_launch_mistakes_fail_with_one_error_line(env: dict[str, str], expected: str) -> None:
    result = _run(_script("h200_mi300x"), **{**_NODE, "PRINT_ONLY": "1", **env})
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


def test_help_lists_the_modes() -> None:
    result = _run(_script("hethub_llama140b"), "--help")
    assert result.returncode == 0 and "DRY_RUN=1" in result.stdout and "sbatch" in result.stdout
    assert "llama-140b on the hethub_llama140b mix" in result.stdout  # the mix's own lines
    assert "Slurm (96 nodes" in result.stdout and "HET_EXTRA_ENV" in result.stdout


def test_scripts_do_not_depend_on_the_working_directory(tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    result = subprocess.run(
        ["bash", str(_script("h100_mi300x")), "--print-only", "--dry-run"],
        cwd=copy,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "pretrain_llama.py" in result.stdout and "--dry-run" in result.stdout


def test_a_node_of_gpu_and_cpu_ranks_exposes_and_counts_its_gpus_only() -> None:
    """The GPU check's pair (one H200 rank and one CPU rank on one node): one GPU visible,
    Slurm's GPU count compared with the one GPU rank, not with both ranks."""
    pair = {
        "CLUSTER": "scripts/gpu_check/h200_cpu_pair.yaml",
        "PLAN": "scripts/gpu_check/pair_pp2.json",
        "NODE_RANK": "0",
    }
    env, cmd = _print_only(
        "h200_mi300x",
        SLURM_GPUS_ON_NODE="1",
        LAUNCHER="slurm",
        SLURM_JOB_ID="1",
        HET_SLURM_NODE="1",
        SLURM_NODEID="0",
        **pair,
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and "--nproc_per_node 2" in cmd, (env, cmd)
