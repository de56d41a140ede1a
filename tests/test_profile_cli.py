"""``tools/profile_device.py``: a profile the predictor loads (in subprocesses), one-line errors
(in this process)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from megatron_het.errors import run_cli
from megatron_het.perf.profile import Profile

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "tools" / "profile_device.py")
sys.path.insert(0, str(REPO / "tools"))
import profile_device  # noqa: E402


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


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


@pytest.mark.parametrize("args, fragment", [
    (["--model", "no-such-model"], "unknown --model 'no-such-model'"),
    (["--model", "tiny", "--micro-batch-sizes", "1,two"], "--micro-batch-sizes"),
    (["--model", "tiny", "--accelerator", "emu-slow"], "--accelerator cpu"),
    (["--model", "tiny", "--host-sharing", "-1"], "--host-sharing must be at least 0"),
])
def test_user_errors_are_one_line(tmp_path: pathlib.Path, args: list, fragment: str,
                                  capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: profile_device.main([*args, "--out", str(tmp_path)]))
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert fragment in lines[0]
    assert not (tmp_path / "cpu.json").exists()
