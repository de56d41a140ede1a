"""``tools/plan.py``: outputs, what-if, the short JSON line and one-line errors.

The cases run the command line in this process (:func:`megatron_het.planner.cli.run`); one runs
the script itself to check the exit status and the one-line error of the entry point.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import model_preset
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_validation import validate
from megatron_het.planner.cli import run
from megatron_het.planner.report import plan_summary

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "tools" / "plan.py")
CPU_CLUSTER = str(REPO / "scripts" / "clusters" / "cpu_emulated.yaml")
BASE = ["--cluster", CPU_CLUSTER, "--model", "small", "--seq-length", "256"]


def plan_json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    """Run tools/plan.py's command line with ``--json``; its last stdout line, parsed."""
    run([*args, "--json"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def user_error(*args: str) -> str:
    with pytest.raises(UserError) as info:
        run(list(args))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict, str]:
    out = tmp_path_factory.mktemp("plan")
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            *BASE,
            "--global-batch-size",
            "16",
            "--out",
            str(out / "plan.json"),
            "--report",
            str(out / "report.md"),
            "--chart",
            str(out / "plan.png"),
            "--top",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    return out, json.loads(last), last


@pytest.mark.slow  # the module's search runs tools/plan.py in a subprocess (about 7 s)
def test_search_writes_plan_report_chart_and_json(planned) -> None:
    out, summary, _ = planned
    plan = ParallelPlan.load(out / "plan.json")
    cluster = ClusterSpec.load(CPU_CLUSTER)
    validate(plan, model_preset("small"), cluster, 16)
    assert summary["plan"] == plan_summary(plan)
    assert summary["plan_file"] == str(out / "plan.json")
    assert 0 < summary["efficiency"] <= 1.0 + 1e-9
    assert summary["tokens_per_s"] == pytest.approx(
        summary["efficiency"] * summary["baseline_tokens_per_s"]
    )
    assert len(summary["peak_memory_gib"]) == plan.pp_size()
    assert "| efficiency |" in (out / "report.md").read_text()
    png = (out / "plan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and b"Matplotlib" in png[:4096]


@pytest.mark.slow  # the module's search runs tools/plan.py in a subprocess (about 7 s)
def test_json_line_is_short_and_lists_stage_groups(planned) -> None:
    _, summary, line = planned
    assert 'ranks": [' not in line and len(line) < 4000
    groups = summary["plan"]["stage_groups"]
    assert sum(g["ranks"] for g in groups) == summary["plan"]["world_size"] == 4
    for key in ("dp", "micro_batch_size", "global_batch_size"):
        assert key in summary["plan"]
    for key in ("accelerator", "tp", "layers", "pipelines", "ranks"):
        assert all(key in g for g in groups)


@pytest.mark.slow  # the module's search runs tools/plan.py in a subprocess (about 7 s)
def test_evaluate_predicts_the_written_plan_again(planned, capsys) -> None:
    out, summary, _ = planned
    again = plan_json(capsys, *BASE, "--evaluate", str(out / "plan.json"))
    assert again["tokens_per_s"] == pytest.approx(summary["tokens_per_s"], rel=1e-9)
    assert again["efficiency"] == pytest.approx(summary["efficiency"], rel=1e-9)
    assert again["plan"] == summary["plan"] and again["plan_file"] is None


@pytest.mark.slow  # the module's search runs tools/plan.py in a subprocess (about 7 s)
def test_evaluate_a_plan_for_another_cluster_gives_the_validation_message(
    planned, tmp_path
) -> None:
    out, _, _ = planned
    cluster = tmp_path / "fast.yaml"
    cluster.write_text(
        "node_groups:\n  - {name: a, accelerator: emu-fast, nodes: 1, "
        "devices_per_node: 4, nic_bandwidth_gbps: 1}\n"
    )
    message = user_error(
        "--cluster",
        str(cluster),
        "--model",
        "small",
        "--seq-length",
        "256",
        "--evaluate",
        str(out / "plan.json"),
    )
    assert "says emu-slow but rank" in message and "emu-fast" in message


def test_script_reports_a_user_error_in_one_line(tmp_path) -> None:
    cluster = tmp_path / "bad.yaml"
    cluster.write_text(
        "node_groups:\n  - {name: a, accelerator: Z9000, nodes: 1, "
        "devices_per_node: 2, nic_bandwidth_gbps: 1}\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--cluster",
            str(cluster),
            "--model",
            "small",
            "--seq-length",
            "256",
            "--global-batch-size",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    for fragment in ("Z9000", "H100", "MI300X"):
        assert fragment in lines[0]


def test_cluster_too_small_for_the_model_says_the_shortfall() -> None:
    message = user_error(
        "--cluster",
        CPU_CLUSTER,
        "--model",
        "llama2-70b",
        "--seq-length",
        "4096",
        "--global-batch-size",
        "8",
    )
    assert "cannot hold llama2-70b" in message and "GiB" in message and "add devices" in message


@pytest.mark.parametrize(
    "args, fragment",
    [
        (BASE, "--global-batch-size is required"),
        (BASE + ["--global-batch-size", "0"], "--global-batch-size must be at least 1"),
        (
            ["--cluster", CPU_CLUSTER, "--seq-length", "128", "--global-batch-size", "4"],
            "no model shape",
        ),
        (BASE + ["--global-batch-size", "8", "--profile-dir", "/nonexistent"], "--profile-dir"),
        (BASE + ["--global-batch-size", "8", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_command_lines_fail_in_one_line(args, fragment) -> None:
    assert fragment in user_error(*args)


def test_model_flags_without_a_preset(capsys) -> None:
    summary = plan_json(
        capsys,
        "--cluster",
        CPU_CLUSTER,
        "--num-layers",
        "4",
        "--hidden-size",
        "128",
        "--ffn-hidden-size",
        "352",
        "--num-attention-heads",
        "4",
        "--num-query-groups",
        "2",
        "--vocab-size",
        "512",
        "--seq-length",
        "64",
        "--global-batch-size",
        "8",
        "--no-baseline",
    )
    assert summary["efficiency"] is None and summary["tokens_per_s"] > 0
    assert summary["baseline"] is None


def test_profile_dir_replaces_roofline_estimates(tmp_path, capsys) -> None:
    from megatron_het.perf.measure.profile_format import LayerEntry, Profile, ProfileConditions

    slow = LayerEntry(256, 688, 8, 4, 256, 1, 1, "fp32", 0.5, 1.0, 1e6)  # 0.5 s per layer
    Profile("cpu", ProfileConditions("host", "2.13.0", 1, "2026-11-30"), layers=(slow,)).save(
        tmp_path / "cpu.json"
    )
    common = [*BASE, "--global-batch-size", "8", "--dtype", "fp32", "--no-baseline"]
    fast = plan_json(capsys, *common)["iteration_time_s"]
    profiled = plan_json(capsys, *common, "--profile-dir", str(tmp_path))["iteration_time_s"]
    # 4 layers of 1.5 s (forward + backward) per micro-batch on emu-fast, twice that on
    # emu-slow: the iteration takes seconds instead of milliseconds.
    assert profiled > 4.0 and profiled > 10 * fast
