"""Running the configurations of :mod:`bench.hetero_efficiency` and timing them.

Each configuration trains under torchrun on the emulated cluster (EMULATION: every kind is a
CPU rank slowed to its kind's speed) with a metrics file; :func:`measure` runs them in
interleaved rounds, every other round in reverse order, and keeps the post-warm-up tokens/s,
iteration times and the late compute regions each run's ranks reported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.hetero_plans import BASE_CLUSTER
from bench.settle import settle
from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]
LATE_WARNING = re.compile(r"(\d+) of (\d+) compute regions (?:took longer than|overran)")


def launch(
    name: str,
    cluster: Path,
    plan: Path,
    ranks: int,
    iters: int,
    metrics: Path,
    args: argparse.Namespace,
    model: ModelConfig,
    device_profile: Path | None,
) -> subprocess.Popen:
    """Start one configuration's training under torchrun (stdout and stderr to a log file);
    ``device_profile`` times the emulated stages (None: their measured CPU time)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(ranks),
        str(REPO / "pretrain_llama.py"),
        "--model",
        args.model,
        "--num-layers",
        str(model.num_layers),
        "--seq-length",
        str(args.seq_length),
        "--cluster",
        str(cluster),
        "--plan",
        str(plan),
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(model.vocab_size - 1),  # + its eod id = the model's vocabulary
        "--train-iters",
        str(iters),
        "--lr",
        "1e-4",
        "--lr-warmup-iters",
        "0",
        "--eval-iters",
        "0",
        "--log-interval",
        "1",
        "--metrics-file",
        str(metrics),
    ]
    if device_profile is not None:
        cmd += ["--emulation-profile", str(device_profile)]
    # One thread per rank: the ranks share the host's cores, and more threads only contend.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with metrics.with_suffix(".log").open("w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
        )


def late_regions(log: str) -> tuple[int, int]:
    """(late, of) compute regions summed over the ranks that reported late ones in a run's
    log (an emulated region is late when the host could not run it within its kind's time)."""
    late = of = 0
    for match in LATE_WARNING.finditer(log):
        late += int(match.group(1))
        of += int(match.group(2))
    return late, of


def finish(
    name: str,
    proc: subprocess.Popen,
    metrics: Path,
    iters: int,
    start: float,
    args: argparse.Namespace,
) -> tuple[list[dict[str, Any]], tuple[int, int]]:
    """Wait for a launched run; its metrics-file lines of split "train" and its
    :func:`late_regions`."""
    try:
        code = proc.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - start)))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"error: run {name} did not finish in {args.timeout:g} s") from None
    if code != 0:
        lines = metrics.with_suffix(".log").read_text().strip().splitlines()
        tail = "\n".join(lines[-15:])
        raise SystemExit(f"error: run {name} failed (exit {code}):\n{tail}")
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [line for line in lines if line.get("split") == "train"]
    print(
        f"[bench] {name}: {len(train)} iterations in {time.perf_counter() - start:.1f} s, "
        f"tokens/s {[round(t['tokens_per_s'], 1) for t in train]}",
        file=sys.stderr,
        flush=True,
    )
    if len(train) != iters:
        raise SystemExit(f"error: run {name} logged {len(train)} iterations, expected {iters}")
    return train, late_regions(metrics.with_suffix(".log").read_text())


def slowdown_ratio() -> float:
    """emu-slow's slowdown over emu-fast's in the cluster file (2 in cpu_emulated.yaml)."""
    cluster = ClusterSpec.load(BASE_CLUSTER)  # the undilated one
    kinds = {
        cluster.accelerator_of(r).name: cluster.accelerator_of(r).slowdown
        for r in range(cluster.world_size)
    }
    return kinds["emu-slow"] / kinds["emu-fast"]


def iterations(name: str, args: argparse.Namespace) -> int:
    """Training iterations of a configuration: the fast-only job runs longer when it runs next
    to the slow-only one (by the kinds' slowdown ratio, so about the same wall time)."""
    if name == "fast" and args.baselines == "together":
        return args.warmup + round(slowdown_ratio() * (args.iters - args.warmup))
    return args.iters


def measure(
    inputs: dict[str, tuple[Path, Path, int]],
    work: Path,
    args: argparse.Namespace,
    model: ModelConfig,
    device_profile: Path | None,
) -> dict[str, dict[str, Any]]:
    """Run the configurations in interleaved rounds, every other round in reverse order (a
    host speed drifting steadily then favours no configuration over two rounds); per
    configuration, the post-warm-up tokens/s and iteration times of every round, and the late
    regions its ranks reported (summed over rounds). Each run's warm-up lasts until its
    iteration times settle (:mod:`bench.settle`, at least ``--warmup`` iterations dropped);
    how many were dropped, and the runs that never settled, are kept too."""
    samples: dict[str, dict[str, Any]] = {
        name: {
            "tokens_per_s": [],
            "iteration_time_s": [],
            "round_medians": [],
            "late": [0, 0],
            "warmup_dropped": [],
            "unsettled_runs": 0,
        }
        for name in args.configs
    }
    batches = [("fast", "slow")] if args.baselines == "together" else [("fast",), ("slow",)]
    batches += [(name,) for name in args.configs if name not in ("fast", "slow")]
    for round_index in range(args.rounds):
        for batch in batches if round_index % 2 == 0 else batches[::-1]:
            start = time.perf_counter()
            running = {}
            for name in batch:
                cluster, plan, ranks = inputs[name]
                metrics = work / f"metrics_{name}_r{round_index}.jsonl"
                running[name] = (
                    launch(
                        name,
                        cluster,
                        plan,
                        ranks,
                        iterations(name, args),
                        metrics,
                        args,
                        model,
                        device_profile,
                    ),
                    metrics,
                )
            for name, (proc, metrics) in running.items():
                train, (late, of) = finish(name, proc, metrics, iterations(name, args), start, args)
                samples[name]["late"][0] += late
                samples[name]["late"][1] += of
                times = [line["iteration_time_s"] for line in train]
                steady = settle(times, least=args.warmup, keep=min(3, len(times) - args.warmup))
                samples[name]["warmup_dropped"].append(steady.dropped)
                samples[name]["unsettled_runs"] += not steady.settled
                kept = train[steady.dropped :]
                tokens = [line["tokens_per_s"] for line in kept]
                samples[name]["tokens_per_s"] += tokens
                samples[name]["iteration_time_s"] += [line["iteration_time_s"] for line in kept]
                samples[name]["round_medians"].append(statistics.median(tokens))
    return samples
