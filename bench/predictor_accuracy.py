"""Check the performance predictor against real runs on the CPU-emulated cluster.

    .venv/bin/python -m bench.predictor_accuracy [--model small --seq-length 256 --iters 6]

EMULATION: scripts/clusters/cpu_emulated.yaml (2 emu-fast + 2 emu-slow ranks on this machine),
with both kinds' slowdowns x ``--dilation`` (1: as in the file).

1. Profiles this machine as the "cpu" kind (one thread, as every torchrun rank runs): per-layer,
   embedding, head and optimizer times (:func:`megatron_het.perf.measure.profiler.profile_device`)
   and the communicator's gloo figures. Just before and just after each run it measures the
   host-sharing figures (:func:`megatron_het.emulation.host_measure.measure_host_sharing`: how much
   slower a compute pass runs with 1..4 processes computing at once than the profile says) and
   predicts with their mean, because a shared machine's load from other work changes; just before
   each run also the wall and CPU time of one TP collective between computing peers
   (:func:`megatron_het.emulation.host_measure.measure_host_collective`).
2. Runs every plan (5 of scripts/plans/, one with stage bounds inside layers, and more,
   written to a temporary directory) through
   ``torchrun --nproc_per_node 4 pretrain_llama.py --mock-data`` in fp32 and takes the median
   iteration time after the warm-up iterations from the metrics file. With ``--device-time
   profile`` (the default) the runs time each emulated stage from the same profile
   (``--emulation-profile``): every emulated kind then has the speed the predictor is given,
   as a real device's would be known, and what is compared is the model of the run (pipeline,
   transfers, DP sync, optimizer, ranks sharing the host) rather than how far the host's own
   speed drifted since it was profiled (up to 10% between reruns of this bench in measured
   mode). ``--device-time measured`` pads each region to slowdown x its measured CPU time.
3. Predicts each plan with :func:`megatron_het.perf.predict`, that profile and the shared-host
   rate model (:class:`megatron_het.emulation.host_model.SharedHostModel`).

Run it on an otherwise idle machine: other work lands in the figures. Prints one line per plan
(stderr), then one JSON line last: per-plan {plan, predicted_s, measured_s, error} with error =
(predicted - measured) / measured, median_abs_error, max_abs_error and the conditions. Nothing is
fitted to the runs: the prediction uses the profile only.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from bench.emulated_cluster import dilated_cluster
from bench.settle import settle
from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.emulation.host_measure import measure_host_collective, measure_host_sharing
from megatron_het.emulation.host_model import SharedHostModel
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import Profile, predict
from megatron_het.perf.cost.roofline import LayerShape
from megatron_het.perf.measure.communicator_figures import measure_comm
from megatron_het.perf.measure.profiler import Sweep, profile_device

ROOT = Path(__file__).resolve().parent.parent

CLUSTER = ROOT / "scripts" / "clusters" / "cpu_emulated.yaml"
# Repetitions of the measurements; medians are taken (the machine may carry other load).
COMM_ITERS = 21
SHARING_PASSES = 4
SHARING_ROUNDS = 1
COLLECTIVE_PASSES = 8
SCRIPT_PLANS = (
    "cpu_emulated_3stage",
    "cpu_emulated_dp2_fast_heavy",
    "cpu_emulated_pp4",
    "cpu_emulated_tp2_pp2",
    "cpu_emulated_half_layers",
)


def _stage(kind: str, tp: int, layers: tuple[int, int], ranks: list[int]) -> dict:
    return {"accelerator": kind, "tp": tp, "layers": list(layers), "ranks": ranks}


def extra_plans() -> dict[str, dict]:
    """More plans for the 4-layer presets: pure DP over both kinds with more micro-batches on
    the fast pair, TP=2 x PP=2 with a non-uniform split, DP=2 x PP=2 uniform, PP=2 x DP=2
    with the slow kind first; then the three options of the runtime's newer schedules:
    DP=2 x PP=2 interleaved (2 chunks of 1 layer per rank; also with 5 micro-batches per
    replica, run in micro-batch groups of 3 and 2), heterogeneous DP (one replica a
    single emu-fast rank, the other two stages: the emu-slow pair at tp=2, then emu-fast) with
    the batch shared by speed, and TP=2 x PP=2 with sequence parallelism."""

    def plan(description: str, pipelines: list[tuple[int, list[dict]]], **keys: object) -> dict:
        return {
            "format": "megatron_het.plan/1",
            "description": f"EMULATION: {description}",
            "micro_batch_size": 2,
            **keys,
            "pipelines": [{"micro_batches": m, "stages": s} for m, s in pipelines],
        }

    def interleaved(fast: int, slow: int) -> list[dict]:
        return [
            _stage("emu-fast", 1, (0, 1), [fast]),
            _stage("emu-slow", 1, (1, 2), [slow]),
            _stage("emu-fast", 1, (2, 3), [fast]),
            _stage("emu-slow", 1, (3, 4), [slow]),
        ]

    return {
        "dp2_pp2_interleaved_v2": plan(
            "dp=2 x pp=2, 2 interleaved chunks of 1 layer per rank",
            [(2, interleaved(0, 2)), (2, interleaved(1, 3))],
        ),
        "dp2_pp2_interleaved_m5": plan(
            "dp=2 x pp=2, 2 interleaved chunks of 1 layer per "
            "rank, 5 micro-batches each (micro-batch groups 3 + 2)",
            [(5, interleaved(0, 2)), (5, interleaved(1, 3))],
        ),
        "hetero_dp_fast_vs_slow_pair": plan(
            "heterogeneous dp=2: emu-fast rank 0 alone (5 micro-batches); the emu-slow pair "
            "(tp=2, 2 layers) then emu-fast rank 1 (2 layers) (3 micro-batches)",
            [
                (5, [_stage("emu-fast", 1, (0, 4), [0])]),
                (3, [_stage("emu-slow", 2, (0, 2), [2, 3]), _stage("emu-fast", 1, (2, 4), [1])]),
            ],
        ),
        "tp2_pp2_sp": plan(
            "tp=2 x pp=2 with sequence parallelism, 3 layers on the emu-fast pair",
            [(4, [_stage("emu-fast", 2, (0, 3), [0, 1]), _stage("emu-slow", 2, (3, 4), [2, 3])])],
            sequence_parallel=True,
        ),
        "tp2_pp2_sp_overlap": plan(
            "the same with --tp-comm-overlap (the sequence's gathers "
            "and reduce-scatters as rings beside the GEMMs)",
            [(4, [_stage("emu-fast", 2, (0, 3), [0, 1]), _stage("emu-slow", 2, (3, 4), [2, 3])])],
            sequence_parallel=True,
            tp_comm_overlap=True,
        ),
        "dp4_fast3_slow1": plan(
            "dp=4, 3 micro-batches per emu-fast rank, 1 per emu-slow",
            [
                (3, [_stage("emu-fast", 1, (0, 4), [0])]),
                (3, [_stage("emu-fast", 1, (0, 4), [1])]),
                (1, [_stage("emu-slow", 1, (0, 4), [2])]),
                (1, [_stage("emu-slow", 1, (0, 4), [3])]),
            ],
        ),
        "tp2_pp2_fast3": plan(
            "tp=2 x pp=2, 3 layers on the emu-fast pair, 1 on emu-slow",
            [(4, [_stage("emu-fast", 2, (0, 3), [0, 1]), _stage("emu-slow", 2, (3, 4), [2, 3])])],
        ),
        "dp2_pp2_uniform": plan(
            "dp=2 x pp=2, 2 layers per stage",
            [
                (2, [_stage("emu-fast", 1, (0, 2), [0]), _stage("emu-slow", 1, (2, 4), [2])]),
                (2, [_stage("emu-fast", 1, (0, 2), [1]), _stage("emu-slow", 1, (2, 4), [3])]),
            ],
        ),
        "pp2_slow_first_tp2": plan(
            "pp=2, the emu-slow pair first (tp=2, 1 layer), emu-fast pair second (tp=2, 3 layers)",
            [(3, [_stage("emu-slow", 2, (0, 1), [2, 3]), _stage("emu-fast", 2, (1, 4), [0, 1])])],
        ),
    }


def make_profile(
    model_name: str, seq: int, micro_batches: tuple[int, ...], out: Path, log
) -> Profile:
    """The host's "cpu" profile with communicator figures (one thread, as a rank runs)."""
    torch.set_num_threads(1)
    model = model_preset(model_name)
    sweep = Sweep(
        seq_lengths=(seq,),
        micro_batch_sizes=micro_batches,
        tp_sizes=(1, 2),
        dtype="fp32",
        warmup=2,
        iters=9,
    )
    comm = measure_comm(warmup=3, iters=COMM_ITERS)
    for entry in comm:
        log(
            f"  profile: comm {entry.op}: {entry.bandwidth_gbps:.3f} GB/s, "
            f"{entry.latency_s * 1e6:.1f} us"
        )
    profile = profile_device(
        model,
        sweep,
        "cpu",
        torch.device("cpu"),
        comm=False,
        progress=lambda line: log(f"  profile: {line}"),
    )
    profile = dataclasses.replace(profile, comm=comm)
    profile.save(out)
    return profile


