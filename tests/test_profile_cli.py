"""``tools/profile_device.py``: a profile the predictor loads (in subprocesses), the roofline
comparison of its table and JSON line, one-line errors (in this process). Every run names
``--device cpu``: on a GPU host the default would measure the GPU (and initialise CUDA here)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from megatron_het.cluster.accelerators import AcceleratorRegistry
from megatron_het.config import model_preset
from megatron_het.errors import run_cli
from megatron_het.perf.cost.calibration import efficiency_for
from megatron_het.perf.cost.roofline import (
    EAGER_ELEMENTWISE_TRAFFIC,
    LayerShape,
    layer_forward_ops,
    ops_time,
)
from megatron_het.perf.measure.profile_format import LayerEntry, Profile, ProfileConditions
from megatron_het.perf.measure.shard_cases import layer_case, rank_stage
from megatron_het.perf.measure.timed_cases import KernelRow, kernel_breakdown

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "tools" / "profile_device.py")
from tools import profile_device  # noqa: E402


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.slow
def test_writes_a_profile_of_the_sweep(tmp_path: pathlib.Path) -> None:
    proc = run_tool(
        "--model",
        "tiny",
        "--seq-lengths",
        "16,32",
        "--micro-batch-sizes",
        "1",
        "--tp",
        "2",
        "--warmup",
        "0",
        "--iters",
        "1",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    profile = Profile.load(tmp_path / "cpu.json")
    assert profile.accelerator == "cpu"
    assert sorted((e.tp, e.micro_batch, e.seq) for e in profile.layers) == [(2, 1, 16), (2, 1, 32)]
    assert profile.conditions.threads == 1 and profile.conditions.dtype == "fp32"
    assert f"wrote {tmp_path / 'cpu.json'}" in proc.stdout


@pytest.mark.slow
def test_host_sharing_figures_go_into_the_profile(tmp_path: pathlib.Path) -> None:
    proc = run_tool(
        "--model",
        "tiny",
        "--seq-lengths",
        "16",
        "--micro-batch-sizes",
        "1",
        "--tp",
        "1",
        "--warmup",
        "0",
        "--iters",
        "2",
        "--threads",
        "1",
        "--host-sharing",
        "2",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    profile = Profile.load(tmp_path / "cpu.json")
    assert len(profile.host_sharing) == 2 and all(v > 0 for v in profile.host_sharing)
    wall, cpu = profile.host_collective_s
    assert 0 < cpu <= wall
    assert "host sharing: 1: x" in proc.stdout and "host TP collective: wall" in proc.stdout


def test_a_shape_without_a_preset_gets_the_longest_sequence_as_positions(
    tmp_path: pathlib.Path,
) -> None:
    """The GPU check profiles its MFU shape by flags alone (no --model): the model must have
    positions for the longest sequence of the sweep."""
    run_cli(
        lambda: profile_device.main(
            [
                "--num-layers",
                "1",
                "--hidden-size",
                "64",
                "--ffn-hidden-size",
                "128",
                "--num-attention-heads",
                "4",
                "--num-query-groups",
                "2",
                "--vocab-size",
                "128",
                "--seq-lengths",
                "8,24",
                "--micro-batch-sizes",
                "1",
                "--tp",
                "1",
                "--warmup",
                "0",
                "--iters",
                "1",
                "--threads",
                "1",
                "--device",
                "cpu",
                "--out",
                str(tmp_path),
            ]
        )
    )
    profile = Profile.load(tmp_path / "cpu.json")
    assert sorted(e.seq for e in profile.layers) == [8, 24]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--model", "no-such-model"], "unknown --model 'no-such-model'"),
        (["--model", "tiny", "--micro-batch-sizes", "1,two"], "--micro-batch-sizes"),
        (["--model", "tiny", "--accelerator", "emu-slow"], "--accelerator cpu"),
        (["--model", "tiny", "--host-sharing", "-1"], "--host-sharing must be at least 0"),
    ],
)
def test_user_errors_are_one_line(
    tmp_path: pathlib.Path, args: list, fragment: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: profile_device.main([*args, "--device", "cpu", "--out", str(tmp_path)]))
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert fragment in lines[0]
    assert not (tmp_path / "cpu.json").exists()


def layer_entry(seq: int, dtype: str, forward_s: float) -> LayerEntry:
    return LayerEntry(256, 688, 8, 4, seq, 2, 1, dtype, forward_s, 2 * forward_s, 3 * 2**20)


@pytest.mark.parametrize("accelerator", ["H100", "cpu"])
def test_roofline_rows_set_the_cost_model_next_to_the_measurement(accelerator: str) -> None:
    entries = (layer_entry(256, "bf16", 4e-3), layer_entry(128, "bf16", 1e-3))
    profile = Profile(accelerator, ProfileConditions("dev", "2", 1, "d"), layers=entries)
    rows = profile_device.roofline_rows(profile)
    assert [r["seq"] for r in rows] == [128, 256]  # the table's order
    spec = AcceleratorRegistry.builtin().get(accelerator)
    for row, entry in zip(rows, entries[::-1]):
        shape = LayerShape(256, 688, 8, 4, entry.seq, 2, 1)
        # H100's calibrated factors, for the eager layers a profile measures
        efficiency = efficiency_for(spec)
        if accelerator == "H100":
            efficiency = dataclasses.replace(
                efficiency, elementwise_traffic=EAGER_ELEMENTWISE_TRAFFIC
            )
        forward, backward = ops_time(layer_forward_ops(shape), spec, "bf16", efficiency)
        assert (row["roofline_forward_s"], row["roofline_backward_s"]) == (forward, backward)
        assert row["forward_ratio"] == pytest.approx(entry.forward_s / forward)
        assert row["backward_ratio"] == pytest.approx(entry.backward_s / backward)
        assert row["forward_s"] == entry.forward_s
    table = profile_device.layer_table(rows).splitlines()
    assert "roof ms" in table[0] and "ratio" in table[0]
    assert f"{rows[0]['roofline_forward_s'] * 1e3:.3f}" in table[1]
    assert f"x{rows[0]['backward_ratio']:.2f}" in table[1]


def test_a_kind_without_figures_has_no_roofline() -> None:
    profile = Profile(
        "my_gpu", ProfileConditions("dev", "2", 1, "d"), layers=(layer_entry(128, "fp32", 1e-3),)
    )
    (row,) = profile_device.roofline_rows(profile)
    assert row["roofline_forward_s"] is None and row["forward_ratio"] is None
    assert profile_device.layer_table([row]).splitlines()[1].split()[7:9] == ["-", "-"]


def test_json_line_carries_the_roofline_comparison(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture
) -> None:
    path = profile_device.main(
        [
            "--model",
            "tiny",
            "--seq-lengths",
            "16",
            "--micro-batch-sizes",
            "1",
            "--tp",
            "1",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["profile"] == str(path) and summary["accelerator"] == "cpu"
    assert summary["conditions"]["dtype"] == "fp32" and summary["device"] == "cpu"
    (row,) = summary["layers"]
    assert (row["seq"], row["micro_batch"], row["tp"]) == (16, 1, 1)
    assert row["forward_ratio"] == pytest.approx(row["forward_s"] / row["roofline_forward_s"])
    assert any(line.lstrip().startswith("64 ") and "x" in line for line in lines)  # the table


def test_kernels_flag_breaks_each_layer_case_down(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture
) -> None:
    profile_device.main(
        [
            "--model",
            "tiny",
            "--seq-lengths",
            "16",
            "--micro-batch-sizes",
            "1,2",
            "--tp",
            "1",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--kernels",
            "3",
        ]
    )
    out = capsys.readouterr().out
    tables = out.split("kernels of one layer forward + backward: ")[1:]
    assert [t.splitlines()[0] for t in tables] == [
        "tp=1 mb=1 seq=16 fp32 eager",
        "tp=1 mb=2 seq=16 fp32 eager",
    ]
    for table in tables:
        lines = table.strip().splitlines()
        assert lines[1].split()[:1] == ["ms/pass"] and len(lines) == 2 + 3 + 2
        times = [float(line.split()[0]) for line in lines[2:5]]
        assert times == sorted(times, reverse=True) and times[0] > 0  # most time first
        assert "device idle: pass" in lines[-1]


def test_kernel_breakdown_finds_the_layers_matrix_products() -> None:
    stage = rank_stage(model_preset("tiny"), 1, (0, 1), False, False, torch.device("cpu"), 1)
    case = layer_case(stage, 16, 2, 1, "fp32", torch.device("cpu"))
    rows, pass_s = kernel_breakdown(case, torch.device("cpu"), iters=2)
    names = {row.name: row for row in rows}
    assert pass_s > 0 and "aten::mm" in names
    assert names["aten::mm"].calls >= 5 * 2  # forward and input gradient of each linear
    assert [row.seconds for row in rows] == sorted((row.seconds for row in rows), reverse=True)


def test_kernel_table_sums_the_rest_and_the_idle_time() -> None:
    rows = [
        KernelRow("gemm", 3.0, 0.004),
        KernelRow("norm", 2.0, 0.002),
        KernelRow("rope", 1.0, 0.001),
    ]
    lines = profile_device.kernel_table(rows, 0.010, 2).splitlines()
    assert lines[1].split()[:3] == ["4.000", "40.0%", "3.0"] and lines[1].endswith("gemm")
    assert lines[3].split()[:2] == ["1.000", "10.0%"] and "(1 other kernels)" in lines[3]
    assert lines[4].split()[:2] == ["3.000", "30.0%"]  # 10 ms pass, 7 ms of kernels
