"""``--profile``: the run's own merged timeline (and with ``--use-pytorch-profiler``
torch.profiler's Chrome trace) of exactly the window's iterations on the profiled rank, in
--tensorboard-dir; and each bad input one line before training starts."""

from __future__ import annotations

import io
import json
import pathlib

import pytest

from megatron_het.arguments import parse_run_config
from megatron_het.training.run import pretrain
from tests.test_pretrain_cli import run_in_process
from tests.unit.test_load_megatron import TINY as TINY_RUN

TINY = [*TINY_RUN, "--train-iters", "5"]


def test_the_window_is_traced(tmp_path: pathlib.Path) -> None:
    board = tmp_path / "board"
    argv = [*TINY, "--profile", "--use-pytorch-profiler", "--tensorboard-dir", str(board)]
    argv += ["--profile-step-start", "2", "--profile-step-end", "4"]
    out = io.StringIO()
    pretrain(parse_run_config(argv), out=out)
    (trace,) = board.glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
    assert len(steps) == 2, steps  # iterations 2 and 3, one span each
    assert any(e.get("name") == "aten::mm" for e in events)  # the model's own operators
    assert "torch.profiler trace of iterations 2-3 written to" in out.getvalue()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--profile-step-start", "4", "--profile-step-end", "4"], "record no iteration"),
        (["--profile-step-start", "9", "--profile-step-end", "12"], "after the run's last"),
        (["--profile-ranks", "0", "3"], "--profile-ranks 3 outside the world of 1 rank"),
        (["--tensorboard-dir", "{file}/board"], "cannot write the profiler's trace there"),
        (["--no-board"], "--profile writes each profiled rank's torch.profiler trace into"),
    ],
)
def test_bad_input_is_one_line(tmp_path: pathlib.Path, capsys, flags: list[str], words: str):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    argv = [*TINY, "--profile", "--use-pytorch-profiler", "--tensorboard-dir", str(tmp_path)]
    argv += ["--profile-step-start", "2", "--profile-step-end", "3"]
    if flags == ["--no-board"]:
        argv = argv[: argv.index("--tensorboard-dir")] + argv[argv.index("--tensorboard-dir") + 2 :]
        flags = []
    argv += [f.replace("{file}", str(blocker)) for f in flags]
    status, out, err = run_in_process(argv, capsys)
    assert status != 0
    (line,) = err.strip().splitlines()
    assert words in line, line
    assert "iteration 1" not in out  # nothing trained


def test_pytorch_profiler_without_profile_is_refused(capsys) -> None:
    status, _, err = run_in_process([*TINY, "--use-pytorch-profiler"], capsys)
    assert status != 0 and "applies with --profile" in err


def test_the_own_timeline_holds_the_window_and_its_prediction(tmp_path: pathlib.Path) -> None:
    from megatron_het.trace.chrome import read_trace, tracks_of, validate_chrome_trace

    board = tmp_path / "board"
    argv = [*TINY, "--profile", "--tensorboard-dir", str(board)]
    argv += ["--profile-step-start", "2", "--profile-step-end", "4"]
    out = io.StringIO()
    pretrain(parse_run_config(argv), out=out)
    assert f"timeline of iterations 2-3 (rank 0) written to {board}" in out.getvalue()
    trace = read_trace(board / "timeline_iters2-3.json")
    assert validate_chrome_trace(trace) == []
    sides = tracks_of(trace)[0]
    names = [e["name"] for e in sides["measured"]]
    assert [n for n in names if n.startswith("iteration")] == ["iteration 2", "iteration 3"]
    assert "optimizer step" in names and "DP gradient sync" in names
    # one micro-batch per iteration (global batch 2, micro-batch 2), then its backward
    assert [n for n in names if n.split()[0] in ("forward", "backward")] == [
        "forward mb0",
        "backward mb0",
    ] * 2
    predicted = [e["name"] for e in sides["predicted"] if e["cat"] == "compute"]
    assert sorted(predicted) == sorted(n for n in names if n.split()[0] in ("forward", "backward"))
    assert not list(board.glob("*.pt.trace.json"))  # torch.profiler was not asked for


def test_without_the_flag_nothing_records(tmp_path: pathlib.Path) -> None:
    board = tmp_path / "board"
    pretrain(parse_run_config([*TINY, "--tensorboard-dir", str(board)]), out=io.StringIO())
    assert not list(board.glob("timeline_*.json"))
