"""Faults end to end with torchrun on the emulated cluster: a stopped or killed rank, or a whole
lost node of a two-node job, ends the job within the timeout with one report line; the
supervisor (tools/elastic_run.py: one host, or one per node of a two-node job) relaunches on
the devices left under a new plan, which continues the run from the last committed checkpoint
(EMULATION)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import pytest

from bench.fault_jobs import (
    CLUSTER,
    MODEL_FLAGS,
    PLAN,
    REPO,
    TWO_NODE_CLUSTER,
    Job,
    free_port,
    node_torchrun,
    supervised,
    torchrun,
    train_losses,
)
from megatron_het.checkpoint.io import read_latest_iteration
from megatron_het.checkpoint.reader import load_model_state
from megatron_het.launcher.failure_record import read_failure

TIMEOUT_MIN = 0.1
SCHEDULE = ["--train-iters", "500", "--distributed-timeout-minutes", str(TIMEOUT_MIN)]


def start_and_fault(
    tmp: pathlib.Path, victim: int, signum: int, save_interval: int = 2, logged: int = 3
) -> tuple[Job, float]:
    """The 4-rank job, saving every ``save_interval`` iterations into ``tmp/ckpt`` and logging
    to ``tmp/fault.jsonl``; ``signum`` to rank ``victim`` once ``logged`` iterations are
    logged. Returns the running job and the time of the signal."""
    metrics = tmp / "fault.jsonl"
    job = Job(
        torchrun(
            4,
            [
                "--cluster",
                str(CLUSTER),
                "--plan",
                str(PLAN),
                *SCHEDULE,
                "--metrics-file",
                str(metrics),
                "--save",
                str(tmp / "ckpt"),
                "--save-interval",
                str(save_interval),
            ],
        )
    )
    job.wait_for_iterations(metrics, logged)
    return job, job.send(victim, signum)


def the_report(job: Job, lost: Sequence[int], reporter: int = 2) -> str:
    stderr = job.text("stderr")
    reports = [
        line
        for line in stderr.splitlines()
        if line.startswith("error: iteration") and "stopped answering" in line
    ]
    assert len(reports) == 1, stderr[-4000:]
    assert all(f"rank {r} (emu-" in reports[0] for r in lost), reports[0]
    assert f"on rank {reporter}:" in reports[0], reports[0]
    assert "unified group '" in reports[0] and "failed" in reports[0]
    # no worker traceback (torchrun prints its own for the failed child)
    assert not [
        line
        for line in stderr.splitlines()
        if line.strip().startswith("File ") and "megatron_het" in line
    ]
    return reports[0]


def assert_only_committed_checkpoints(save: pathlib.Path) -> int:
    latest = read_latest_iteration(save)
    assert latest is not None and latest >= 2
    load_model_state(save)  # the latest committed checkpoint loads (and verifies)
    visible = [p.name for p in save.iterdir() if p.name.startswith("iter_")]
    assert all((save / name / "metadata.json").is_file() for name in visible), visible
    return latest


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (it may end while this reads)."""
    try:
        return "zombie" not in pathlib.Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_stopped_rank_is_named_within_the_timeout(tmp_path: pathlib.Path) -> None:
    job, sent = start_and_fault(tmp_path, 3, signal.SIGSTOP)
    others, stopped = [job.worker_pid(r) for r in (0, 1, 2)], job.worker_pid(3)
    deadline = sent + TIMEOUT_MIN * 60 + 60
    while any(_running(pid) for pid in others):
        assert time.monotonic() < deadline, "the other ranks did not fail in time"
        time.sleep(0.1)
    assert time.monotonic() - sent < TIMEOUT_MIN * 60 + 60
    # torchrun would kill the stopped worker, which cannot take its SIGTERM, 30 s later (a wait
    # fixed in torch's process context whatever --shutdown-timeout says; bench/faults.py times
    # it): kill it now, and the job ends
    os.kill(stopped, signal.SIGKILL)
    status = job.wait(max(1.0, deadline - time.monotonic()))
    assert time.monotonic() < deadline, "the job did not end within the timeout + 60 s"
    assert status != 0
    the_report(job, [3])
    assert_only_committed_checkpoints(tmp_path / "ckpt")
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".staging")]


