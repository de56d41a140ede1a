"""``tools/plan.py`` end to end in subprocesses: outputs, what-if, and one-line errors."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import model_preset
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.planner.png import read_png

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "tools" / "plan.py")
CPU_CLUSTER = str(REPO / "scripts" / "clusters" / "cpu_emulated.yaml")
BASE = ["--cluster", CPU_CLUSTER, "--model", "small", "--seq-length", "256"]


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict]:
    out = tmp_path_factory.mktemp("plan")
    proc = run_plan(*BASE, "--global-batch-size", "16", "--out", str(out / "plan.json"),
                    "--report", str(out / "report.md"), "--chart", str(out / "plan.png"),
                    "--top", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    return out, json.loads(proc.stdout.strip().splitlines()[-1])


def test_search_writes_plan_report_chart_and_json(planned) -> None:
    out, summary = planned
    plan = ParallelPlan.load(out / "plan.json")
    cluster = ClusterSpec.load(CPU_CLUSTER)
    plan.validate(model_preset("small"), cluster, 16)
    assert summary["plan"] == plan.to_dict()
    assert 0 < summary["efficiency"] <= 1.0 + 1e-9
    assert summary["tokens_per_s"] == pytest.approx(
        summary["efficiency"] * summary["upper_bound_tokens_per_s"])
    assert len(summary["peak_memory_gib"]) == plan.pp_size()
    assert "| efficiency |" in (out / "report.md").read_text()
    width, height, _ = read_png((out / "plan.png").read_bytes())
    assert width > 0 and height > 0


def test_evaluate_predicts_the_written_plan_again(planned) -> None:
    out, summary = planned
    proc = run_plan(*BASE, "--evaluate", str(out / "plan.json"), "--json")
    assert proc.returncode == 0, proc.stderr
    again = json.loads(proc.stdout.strip().splitlines()[-1])
    assert again["tokens_per_s"] == pytest.approx(summary["tokens_per_s"], rel=1e-9)
    assert again["efficiency"] == pytest.approx(summary["efficiency"], rel=1e-9)


def test_evaluate_a_plan_for_another_cluster_gives_the_validation_message(planned,
                                                                          tmp_path) -> None:
    out, _ = planned
    cluster = tmp_path / "fast.yaml"
    cluster.write_text("node_groups:\n  - {name: a, accelerator: emu-fast, nodes: 1, "
                       "devices_per_node: 4, nic_bandwidth_gbps: 1}\n")
    proc = run_plan("--cluster", str(cluster), "--model", "small", "--seq-length", "256",
                    "--evaluate", str(out / "plan.json"))
    assert_one_line_error(proc, "says emu-slow but rank", "emu-fast")


def test_unknown_accelerator_lists_the_known_ones(tmp_path) -> None:
    cluster = tmp_path / "bad.yaml"
    cluster.write_text("node_groups:\n  - {name: a, accelerator: Z9000, nodes: 1, "
                       "devices_per_node: 2, nic_bandwidth_gbps: 1}\n")
    proc = run_plan("--cluster", str(cluster), "--model", "small", "--seq-length", "256",
                    "--global-batch-size", "8")
    assert_one_line_error(proc, "Z9000", "H100", "MI300X")


def test_cluster_too_small_for_the_model_says_the_shortfall() -> None:
    proc = run_plan("--cluster", CPU_CLUSTER, "--model", "llama2-70b", "--seq-length", "4096",
                    "--global-batch-size", "8")
    assert_one_line_error(proc, "cannot hold llama2-70b", "GiB", "add devices")


@pytest.mark.parametrize("args, fragment", [
    (BASE, "--global-batch-size is required"),
    (BASE + ["--global-batch-size", "0"], "--global-batch-size must be at least 1"),
    (["--cluster", CPU_CLUSTER, "--seq-length", "128", "--global-batch-size", "4"],
     "no model shape"),
    (BASE + ["--global-batch-size", "8", "--profile-dir", "/nonexistent"], "--profile-dir"),
])
def test_bad_command_lines_fail_in_one_line(args, fragment) -> None:
    assert_one_line_error(run_plan(*args), fragment)


def test_model_flags_without_a_preset() -> None:
    proc = run_plan("--cluster", CPU_CLUSTER, "--num-layers", "4", "--hidden-size", "128",
                    "--ffn-hidden-size", "352", "--num-attention-heads", "4",
                    "--num-query-groups", "2", "--vocab-size", "512", "--seq-length", "64",
                    "--global-batch-size", "8", "--no-upper-bound", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["efficiency"] is None and summary["tokens_per_s"] > 0


def test_profile_dir_replaces_roofline_estimates(tmp_path) -> None:
    from megatron_het.perf.profile import LayerEntry, Profile, ProfileConditions
    slow = LayerEntry(256, 688, 8, 4, 256, 1, 1, "fp32", 0.5, 1.0, 1e6)  # 0.5 s per layer
    Profile("cpu", ProfileConditions("host", "2.13.0", 1, "2026-11-30"),
            layers=(slow,)).save(tmp_path / "cpu.json")
    common = [*BASE, "--global-batch-size", "8", "--dtype", "fp32", "--no-upper-bound",
              "--json"]
    roofline = run_plan(*common)
    measured = run_plan(*common, "--profile-dir", str(tmp_path))
    assert roofline.returncode == 0 and measured.returncode == 0, measured.stderr
    fast = json.loads(roofline.stdout.strip().splitlines()[-1])["iteration_time_s"]
    profiled = json.loads(measured.stdout.strip().splitlines()[-1])["iteration_time_s"]
    # 4 layers of 1.5 s (forward + backward) per micro-batch on emu-fast, twice that on
    # emu-slow: the iteration takes seconds instead of milliseconds.
    assert profiled > 4.0 and profiled > 10 * fast
