"""Faults on the emulated 4-rank cluster (EMULATION): how fast a lost rank is detected, and how
close a resumed and an elastic (fewer devices, new plan) run stay to the uninterrupted one.

    python -m bench.faults [--timeout-minutes 1] [--skip-resume]

Detection: the job trains with ``--distributed-timeout-minutes T``; once it has logged 3
iterations rank 3 is stopped (SIGSTOP), or, in a second job, rank 1 is killed (SIGKILL). The
figures are the seconds from the signal to the first report line ("... stopped answering")
and to the end of the job (torchrun kills a stopped worker 30 s after the others failed).
Lost node: the same job as two torchrun agents (nodes) of 2 ranks; node 1 (not serving the
store) is killed whole (SIGKILL to its agent and workers), or, in a second job, node 0 (which
serves the store) is stopped whole (SIGSTOP: a machine that stops answering without closing its
connections); the figures are seconds to the report line and to the end of the other node's job.
Resume: an uninterrupted run of 6 iterations, a run killed after a checkpoint, its restart
with the same command, and a restart on 3 ranks (``--plan auto``); the figures are the largest
loss differences against the uninterrupted run. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import signal
import subprocess
import tempfile
from typing import Any

from bench.fault_jobs import (
    CLUSTER,
    CLUSTER_WITHOUT_RANK_1,
    PLAN,
    REPO,
    Job,
    free_port,
    node_torchrun,
    torchrun,
    train_losses,
)


def detection(tmp: pathlib.Path, timeout_min: float, victim: int, signum: int) -> dict:
    metrics = tmp / f"detect_{victim}.jsonl"
    job = Job(
        torchrun(
            4,
            [
                "--cluster",
                str(CLUSTER),
                "--plan",
                str(PLAN),
                "--train-iters",
                "100000",
                "--metrics-file",
                str(metrics),
                "--distributed-timeout-minutes",
                str(timeout_min),
            ],
        )
    )
    job.wait_for_iterations(metrics, 3)
    sent = job.send(victim, signum)
    status = job.wait(timeout_min * 60 + 120)
    return {"signal": signal.Signals(signum).name, "rank": victim, **_outcome(job, sent, status)}


def _outcome(job: Job, sent: float, status: int) -> dict:
    """When the report line came and the job ended after the signal, and the line."""
    report = job.first_line_time("stderr", "stopped answering")
    end = max(t for name in job.lines for t, _ in job.lines[name])
    line = next((l for _, l in job.lines["stderr"] if "stopped answering" in l), None)
    return {
        "exit_status": status,
        "report_after_s": None if report is None else round(report - sent, 2),
        "job_end_after_s": round(end - sent, 2),
        "report_line": line,
    }


def node_detection(tmp: pathlib.Path, timeout_min: float, victim: int, signum: int) -> dict:
    metrics = tmp / f"node_{victim}.jsonl"
    flags = [
        "--cluster",
        str(CLUSTER),
        "--plan",
        str(PLAN),
        "--train-iters",
        "100000",
        "--metrics-file",
        str(metrics),
        "--distributed-timeout-minutes",
        str(timeout_min),
    ]
    port = free_port()
    nodes = [Job(node_torchrun(n, 2, 2, port, flags)) for n in (0, 1)]
    left = nodes[1 - victim]
    try:
        left.wait_for_iterations(metrics, 3)
        sent = nodes[victim].send_all(signum)
        status = left.wait(timeout_min * 60 + 120)
    finally:
        for node in nodes:
            node.send_all(signal.SIGKILL)
            node.wait(10)
    return {"signal": signal.Signals(signum).name, "node": victim, **_outcome(left, sent, status)}


def _finished(cmd: list[str]) -> None:
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if result.returncode:
        raise SystemExit(f"run failed:\n{result.stderr[-3000:]}")


def resume(tmp: pathlib.Path) -> dict[str, Any]:
    schedule = [
        "--train-iters",
        "500",
        "--exit-interval",
        "6",
        "--distributed-timeout-minutes",
        "0.1",
    ]
    base = ["--cluster", str(CLUSTER), "--plan", str(PLAN), *schedule]
    _finished(torchrun(4, [*base, "--metrics-file", str(tmp / "ref.jsonl")]))
    expected = train_losses(tmp / "ref.jsonl")
    save = tmp / "ckpt"
    job = Job(
        torchrun(
            4,
            [
                *base,
                "--metrics-file",
                str(tmp / "killed.jsonl"),
                "--save",
                str(save),
                "--save-interval",
                "2",
                "--exit-interval",
                "100000",
            ],
        )
    )
    job.wait_for_iterations(tmp / "killed.jsonl", 3)
    job.send(1, signal.SIGKILL)
    job.wait(120)
    _finished(
        torchrun(4, [*base, "--load", str(save), "--metrics-file", str(tmp / "resumed.jsonl")])
    )
    (tmp / "cluster3.yaml").write_text(CLUSTER_WITHOUT_RANK_1)
    _finished(
        torchrun(
            3,
            [
                "--cluster",
                str(tmp / "cluster3.yaml"),
                "--plan",
                "auto",
                *schedule,
                "--load",
                str(save),
                "--save",
                str(tmp / "c3"),
                "--metrics-file",
                str(tmp / "elastic.jsonl"),
            ],
        )
    )
    out: dict[str, Any] = {}
    for name in ("resumed", "elastic"):
        got = train_losses(tmp / f"{name}.jsonl")
        out[f"{name}_iterations"] = sorted(got)
        out[f"{name}_max_abs_diff"] = max(abs(got[i] - expected[i]) for i in got)
        out[f"{name}_max_rel_diff"] = max(abs(got[i] - expected[i]) / abs(expected[i]) for i in got)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-minutes", type=float, default=1.0)
    parser.add_argument("--skip-resume", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        result: dict[str, Any] = {
            "bench": "faults",
            "emulated": True,
            "host": platform.node(),
            "cluster": "scripts/clusters/cpu_emulated.yaml (4 ranks, EMULATION)",
            "timeout_minutes": args.timeout_minutes,
            "detection": [
                detection(tmp, args.timeout_minutes, 3, signal.SIGSTOP),
                detection(tmp, args.timeout_minutes, 1, signal.SIGKILL),
            ],
            "lost_node": [
                node_detection(tmp, args.timeout_minutes, 1, signal.SIGKILL),
                node_detection(tmp, args.timeout_minutes, 0, signal.SIGSTOP),
            ],
        }
        if not args.skip_resume:
            result["resume"] = resume(tmp)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
