"""What ``--profile``'s own timeline costs an iteration (EMULATION: the CPU-emulated cluster).

Trains scripts/clusters/cpu_emulated.yaml's 4 ranks under torchrun with the interleaved plan
(scripts/plans/cpu_emulated_interleaved.json: 2 device groups x 2 chunks, tp=2 on both, 8
micro-batches, so each iteration records some 600 spans per rank: computes, transfer posts and
waits, TP and DP collectives) twice per round: without ``--profile`` and with it on every rank
over every iteration after the warm-up. The runs alternate (off, on, on, off, ...), the first
``--warmup`` iterations of each are dropped, and each run's figure is its median iteration time
(the metrics file's ``iteration_time_s``); the overhead is the median over rounds of
``on / off - 1``, with the spread of those ratios. The merge after the window (a barrier,
the spans sent to the logging rank, the trace written) runs once, after the last iteration,
outside the iterations timed.

End to end, the runs' iteration times spread by more than the recording costs on a shared
2-core host, so the benchmark also times the recorder itself: ``--span-calls`` nested spans in
this process (the host clock read twice and a span kept per call), and the cost per span times
the spans a rank recorded per iteration, over the median unprofiled iteration, is
``direct_overhead``.

    .venv/bin/python -m bench.timeline_overhead --rounds 3

Prints one JSON object. About 4 minutes with the defaults on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "scripts" / "clusters" / "cpu_emulated.yaml"
PLAN = REPO / "scripts" / "plans" / "cpu_emulated_interleaved.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=12, help="iterations per run")
    p.add_argument("--warmup", type=int, default=3, help="iterations dropped per run")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--span-calls", type=int, default=200_000, help="spans timed in-process")
    args = p.parse_args(argv)
    if args.warmup >= args.iters:
        p.error("--warmup must leave iterations to measure")
    return args


def run(profiled: bool, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One training run; its post-warm-up iteration times and the trace's size."""
    tag = "on" if profiled else "off"
    metrics = workdir / f"{tag}.jsonl"
    metrics.unlink(missing_ok=True)
    board = workdir / f"board-{tag}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]
    cmd += [str(REPO / "pretrain_llama.py"), "--model", "small", "--num-layers", "8"]
    cmd += ["--seq-length", str(args.seq_length), "--cluster", str(CLUSTER), "--plan", str(PLAN)]
    cmd += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4095"]
    cmd += ["--train-iters", str(args.iters), "--eval-iters", "0", "--log-interval", "1"]
    cmd += ["--metrics-file", str(metrics), "--tensorboard-dir", str(board)]
    if profiled:
        cmd += ["--profile", "--profile-step-start", str(args.warmup + 1)]
        cmd += ["--profile-step-end", str(args.iters + 1), "--profile-ranks", "0", "1", "2", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"error: the {tag} run failed (exit {done.returncode}):\n{tail}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [
        r["iteration_time_s"]
        for r in records
        if r.get("split") == "train" and r["iteration"] > args.warmup
    ]
    traces = list(board.glob("timeline_*.json"))
    if profiled and len(traces) != 1:
        raise SystemExit(f"error: the profiled run wrote {len(traces)} traces, expected 1")
    spans = 0
    if traces:
        events = json.loads(traces[0].read_text())["traceEvents"]
        spans = sum(1 for e in events if e.get("ph") == "X" and e["tid"] % 4 == 0)
    print(
        f"[bench] {tag}: median iteration {statistics.median(times):.4f} s over {len(times)}, "
        f"{wall:.1f} s wall",
        file=sys.stderr,
        flush=True,
    )
    return {"median_s": statistics.median(times), "times_s": times, "spans": spans}


def span_cost_s(calls: int) -> float:
    """Seconds one recorded span costs in this process: the median of 5 batches of
    ``calls`` spans, each with an argument, nested one deep as the executor's are."""
    from megatron_het.trace.recorder import Recorder

    batches = []
    for _ in range(5):
        recorder = Recorder()
        recorder.start()
        start = time.perf_counter()
        for i in range(calls // 2):
            with recorder.span("forward mb0", "compute", micro_batch=i):
                with recorder.span("all_reduce tp", "collective", group="tp"):
                    pass
        batches.append((time.perf_counter() - start) / calls)
        recorder.stop()
    return statistics.median(batches)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ratios, rounds = [], []
    with tempfile.TemporaryDirectory(prefix="timeline-overhead-") as tmp:
        workdir = Path(tmp)
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {profiled: run(profiled, workdir, args) for profiled in order}
            ratio = got[True]["median_s"] / got[False]["median_s"] - 1.0
            ratios.append(ratio)
            rounds.append(
                {
                    "off_median_s": got[False]["median_s"],
                    "on_median_s": got[True]["median_s"],
                    "overhead": ratio,
                    "spans_recorded": got[True]["spans"],
                }
            )
    result = {
        "benchmark": "timeline_overhead",
        "emulation": True,
        "cluster": CLUSTER.name,
        "plan": PLAN.name,
        "model": "small, 8 layers",
        "seq_length": args.seq_length,
        "iters": args.iters,
        "warmup_dropped": args.warmup,
        "rounds": rounds,
        "overhead_median": statistics.median(ratios),
        "overhead_min": min(ratios),
        "overhead_max": max(ratios),
        "spans_per_profiled_run": statistics.median(r["spans_recorded"] for r in rounds),
    }
    per_rank_iteration = result["spans_per_profiled_run"] / 4 / (args.iters - args.warmup)
    cost = span_cost_s(args.span_calls)
    off = statistics.median(r["off_median_s"] for r in rounds)
    result.update(
        spans_per_rank_iteration=per_rank_iteration,
        span_cost_us=cost * 1e6,
        direct_overhead=per_rank_iteration * cost / off,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
