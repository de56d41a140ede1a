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
