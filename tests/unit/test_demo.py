"""The demo's own steps: the emulated cluster it scales for the host, its run's flags."""

from __future__ import annotations

import pathlib

import pytest

from megatron_het import demo
from megatron_het.cluster import ClusterSpec

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_host_cluster_scales_both_kinds_and_keeps_their_ratio(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "host_cores", lambda: 2)
    args = demo.parse_args(["--workdir", str(tmp_path)])
    path, dilation = demo.host_cluster(tmp_path, args)
    assert dilation == pytest.approx(demo.DILATION_ROOM * 4 / 2)
    scaled, original = ClusterSpec.load(path), ClusterSpec.load(args.cluster)
    for rank in range(4):
        assert scaled.accelerator_of(rank).slowdown == pytest.approx(
            original.accelerator_of(rank).slowdown * dilation
        )
    assert path.read_text().startswith("# EMULATION:")
    monkeypatch.setattr(demo, "host_cores", lambda: 64)
    assert demo.host_cluster(tmp_path, args)[1] == 1.0  # a core per rank: the kinds as they are
    explicit = demo.parse_args(["--workdir", str(tmp_path), "--dilation", "3"])
    assert demo.host_cluster(tmp_path, explicit)[1] == 3.0


def test_the_run_uses_the_profile_and_resumes_from_its_checkpoint(tmp_path: pathlib.Path) -> None:
    args = demo.parse_args(["--workdir", str(tmp_path), "--train-iters", "7"])
    flags = demo.train_argv(
        args,
        tmp_path,
        tmp_path / "cluster.yaml",
        tmp_path / "profile" / "cpu.json",
        tmp_path / "tok.model",
        "data",
    )
    assert flags[flags.index("--emulation-profile") + 1] == str(tmp_path / "profile" / "cpu.json")
    assert flags[flags.index("--train-iters") + 1] == "7" and "--load" not in flags
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("5\n")
    again = demo.train_argv(
        args, tmp_path, tmp_path / "c.yaml", tmp_path / "p.json", tmp_path / "tok.model", "data"
    )
    assert again[again.index("--load") + 1] == str(tmp_path / "checkpoints")


def test_the_run_records_two_late_iterations_on_every_rank(tmp_path: pathlib.Path) -> None:
    from megatron_het.arguments import parse_run_config

    args = demo.parse_args(["--workdir", str(tmp_path), "--train-iters", "70"])
    flags = demo.train_argv(
        args, tmp_path, tmp_path / "c.yaml", tmp_path / "p.json", tmp_path / "tok.model", "data"
    )
    profile = parse_run_config(flags).train.profile
    assert (profile.enabled, profile.use_pytorch_profiler) == (True, False)
    assert (profile.step_start, profile.step_end, profile.ranks) == (68, 70, (0, 1, 2, 3))


def test_the_closing_table_and_picture_come_from_the_newest_trace(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_het.trace.chrome import TraceInfo, chrome_trace, write_trace
    from tests.unit.test_trace_report import _iteration, _predicted, _track

    assert demo.show_trace(tmp_path) == []  # no trace: nothing shown
    board = tmp_path / "tensorboard"
    board.mkdir()
    tracks = [_track(s, s, _iteration(s, 1.0), _predicted(s, 1.0)) for s in (0, 1)]
    write_trace(
        chrome_trace(tracks, TraceInfo((9,), "test", {"iteration_time_s": 0.8})),
        board / "timeline_iters9-9.json",
    )
    (picture,) = demo.show_trace(tmp_path)
    assert picture == tmp_path / "trace.png" and picture.read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert "timeline_iters9-9.json; open it in ui.perfetto.dev" in out
    assert "p0 stage 1 emu-slow (emulated) tp1" in out