def host_sharing_now(
    profile: Profile, model_name: str, seq: int, micro_batch: int
) -> tuple[float, ...]:
    """Host-sharing figures measured now (1..4 processes computing), against the profile's own
    forward + backward time of that layer, so a change in the machine's load since the profile
    was measured is part of them."""
    model = model_preset(model_name)
    layer = profile.layer(LayerShape.of(model, seq, micro_batch, 1), "fp32")
    return measure_host_sharing(
        model,
        seq,
        micro_batch,
        tp=1,
        max_processes=4,
        passes=SHARING_PASSES,
        rounds=SHARING_ROUNDS,
        reference_s=layer.forward_s + layer.backward_s,
    )


def run_plan(
    plan_path: Path,
    plan: ParallelPlan,
    args: argparse.Namespace,
    work: Path,
    name: str,
    cluster: Path,
    device_profile: Path | None,
) -> tuple[float, list[float]]:
    """Median iteration time (s) after the warm-up (until the times settle,
    :mod:`bench.settle`; at least ``--warmup`` iterations), and all of them; the emulated
    stages timed from ``device_profile`` (None: from their measured CPU time)."""
    metrics = work / f"{name}.metrics.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "4",
        str(ROOT / "pretrain_llama.py"),
        "--model",
        args.model,
        "--seq-length",
        str(args.seq_length),
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(model_preset(args.model).vocab_size - 1),
        "--cluster",
        str(cluster),
        "--plan",
        str(plan_path),
        "--global-batch-size",
        str(plan.global_batch_size),
        "--train-iters",
        str(args.warmup + args.iters),
        "--eval-iters",
        "0",
        "--log-interval",
        "1000",
        "--metrics-file",
        str(metrics),
    ]
    if device_profile is not None:
        cmd += ["--emulation-profile", str(device_profile)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{name}: the run failed ({done.returncode}):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    times = [
        r["iteration_time_s"]
        for r in map(json.loads, metrics.read_text().splitlines())
        if r.get("split") == "train"
    ]
    steady = settle(times, least=args.warmup, keep=min(3, len(times) - args.warmup))
    return steady.median, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small", choices=("tiny", "small"))
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2, help="iterations left out of the median")
    p.add_argument("--iters", type=int, default=10, help="iterations in the median")
    p.add_argument("--profile", help="reuse this cpu profile instead of measuring one")
    p.add_argument("--plans", help="comma-separated plan names (default: all)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument(
        "--device-time",
        choices=("profile", "measured"),
        default="profile",
        help="emulated stages last slowdown x the bench's host profile (profile) or "
        "x their measured CPU time (measured)",
    )
    p.add_argument(
        "--dilation",
        type=float,
        default=2.0,
        help="multiply both emulated kinds' slowdown by this (>= 1): each emulated "
        "device then needs less of a host core",
    )
    args = p.parse_args()
    if args.dilation < 1:
        p.error("--dilation must be >= 1")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="predictor_accuracy_"))
    plans = {name: ROOT / "scripts" / "plans" / f"{name}.json" for name in SCRIPT_PLANS}
    for name, d in extra_plans().items():
        plans[name] = work / f"{name}.json"
        plans[name].write_text(json.dumps(d, indent=1))
    if args.plans:
        plans = {n: plans[n] for n in args.plans.split(",")}
    loaded = {n: ParallelPlan.load(path) for n, path in plans.items()}
    micro = tuple(sorted({pl.micro_batch_size for pl in loaded.values()}))
    if args.profile:
        profile, profile_path = Profile.load(args.profile), Path(args.profile)
    else:
        log("profiling this machine as 'cpu' (1 thread)")
        profile_path = work / "cpu.json"
        profile = make_profile(args.model, args.seq_length, micro, profile_path, log)
    device_profile = profile_path if args.device_time == "profile" else None
    cluster_path = work / "cluster.yaml"
    cluster_path.write_text(
        yaml.safe_dump(dilated_cluster(CLUSTER, args.dilation), sort_keys=False)
    )
    cluster = ClusterSpec.load(cluster_path)
    model = model_preset(args.model)
    rows = []
    for name, plan in loaded.items():
        # The machine's other load drifts over a run: measure the host just before and just
        # after it and take the mean of the two.
        before = host_sharing_now(profile, args.model, args.seq_length, plan.micro_batch_size)
        # Three rounds: their median outlasts one round that other work disturbed (a round at
        # 3x the others once put the sequence-parallel plan's prediction 37% too slow).
        collective = measure_host_collective(
            model, args.seq_length, plan.micro_batch_size, passes=COLLECTIVE_PASSES, rounds=3
        )
        measured, times = run_plan(
            plans[name], plan, args, work, name, cluster_path, device_profile
        )
        after = host_sharing_now(profile, args.model, args.seq_length, plan.micro_batch_size)
        sharing = tuple((a + b) / 2 for a, b in zip(before, after))
        host = dataclasses.replace(profile, host_sharing=sharing, host_collective_s=collective)
        predicted = predict(
            model,
            plan,
            cluster,
            args.seq_length,
            {"cpu": host},
            options=RunOptions.from_plan(plan, dtype="fp32"),
            rate_model=SharedHostModel(),
        ).iteration_time_s
        error = (predicted - measured) / measured
        shown = [round(v, 3) for v in sharing]
        rows.append(
            {
                "plan": name,
                "predicted_s": round(predicted, 4),
                "measured_s": round(measured, 4),
                "error": round(error, 4),
                "host_sharing": shown,
                "tp_collective_wall_cpu_ms": [round(1e3 * v, 3) for v in collective],
            }
        )
        log(
            f"{name:>28}: predicted {predicted:.3f} s, measured {measured:.3f} s "
            f"(iterations {[round(t, 3) for t in times]}), error {100 * error:+.1f}%, "
            f"host sharing {[round(v, 2) for v in before]} before, "
            f"{[round(v, 2) for v in after]} after, TP collective wall/CPU ms "
            f"{[round(1e3 * v, 2) for v in collective]}"
        )
    errors = [abs(r["error"]) for r in rows]
    print(
        json.dumps(
            {
                "benchmark": "predictor_accuracy",
                "plans": rows,
                "median_abs_error": round(statistics.median(errors), 4),
                "max_abs_error": round(max(errors), 4),
                "conditions": {
                    "emulation": True,
                    "cluster": str(CLUSTER.relative_to(ROOT)),
                    "ranks": 4,
                    "dilation": args.dilation,
                    "device_time": args.device_time,
                    "cpu_cores": len(os.sched_getaffinity(0)),
                    "threads_per_rank": 1,
                    "model": args.model,
                    "seq_length": args.seq_length,
                    "dtype": "fp32",
                    "data": "mock",
                    "warmup_iterations": args.warmup,
                    "measured_iterations": args.iters,
                    "host_sharing": "per plan: mean of the figures measured just before and "
                    "just after its run (1..4 processes computing, against the profile's "
                    "layer time)",
                    "comm": [dataclasses.asdict(c) for c in profile.comm],
                    "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                    "device": profile.conditions.device_name,
                    "torch": torch.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds"
                    ),
                    "wall_s": round(time.perf_counter() - start, 1),
                },
            }
        )
    )


if __name__ == "__main__":
    from megatron_het.launcher.host_memory import prefer_huge_pages

    prefer_huge_pages(os.environ)  # as the training runs it starts allocate
    main()