@pytest.mark.slow
def test_a_killed_rank_is_named_and_the_supervisor_continues_on_fewer_devices(
    tmp_path: pathlib.Path,
) -> None:
    """tools/elastic_run.py launches the 4-rank job; rank 1 is killed after 7 iterations (the
    checkpoint of iteration 4 the latest); the supervisor relaunches on the 3 devices left with
    --plan auto and --load, and the run ends at --exit-interval 10 with the uninterrupted
    losses."""
    save, metrics = tmp_path / "ckpt", tmp_path / "fault.jsonl"
    flags = [
        "--cluster",
        str(CLUSTER),
        "--plan",
        str(PLAN),
        *SCHEDULE,
        "--exit-interval",
        "10",
        "--metrics-file",
        str(metrics),
        "--save",
        str(save),
        "--save-interval",
        "4",
    ]
    job = Job(supervised(flags))
    job.wait_for_iterations(metrics, 7)
    sent = job.send(1, signal.SIGKILL)
    while job.first_line_time("stderr", "stopped answering") is None:
        assert time.monotonic() - sent < TIMEOUT_MIN * 60 + 60, job.text("stderr")[-3000:]
        time.sleep(0.02)
    # the killed run is the uninterrupted reference up to where it was killed (read before the
    # relaunch drops the metrics after the loaded iteration)
    expected = train_losses(metrics)
    assert set(range(1, 8)) <= set(expected)
    assert job.wait(240) == 0, job.text("stderr")[-3000:]
    the_report(job, [1])
    out = job.text("stdout")
    assert "elastic_run: iteration" in out and "ranks [1] lost" in out, out[-3000:]
    assert "restart 1 of 3 on the 3 devices left" in out and f"--load {save}" in out
    assert (
        "> elastic restart from iteration 4: the checkpoint was written by 4 ranks "
        "(2 x emu-fast (emulated), 2 x emu-slow (emulated))"
    ) in out, out[-3000:]
    assert "now 3 ranks (1 x emu-fast (emulated), 2 x emu-slow (emulated))" in out
    assert "devices lost: 1 x emu-fast (emulated)" in out
    assert "global batch 8 kept" in out and "predicted iteration time now" in out
    got = train_losses(metrics)
    assert sorted(got) == list(range(1, 11))
    for i in range(5, 8):
        assert abs(got[i] - expected[i]) <= 2e-4 * abs(expected[i]), (i, got[i], expected[i])
    assert not [p for p in save.iterdir() if p.name.startswith(".staging")]
    assert (save / "elastic" / "cluster_1.yaml").is_file()


@pytest.mark.slow
def test_a_lost_node_is_named_on_the_node_left_within_the_timeout(tmp_path: pathlib.Path) -> None:
    """Two torchrun agents (nodes) of 2 ranks each; node 1 (ranks 2-3, the logging rank among
    them; node 0's agent serves the store) is killed whole, agent and workers: node 0's job
    ends within the timeout with one report line, on rank 0, naming ranks 2 and 3."""
    save, metrics = tmp_path / "ckpt", tmp_path / "fault.jsonl"
    flags = [
        "--cluster",
        str(CLUSTER),
        "--plan",
        str(PLAN),
        *SCHEDULE,
        "--metrics-file",
        str(metrics),
        "--save",
        str(save),
        "--save-interval",
        "2",
    ]
    port = free_port()
    nodes = [Job(node_torchrun(n, 2, 2, port, flags)) for n in (0, 1)]
    try:
        nodes[0].wait_for_iterations(metrics, 3)
        sent = nodes[1].send_all(signal.SIGKILL)
        status = nodes[0].wait(TIMEOUT_MIN * 60 + 60)
        assert time.monotonic() - sent < TIMEOUT_MIN * 60 + 60
    finally:
        for node in nodes:
            node.send_all(signal.SIGKILL)
            node.wait(10)
    assert status != 0
    report = the_report(nodes[0], [2, 3], reporter=0)
    assert "pipeline 0 stage 1" in report and "pipeline 1 stage 1" in report
    short = [
        line for line in nodes[0].text("stderr").splitlines() if line.startswith("error: rank 1:")
    ]
    assert all(line.endswith("(the report is on rank 0)") for line in short), short
    assert read_failure(save)["lost_ranks"] == [2, 3]
    assert_only_committed_checkpoints(save)
    assert not [p for p in save.iterdir() if p.name.startswith(".staging")]


