"""The per-mix launch scripts: shape, syntax, dry runs against their plans, Slurm steps.

Every scripts/<mix>/pretrain_llama_<size>.sh is a thin wrapper that hands its mix's settings
file (mix_<size>.yaml beside it) to ``python -m megatron_het.launcher``; it must pass
``bash -n``, and its dry run (``DRY_RUN=1``: pretrain_llama.py --dry-run validates plan,
cluster, model and batch together) must pass; an edited, broken copy of a plan must make the
dry run fail with one ``error:`` line. The dry runs run the launcher's command in this process;
one goes through the script. What a node would run is checked without processes in
tests/unit/test_node_launch.py; the Slurm steps here run as processes (a fake srun).
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

from megatron_het.launcher.mix import load_mix
from tests.unit.test_node_launch import launch, mix_file

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(REPO.glob("scripts/*/pretrain_llama_*.sh"))
# Clusters that are not launched from here: the emulated one (make demo runs it), the
# 16,384-device one, an example for planning at scale, and the test network's hosts
# (tools/testnet.py run launches them).
NOT_LAUNCHED = {"cpu_emulated", "h100_mi300x_a100_16k", "testnet_3nodes"}
MIXES = sorted(
    p.stem for p in (REPO / "scripts" / "clusters").glob("*.yaml") if p.stem not in NOT_LAUNCHED
)
# Variables the launcher reads or exports: the scripts start from an environment without them.
_SCRUB_PREFIXES = ("NCCL_", "HSA_", "HCCL_", "ASCEND_", "SLURM_", "HET_", "TORCH_NCCL_")
_SCRUB = {
    *("NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "DATA_PATH", "TOKENIZER_MODEL"),
    *("CHECKPOINT_DIR", "LOG_DIR", "TENSORBOARD_DIR", "CLUSTER", "PLAN", "BRIDGE", "LAUNCHER"),
    *("DRY_RUN", "PRINT_ONLY", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "TRAIN_ITERS"),
    *("NULL_VOCAB_SIZE", "PYTHON", "OMP_NUM_THREADS", "CUDA_DEVICE_MAX_CONNECTIONS", "ELASTIC"),
    *("MAX_RESTARTS", "NODE_ADDR", "NODE_ORDER", "SLURMD_NODENAME"),
}


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith(_SCRUB_PREFIXES)
    }
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


def _run(script: Path, *args: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _script(mix: str) -> Path:
    found = sorted((REPO / "scripts" / mix).glob("pretrain_llama_*.sh"))
    assert found, f"no launch script for mix {mix}"
    return found[0]


def test_every_mix_has_a_script_a_settings_file_and_a_plan() -> None:
    assert len(MIXES) >= 7 and len(SCRIPTS) == len(MIXES)
    for mix in MIXES:
        script = _script(mix)
        settings = load_mix(mix_file(mix))
        assert (settings.name, REPO / settings.script) == (mix, script)
        assert mix_file(mix).name == f"mix_{settings.size}.yaml"
        assert (REPO / "scripts" / mix / f"plan_{settings.size}.json").is_file()
        assert (REPO / settings.plan).is_file() and (REPO / settings.cluster).is_file()
        assert os.access(script, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.parent.name)
def test_a_mix_script_is_a_thin_wrapper_of_the_launcher(script: Path) -> None:
    from megatron_het.cluster import ClusterSpec

    text = script.read_text()
    settings = load_mix(script.parent / f"mix_{script.stem.removeprefix('pretrain_llama_')}.yaml")
    body = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(body) <= 12 and "set -euo pipefail" in body, body
    assert body[-1] == (
        f'exec "$python" -m megatron_het.launcher scripts/{settings.name}/'
        f'mix_{settings.size}.yaml "$@"'
    )
    # its settings are the mix file's, not the script's
    assert "SLURM_SUBMIT_DIR" in text and not any(settings.model in line for line in body)
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    cluster = ClusterSpec.load(REPO / settings.cluster)
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


def _pretrain_in_process(
    command: tuple[str, ...], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    """A launcher's ``python pretrain_llama.py ...`` command run in this process, in the
    repository: (exit status, stdout, stderr)."""
    from megatron_het import errors
    from megatron_het.training.entry import main

    assert command[1] == "pretrain_llama.py"
    monkeypatch.chdir(REPO)
    try:
        errors.run_cli(lambda: main(list(command[2:]), {}))
        status = 0
    except SystemExit as exit_:
        status = int(exit_.code or 0)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.slow
def test_dry_run_validates_plan_cluster_and_model(mix: str, capsys, monkeypatch) -> None:
    (command,) = launch(mix, DRY_RUN="1").commands
    status, out, err = _pretrain_in_process(command, capsys, monkeypatch)
    assert status == 0, err
    assert "plan, cluster, model and batch are consistent" in out
    assert f"on cluster {mix}" in out


def _drop_last_layer(plan: dict) -> None:
    for pipeline in plan["pipelines"]:
        pipeline["stages"][-1]["layers"][1] -= 1


def _drop_a_pipeline(plan: dict) -> None:
    plan["pipelines"].pop()


@pytest.mark.parametrize(
    "break_plan, expected",
    [(_drop_last_layer, "on no stage"), (_drop_a_pipeline, "give every rank")],
)
def test_broken_plan_fails_with_one_error_line(
    tmp_path: Path,
    break_plan: Callable[[dict], None],
    expected: str,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = json.loads(next(_script("h100_mi300x").parent.glob("plan_*.json")).read_text())
    break_plan(plan)
    broken = tmp_path / "broken_plan.json"
    broken.write_text(json.dumps(plan))
    (command,) = launch("h100_mi300x", "--dry-run", PLAN=str(broken)).commands
    status, out, err = _pretrain_in_process(command, capsys, monkeypatch)
    assert status == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


@pytest.mark.slow
def test_a_scripts_dry_run_from_another_directory(tmp_path: Path) -> None:
    """The whole chain: the script finds the repository and its Python from anywhere, the
    launcher runs pretrain_llama.py --dry-run there."""
    assert (
        "DRY_RUN=1 scripts/h200_mi300x/pretrain_llama_70b.sh\n"
        in (REPO / "docs" / "launching.md").read_text()
    )  # the page's dry run, run here
    result = _run(_script("h200_mi300x"), cwd=tmp_path, DRY_RUN="1")
    assert result.returncode == 0, result.stderr
    assert "plan, cluster, model and batch are consistent" in result.stdout
    printed = _run(_script("h100_mi300x"), "--print-only", "--dry-run", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    (command,) = printed.stdout.splitlines()
    assert command.startswith(f"+ {sys.executable} pretrain_llama.py --model llama2-70b")
    assert command.endswith("--dry-run")


def test_help_lists_the_modes() -> None:
    result = _run(_script("hethub_llama140b"), "--help")
    assert result.returncode == 0 and "DRY_RUN=1" in result.stdout and "sbatch" in result.stdout
    assert "llama-140b on the hethub_llama140b mix" in result.stdout  # the mix's own lines
    assert "Slurm (96 nodes" in result.stdout and "HET_EXTRA_ENV" in result.stdout
    assert "scripts/hethub_llama140b/mix_140b.yaml" in result.stdout


def test_a_launch_mistake_is_one_error_line_and_status_2() -> None:
    result = _run(_script("h200_mi300x"), LAUNCHER="mpirun")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == "error: LAUNCHER must be torchrun or slurm, got 'mpirun'\n"


def _fake_srun(tmp_path: Path) -> Path:
    """An srun whose step for component FAKE_FAIL_GROUP fails with status 3 after 0.2 s and
    whose other steps run for FAKE_STEP_S seconds (ending early, status 143, on SIGTERM);
    each writes its start and end to tmp_path/steps. Returns its folder (for PATH)."""
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(f"""#!/usr/bin/env bash
group="${{1#--het-group=}}"
log="{tmp_path}/steps"
if [ "$group" = "$FAKE_FAIL_GROUP" ]; then
    echo "$group started" >> "$log"; sleep 0.2; echo "$group failed" >> "$log"; exit 3
