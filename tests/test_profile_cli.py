"""``tools/profile_device.py``: a profile the predictor loads (in subprocesses), the roofline
comparison of its table and JSON line, one-line errors (in this process). Every run names
``--device cpu``: on a GPU host the default would measure the GPU (and initialise CUDA here)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from megatron_het.cluster.accelerators import AcceleratorRegistry
from megatron_het.errors import run_cli
from megatron_het.perf.calibration import efficiency_for
from megatron_het.perf.cost_model import LayerShape, layer_forward_ops, ops_time
from megatron_het.perf.profile import LayerEntry, Profile, ProfileConditions

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "tools" / "profile_device.py")
sys.path.insert(0, str(REPO / "tools"))
import profile_device  # noqa: E402


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.slow
def test_writes_a_profile_of_the_sweep(tmp_path: pathlib.Path) -> None:
    proc = run_tool("--model", "tiny", "--seq-lengths", "16,32", "--micro-batch-sizes", "1",
                    "--tp", "2", "--warmup", "0", "--iters", "1", "--threads", "1",
                    "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    profile = Profile.load(tmp_path / "cpu.json")
    assert profile.accelerator == "cpu"
    assert sorted((e.tp, e.micro_batch, e.seq) for e in profile.layers) == [(2, 1, 16),
                                                                            (2, 1, 32)]
    assert profile.conditions.threads == 1 and profile.conditions.dtype == "fp32"
    assert f"wrote {tmp_path / 'cpu.json'}" in proc.stdout


@pytest.mark.slow
def test_host_sharing_figures_go_into_the_profile(tmp_path: pathlib.Path) -> None:
    proc = run_tool("--model", "tiny", "--seq-lengths", "16", "--micro-batch-sizes", "1",
                    "--tp", "1", "--warmup", "0", "--iters", "2", "--threads", "1",
                    "--host-sharing", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    profile = Profile.load(tmp_path / "cpu.json")
    assert len(profile.host_sharing) == 2 and all(v > 0 for v in profile.host_sharing)
    wall, cpu = profile.host_collective_s
    assert 0 < cpu <= wall
    assert "host sharing: 1: x" in proc.stdout and "host TP collective: wall" in proc.stdout


def test_a_shape_without_a_preset_gets_the_longest_sequence_as_positions(
        tmp_path: pathlib.Path) -> None:
    """The GPU check profiles its MFU shape by flags alone (no --model): the model must have
    positions for the longest sequence of the sweep."""
    run_cli(lambda: profile_device.main([
        "--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "128",
        "--seq-lengths", "8,24", "--micro-batch-sizes", "1", "--tp", "1", "--warmup", "0",
        "--iters", "1", "--threads", "1", "--device", "cpu", "--out", str(tmp_path)]))
    profile = Profile.load(tmp_path / "cpu.json")
    assert sorted(e.seq for e in profile.layers) == [8, 24]


@pytest.mark.parametrize("args, fragment", [
    (["--model", "no-such-model"], "unknown --model 'no-such-model'"),
    (["--model", "tiny", "--micro-batch-sizes", "1,two"], "--micro-batch-sizes"),
    (["--model", "tiny", "--accelerator", "emu-slow"], "--accelerator cpu"),
    (["--model", "tiny", "--host-sharing", "-1"], "--host-sharing must be at least 0"),
])
def test_user_errors_are_one_line(tmp_path: pathlib.Path, args: list, fragment: str,
                                  capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: profile_device.main([*args, "--device", "cpu", "--out", str(tmp_path)]))
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert fragment in lines[0]
    assert not (tmp_path / "cpu.json").exists()


def layer_entry(seq: int, dtype: str, forward_s: float) -> LayerEntry:
    return LayerEntry(256, 688, 8, 4, seq, 2, 1, dtype, forward_s, 2 * forward_s,
                      3 * 2**20)


@pytest.mark.parametrize("accelerator", ["H100", "cpu"])
def test_roofline_rows_set_the_cost_model_next_to_the_measurement(accelerator: str) -> None:
    entries = (layer_entry(256, "bf16", 4e-3), layer_entry(128, "bf16", 1e-3))
    profile = Profile(accelerator, ProfileConditions("dev", "2", 1, "d"), layers=entries)
    rows = profile_device.roofline_rows(profile)
    assert [r["seq"] for r in rows] == [128, 256]  # the table's order
    spec = AcceleratorRegistry.builtin().get(accelerator)
    for row, entry in zip(rows, entries[::-1]):
        shape = LayerShape(256, 688, 8, 4, entry.seq, 2, 1)
        forward, backward = ops_time(layer_forward_ops(shape), spec, "bf16",
                                     efficiency_for(spec))  # H100's calibrated factors
        assert (row["roofline_forward_s"], row["roofline_backward_s"]) == (forward, backward)
        assert row["forward_ratio"] == pytest.approx(entry.forward_s / forward)
        assert row["backward_ratio"] == pytest.approx(entry.backward_s / backward)
        assert row["forward_s"] == entry.forward_s
    table = profile_device.layer_table(rows).splitlines()
    assert "roof ms" in table[0] and "ratio" in table[0]
    assert f"{rows[0]['roofline_forward_s'] * 1e3:.3f}" in table[1]
    assert f"x{rows[0]['backward_ratio']:.2f}" in table[1]


def test_a_kind_without_figures_has_no_roofline() -> None:
    profile = Profile("my_gpu", ProfileConditions("dev", "2", 1, "d"),
                      layers=(layer_entry(128, "fp32", 1e-3),))
    (row,) = profile_device.roofline_rows(profile)
    assert row["roofline_forward_s"] is None and row["forward_ratio"] is None
    assert profile_device.layer_table([row]).splitlines()[1].split()[6:8] == ["-", "-"]


def test_json_line_carries_the_roofline_comparison(tmp_path: pathlib.Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    path = profile_device.main(["--model", "tiny", "--seq-lengths", "16", "--micro-batch-sizes",
                                "1", "--tp", "1", "--warmup", "0", "--iters", "1", "--device",
                                "cpu", "--out", str(tmp_path), "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["profile"] == str(path) and summary["accelerator"] == "cpu"
    assert summary["conditions"]["dtype"] == "fp32" and summary["device"] == "cpu"
    (row,) = summary["layers"]
    assert (row["seq"], row["micro_batch"], row["tp"]) == (16, 1, 1)
    assert row["forward_ratio"] == pytest.approx(row["forward_s"] / row["roofline_forward_s"])
    assert any(line.lstrip().startswith("64 ") and "x" in line for line in lines)  # the table