@pytest.mark.slow
def test_a_rank_that_never_starts_fails_start_up_with_one_line() -> None:
    port = free_port()
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    result = subprocess.run(
        [
            sys.executable,
            "pretrain_llama.py",
            "--model",
            "tiny",
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "300",
            "--seq-length",
            "32",
            "--train-iters",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--distributed-timeout-minutes",
            "0.05",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: start-up: rank 0 could not join the 2-rank rendezvous"
    ), result.stderr[-2000:]
    assert "raise --distributed-timeout-minutes" in errors[0]


@pytest.mark.slow
def test_the_supervisors_of_a_two_node_job_continue_on_the_devices_left(
    tmp_path: pathlib.Path,
) -> None:
    """One supervisor per node (node 0: ranks 0-1, emu-fast; node 1: ranks 2-3, emu-slow) on
    this host; rank 3 is killed after 7 iterations. Both supervisors read the same record,
    relaunch on the cluster left (node 1 with the devices it has left, or without node 1 if
    its other rank was lost too) at the next port, and the run ends at --exit-interval 10
    with the uninterrupted losses."""
    save, metrics = tmp_path / "ckpt", tmp_path / "fault.jsonl"
    cluster = tmp_path / "two_nodes.yaml"
    cluster.write_text(TWO_NODE_CLUSTER)
    flags = [
        "--cluster",
        str(cluster),
        "--plan",
        str(PLAN),
        *SCHEDULE,
        "--exit-interval",
        "10",
        "--metrics-file",
        str(metrics),
        "--save",
        str(save),
        "--save-interval",
        "4",
    ]
    port = free_port()
    nodes = [
        Job(
            [
                sys.executable,
                str(REPO / "tools" / "elastic_run.py"),
                "--node-rank",
                str(n),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--node-addr",
                "127.0.0.1",
                "--job-id",
                "two-nodes",
                "--",
                *MODEL_FLAGS,
                *flags,
            ]
        )
        for n in (0, 1)
    ]
    try:
        nodes[0].wait_for_iterations(metrics, 7)
        sent = nodes[1].send(3, signal.SIGKILL)
        while read_failure(save) is None:
            assert time.monotonic() - sent < TIMEOUT_MIN * 60 + 60
            time.sleep(0.05)
        expected = train_losses(metrics)
        lost = read_failure(save)["lost_ranks"]
        assert 3 in lost and set(lost) <= {2, 3}, lost
        assert nodes[0].wait(240) == 0, nodes[0].text("stderr")[-3000:]
        status_1 = nodes[1].wait(60)
    finally:
        for node in nodes:
            node.send_all(signal.SIGKILL)
            node.wait(10)
    out_0, out_1 = nodes[0].text("stdout"), nodes[1].text("stdout")
    assert "restart 1 of 3" in out_0 and "this node now node 0 of" in out_0, out_0[-2000:]
    if lost == [3]:  # node 1 kept one device: it ran the rest of the job too
        assert status_1 == 0 and "this node now node 1 of 2 with 1 ranks" in out_1
    else:  # node 1 lost both: it left the job
        assert "no device of this node (node 1 of the first launch) is left" in out_1
    got = train_losses(metrics)
    assert sorted(got) == list(range(1, 11))
    for i in range(5, 8):
        assert abs(got[i] - expected[i]) <= 2e-4 * abs(expected[i]), (i, got[i], expected[i])
    assert (save / "elastic" / "cluster_1.yaml").is_file()


@pytest.mark.slow
def test_the_supervisors_of_a_two_node_job_stop_at_once_on_an_error_of_its_own(
    tmp_path: pathlib.Path,
) -> None:
    """A run that fails on a flag of its own (a plan file that does not exist) is not a lost
    peer: its ranks record the error, and both supervisors stop with its status at once
    instead of waiting the timeout (5 minutes here) for a lost peer's record."""
    save = tmp_path / "ckpt"
    cluster = tmp_path / "two_nodes.yaml"
    cluster.write_text(TWO_NODE_CLUSTER)
    flags = [
        "--cluster",
        str(cluster),
        "--plan",
        str(tmp_path / "missing.json"),
        "--train-iters",
        "4",
        "--distributed-timeout-minutes",
        "5",
        "--save",
        str(save),
    ]
    port = free_port()
    nodes = [
        Job(
            [
                sys.executable,
                str(REPO / "tools" / "elastic_run.py"),
                "--node-rank",
                str(n),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--node-addr",
                "127.0.0.1",
                "--job-id",
                "bad-flag",
                "--",
                *MODEL_FLAGS,
                *flags,
            ]
        )
        for n in (0, 1)
    ]
    try:
        statuses = [node.wait(150) for node in nodes]  # far below the 330 s wait of a peer loss
    finally:
        for node in nodes:
            node.send_all(signal.SIGKILL)
            node.wait(10)
    record = read_failure(save)
    assert record["run_id"] == "bad-flag-0" and record["lost_ranks"] == []
    assert "missing.json" in record["line"], record
    for node, status in zip(nodes, statuses):
        out = node.text("stdout")
        assert status != 0 and "an error of its own" in out and "no relaunch" in out, out[-2000:]
    assert not (save / "elastic" / "cluster_1.yaml").exists()


@pytest.mark.slow
def test_a_file_one_node_lacks_stops_every_rank_with_one_line() -> None:
    """Rank 1's data path does not exist (its node lacks the dataset): both ranks stop at once
    with the same line naming rank 1, instead of rank 0 waiting out the timeout."""
    port = free_port()
    common = [
        "--model",
        "tiny",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "300",
        "--seq-length",
        "32",
        "--train-iters",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--distributed-timeout-minutes",
        "5",
    ]
    data = {0: ["--mock-data"], 1: ["--data-path", "/nonexistent/corpus_text_document"]}
    ranks = [
        subprocess.Popen(
            [sys.executable, "pretrain_llama.py", *common, *data[rank]],
            cwd=REPO,
            env=dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    started = time.monotonic()
    outputs = [proc.communicate(timeout=120) for proc in ranks]
    assert time.monotonic() - started < 60  # not the 5-minute timeout
    for proc, (_, err) in zip(ranks, outputs):
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and errors == [
            "error: rank 1: data file /nonexistent/corpus_text_document.idx does not exist; "
            "check --data-path (a prefix without .bin/.idx) or run tools/preprocess_data.py"
        ], err[-2000:]