fi
sleep "$FAKE_STEP_S" &
trap 'kill $!; sleep 0.3; echo "$group stopped" >> "$log"; exit 143' TERM
# (started once the trap is set: the test signals the steps as soon as both have started)
echo "$group started" >> "$log"
wait $!
echo "$group done" >> "$log"
""")
    srun.chmod(0o755)
    return srun.parent


_HET_JOB = {
    "LAUNCHER": "slurm",
    "SLURM_JOB_ID": "42",
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "h200-1,h200-2",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "mi-1,mi-2,mi-3,mi-4",
    "DATA_PATH": "/d",
    "CHECKPOINT_DIR": "/c",
}


@pytest.mark.parametrize("elastic", [False, True])
def test_a_failed_component_step_ends_a_plain_job_and_not_an_elastic_one(
    tmp_path: Path, elastic: bool
) -> None:
    from megatron_het.launcher.slurm import run_steps

    fake = {"FAKE_FAIL_GROUP": "1", "FAKE_STEP_S": "1" if elastic else "60"}
    done = launch("h200_mi300x", **_HET_JOB, ELASTIC="1" if elastic else "0")
    assert done.elastic == elastic
    env = {**done.env, **fake, "PATH": f"{_fake_srun(tmp_path)}:{os.environ['PATH']}"}
    steps = [(str(tmp_path / "bin" / "srun"), *step[1:]) for step in done.commands]
    assert run_steps(steps, env, done.elastic, str(REPO)) == 3
    ends = sorted(
        line
        for line in (tmp_path / "steps").read_text().splitlines()
        if not line.endswith("started")
    )
    assert ends == (["0 done", "1 failed"] if elastic else ["0 stopped", "1 failed"])


@pytest.mark.parametrize("whom", ["batch-shell", "job-step"])
def test_a_signal_reaches_every_component_step_and_the_batch_step_waits_for_them(
    tmp_path: Path, whom: str
) -> None:
    """scancel -b -s TERM or sbatch --signal=B:TERM@... (the batch step's process alone), or
    a job's cancel or time limit (every process of the step): each step's srun gets it, so the
    run saves and exits as under one srun, and the batch step ends only after the steps (each
    takes 0.3 s to stop)."""
    path = f"{_fake_srun(tmp_path)}:{os.environ['PATH']}"
    env = _env(**_HET_JOB, PATH=path, FAKE_FAIL_GROUP="none", FAKE_STEP_S="60")
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
