"""Heterogeneous-training efficiency on the CPU-emulated mixed cluster (EMULATION, not hardware).

scripts/clusters/cpu_emulated.yaml has 4 ranks on this machine: ranks 0-1 of kind emu-fast and
ranks 2-3 of kind emu-slow (half the speed). Each compute region of an emulated rank is padded
to its kind's slowdown x a reference time of its work. With ``--device-time profile`` (the
default) a stage's forward and backward take their slowdown x the stage's figures in the
host profile the bench measures first (``--emulation-profile`` of ``pretrain_llama.py``), so
each emulated kind keeps one speed for the whole benchmark, as a real device would, while the
host's own speed drifts; ``--device-time measured`` pads to slowdown x the region's measured
CPU time instead (for a stage's forward or backward, the least of its recent ones, see
:mod:`megatron_het.emulation`), which carries the host's drift and the CPU-time cost of
sharing its cores into the kinds' speeds. Every configuration trains
through ``pretrain_llama.py`` under torchrun (``python -m torch.distributed.run --standalone
--nproc_per_node N``) on mock data, and its tokens/s is the median, over the iterations after
the warm-up ones, of the metrics file's ``tokens_per_s``. The planner plans every configuration
with a profile of this host (measured first, about ten seconds; ``--profile`` reuses one,
``--roofline`` plans with the kinds' roofline estimates):

    (a) fast  the two emu-fast ranks alone (a 2-rank cluster of that group), the planner's plan
    (b) slow  the two emu-slow ranks alone, the planner's plan
    (c) uniform    all four ranks, the mixed plan's layout with layers split evenly
    (d) planned    all four ranks, the planner's plan (a split suited to the speeds)

    efficiency = d / (a + b)      uniform_efficiency = c / (a + b)

(a) and (b) are two separate jobs, run at the same time by default (``--baselines together``),
as the two halves of a real cluster would train side by side, so the host carries four emulated
devices in every measurement. The fast job runs ``slowdown ratio`` x as many iterations as the
slow one so that both run for about the same time. ``--baselines apart`` runs them one after
the other, each with the host to itself.

``--dilation F`` multiplies both kinds' slowdown by F (ratio kept at 2): the four emulated
devices then need 1.5 / F of the host's cores on average instead of 3 at F = 1, so that a host
with fewer cores than emulated devices does not decide the result (padding to slowdown x the
CPU time absorbs sharing up to the slowdown). F = 2 is the default. The defaults (11 layers,
global batch 256, sequence 256) give the planner's pipeline 64 micro-batches, so that its
fill-and-drain bubble (1/(m + 1) of an iteration at 2 stages) is small as in pretraining, where
micro-batches far outnumber stages, and a layer split (4 + embedding | 7 + head) that balances
the kinds. The configurations run in ``--rounds`` interleaved rounds, every other one in
reverse order (a + b, c, d, d, c, a + b, ...; about 12 minutes each on 2 cores, 2 rounds by
default): this host's speed drifts by several percent over minutes (one run's tokens/s rose
4-12% between its early and late iterations in the runs we looked at), so a single round
compares configurations measured at different host speeds; ``efficiency_per_round`` shows the
spread. The last line printed is one JSON object with the figures and the conditions, next
to ``predicted_efficiency`` (the predictor's figures for the four plans, with the planner's
costs) and ``late_regions`` (regions the host could not finish within their kind's time: they
make a kind slower than its nominal speed).

    .venv/bin/python bench/hetero_efficiency.py
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_het.cluster import ClusterSpec  # noqa: E402
from megatron_het.config import ModelConfig, model_preset  # noqa: E402
from megatron_het.parallel.plan import ParallelPlan  # noqa: E402
from megatron_het.perf import Profile, predict  # noqa: E402
from megatron_het.perf.profiler import Sweep, profile_device  # noqa: E402
from megatron_het.planner import search_plan  # noqa: E402

from emulated_cluster import dilated_cluster  # noqa: E402

CONFIGS = ("fast", "slow", "uniform", "planned")
LATE_WARNING = re.compile(r"(\d+) of (\d+) compute regions (?:took longer than|overran)")
BASE_CLUSTER = REPO / "scripts" / "clusters" / "cpu_emulated.yaml"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="model preset")
    p.add_argument("--num-layers", type=int, default=11,
                   help="layers (overrides the preset's; more layers give the split a finer "
                        "grain)")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--global-batch-size", type=int, default=256,
                   help="sequences per iteration, the same for every configuration")
    p.add_argument("--iters", type=int, default=5, help="training iterations per run")
    p.add_argument("--warmup", type=int, default=2, help="first iterations left out")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the 4 runs")
    p.add_argument("--dilation", type=float, default=2.0,
                   help="multiply both kinds' slowdown by this (>= 1; see the module doc)")
    p.add_argument("--baselines", choices=("together", "apart"), default="together",
                   help="run the fast-only and slow-only jobs at the same time (default) or "
                        "one after the other")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--profile", help="the host's cpu profile for the planner (default: "
                                     "measure one first, about ten seconds)")
    p.add_argument("--device-time", choices=("profile", "measured"), default="profile",
                   help="what an emulated stage's forward and backward last: slowdown x the "
                        "host profile's figures (default) or x their measured CPU time")
    p.add_argument("--roofline", action="store_true",
                   help="plan with the kinds' roofline estimates instead of a profile")
    p.add_argument("--work-dir", default=None, help="keep clusters, plans and metrics here")
    args = p.parse_args()
    if args.iters <= args.warmup:
        p.error("--iters must exceed --warmup")
    if args.dilation < 1:
        p.error("--dilation must be >= 1")
    return args


def cluster_dicts(dilation: float) -> dict[str, dict[str, Any]]:
    """The 4-rank cluster (cpu_emulated.yaml, slowdowns x ``dilation``) and its two 2-rank
    halves, as cluster-file mappings keyed by configuration group ("mixed", "fast", "slow")."""
    mixed = dilated_cluster(BASE_CLUSTER, dilation)
    extra = {"accelerators": mixed["accelerators"]} if "accelerators" in mixed else {}
    halves = {}
    for group in mixed["node_groups"]:
        alone = {k: v for k, v in group.items() if k != "colocate_with"}
        halves[group["name"]] = {"name": f"{mixed['name']}_{group['name']}_only",
                                 "node_groups": [alone], **extra}
    return {"mixed": mixed, **halves}


def uniform_split(plan: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``plan`` with every pipeline's layers spread evenly over its stages (earlier stages take
    the remainder), everything else unchanged."""
    out = json.loads(json.dumps(plan))
    for pipeline in out["pipelines"]:
        stages = pipeline["stages"]
        base, extra = divmod(num_layers, len(stages))
        start = 0
        for i, stage in enumerate(stages):
            count = base + (1 if i < extra else 0)
            stage["layers"] = [start, start + count]
            start += count
    out["description"] = "uniform layer split of the planned layout"
    return out


def host_profile(model: ModelConfig, args: argparse.Namespace,
                 work: Path) -> tuple[Optional[Profile], Optional[Path]]:
    """The "cpu" profile the planner uses (None with ``--roofline``) and the profile file that
    times the emulated stages (None with ``--device-time measured``): ``--profile``, else one
    measured now on one thread, as a rank computes (emulated kinds are this host times their
    slowdown)."""
    if args.roofline and args.device_time == "measured":
        return None, None
    if args.profile:
        path = Path(args.profile)
        profile = Profile.load(path)
    else:
        torch.set_num_threads(1)
        sweep = Sweep(seq_lengths=(args.seq_length,), micro_batch_sizes=(1, 2, 4),
                      tp_sizes=(1, 2), dtype="fp32", warmup=2, iters=7)
        print("[bench] profiling this host as 'cpu' (1 thread) for the planner and the "
              "emulated device times", file=sys.stderr, flush=True)
        profile = profile_device(model, sweep, "cpu", torch.device("cpu"))
        path = work / "cpu.json"
        profile.save(path)
    return (None if args.roofline else profile,
            path.resolve() if args.device_time == "profile" else None)


def searched_plan(model: ModelConfig, cluster_file: Path, args: argparse.Namespace,
                  distributed_optimizer: Optional[bool],
                  profiles: Optional[dict[str, Profile]]) -> dict[str, Any]:
    """The planner's best fp32 plan for the cluster (with the host profile, else roofline
    estimates of the kinds), with ``use_distributed_optimizer`` forced to
    ``distributed_optimizer`` when given."""
    result = search_plan(model, ClusterSpec.load(cluster_file), args.global_batch_size,
                         args.seq_length, profiles=profiles, dtype="fp32")
    plan = result.plan.to_dict()
    if distributed_optimizer is not None:
        plan["use_distributed_optimizer"] = distributed_optimizer
    return plan


def describe(plan: dict[str, Any]) -> str:
    """One line: per pipeline, its micro-batches and stages as kind:layers."""
    parts = []
    for pipeline in plan["pipelines"]:
        stages = " | ".join(f"{s['accelerator']} tp{s['tp']} L{s['layers'][0]}-{s['layers'][1]}"
                            f" r{s['ranks']}" for s in pipeline["stages"])
        parts.append(f"m={pipeline['micro_batches']}: {stages}")
    return f"mbs={plan['micro_batch_size']}; " + "; ".join(parts)


def write_inputs(work: Path, model: ModelConfig, args: argparse.Namespace
                 ) -> tuple[dict[str, tuple[Path, Path, int]], Optional[Path],
                            dict[str, float]]:
    """Cluster and plan files of every configuration: name -> (cluster, plan, ranks); the
    profile that times the emulated stages (None: measured CPU time); and each
    configuration's tokens/s as the predictor gives it with the planner's costs."""
    clusters = {}
    for key, data in cluster_dicts(args.dilation).items():
        path = work / f"cluster_{key}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        clusters[key] = path
    profile, device_profile = host_profile(model, args, work)
    profiles = {"cpu": profile} if profile is not None else None
    planned = searched_plan(model, clusters["mixed"], args, None, profiles)
    zero1 = bool(planned.get("use_distributed_optimizer"))
    plans = {"planned": planned, "uniform": uniform_split(planned, model.num_layers),
             "fast": searched_plan(model, clusters["fast"], args, zero1, profiles),
             "slow": searched_plan(model, clusters["slow"], args, zero1, profiles)}
    inputs = {}
    for name, plan in plans.items():
        path = work / f"plan_{name}.json"
        path.write_text(json.dumps(plan, indent=1))
        cluster = clusters["mixed"] if name in ("planned", "uniform") else clusters[name]
        ranks = sum(len(s["ranks"]) for p in plan["pipelines"] for s in p["stages"])
        inputs[name] = (cluster, path, ranks)
    predicted = {name: predict(model, ParallelPlan.load(path), ClusterSpec.load(cluster),
                               args.seq_length, profiles, dtype="fp32").tokens_per_s
                 for name, (cluster, path, _) in inputs.items()}
    return inputs, device_profile, predicted


def launch(name: str, cluster: Path, plan: Path, ranks: int, iters: int, metrics: Path,
           args: argparse.Namespace, model: ModelConfig,
           device_profile: Optional[Path]) -> subprocess.Popen:
    """Start one configuration's training under torchrun (stdout and stderr to a log file);
    ``device_profile`` times the emulated stages (None: their measured CPU time)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(ranks), str(REPO / "pretrain_llama.py"),
           "--model", args.model, "--num-layers", str(model.num_layers),
           "--seq-length", str(args.seq_length), "--cluster", str(cluster), "--plan", str(plan),
           "--mock-data", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", str(model.vocab_size - 1),  # + its eod id = the model's vocabulary
           "--train-iters", str(iters), "--lr", "1e-4", "--lr-warmup-iters", "0",
           "--eval-iters", "0", "--log-interval", "1", "--metrics-file", str(metrics)]
    if device_profile is not None:
        cmd += ["--emulation-profile", str(device_profile)]
    # One thread per rank: the ranks share the host's cores, and more threads only contend.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with metrics.with_suffix(".log").open("w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                text=True)


def late_regions(log: str) -> tuple[int, int]:
    """(late, of) compute regions summed over the ranks that reported late ones in a run's
    log (an emulated region is late when the host could not run it within its kind's time)."""
    late = of = 0
    for match in LATE_WARNING.finditer(log):
        late += int(match.group(1))
        of += int(match.group(2))
    return late, of


def finish(name: str, proc: subprocess.Popen, metrics: Path, iters: int, start: float,
           args: argparse.Namespace) -> tuple[list[dict[str, Any]], tuple[int, int]]:
    """Wait for a launched run; its metrics-file lines of split "train" and its
    :func:`late_regions`."""
    try:
        code = proc.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - start)))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"error: run {name} did not finish in {args.timeout:g} s")
    if code != 0:
        lines = metrics.with_suffix(".log").read_text().strip().splitlines()
        tail = "\n".join(lines[-15:])
        raise SystemExit(f"error: run {name} failed (exit {code}):\n{tail}")
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [line for line in lines if line.get("split") == "train"]
    print(f"[bench] {name}: {len(train)} iterations in {time.perf_counter() - start:.1f} s, "
          f"tokens/s {[round(t['tokens_per_s'], 1) for t in train]}", file=sys.stderr,
          flush=True)
    if len(train) != iters:
        raise SystemExit(f"error: run {name} logged {len(train)} iterations, expected {iters}")
    return train, late_regions(metrics.with_suffix(".log").read_text())


def slowdown_ratio() -> float:
    """emu-slow's slowdown over emu-fast's in the cluster file (2 in cpu_emulated.yaml)."""
    cluster = ClusterSpec.load(BASE_CLUSTER)
    kinds = {cluster.accelerator_of(r).name: cluster.accelerator_of(r).slowdown
             for r in range(cluster.world_size)}
    return kinds["emu-slow"] / kinds["emu-fast"]


def iterations(name: str, args: argparse.Namespace) -> int:
    """Training iterations of a configuration: the fast-only job runs longer when it runs next
    to the slow-only one (by the kinds' slowdown ratio, so about the same wall time)."""
    if name == "fast" and args.baselines == "together":
        return args.warmup + round(slowdown_ratio() * (args.iters - args.warmup))
    return args.iters


def measure(inputs: dict[str, tuple[Path, Path, int]], work: Path, args: argparse.Namespace,
            model: ModelConfig, device_profile: Optional[Path]) -> dict[str, dict[str, Any]]:
    """Run the configurations in interleaved rounds, every other round in reverse order (a
    host speed drifting steadily then favours no configuration over two rounds); per
    configuration, the post-warm-up tokens/s and iteration times of every round, and the late
    regions its ranks reported (summed over rounds)."""
    samples: dict[str, dict[str, Any]] = {
        name: {"tokens_per_s": [], "iteration_time_s": [], "round_medians": [], "late": [0, 0]}
        for name in CONFIGS}
    batches = ([("fast", "slow")] if args.baselines == "together" else [("fast",), ("slow",)])
    batches += [("uniform",), ("planned",)]
    for round_index in range(args.rounds):
        for batch in (batches if round_index % 2 == 0 else batches[::-1]):
            start = time.perf_counter()
            running = {}
            for name in batch:
                cluster, plan, ranks = inputs[name]
                metrics = work / f"metrics_{name}_r{round_index}.jsonl"
                running[name] = (launch(name, cluster, plan, ranks, iterations(name, args),
                                        metrics, args, model, device_profile), metrics)
            for name, (proc, metrics) in running.items():
                train, (late, of) = finish(name, proc, metrics, iterations(name, args), start,
                                           args)
                samples[name]["late"][0] += late
                samples[name]["late"][1] += of
                kept = train[args.warmup:]
                tokens = [line["tokens_per_s"] for line in kept]
                samples[name]["tokens_per_s"] += tokens
                samples[name]["iteration_time_s"] += [line["iteration_time_s"] for line in kept]
                samples[name]["round_medians"].append(statistics.median(tokens))
    return samples


def summary(samples: dict[str, dict[str, Any]], inputs: dict[str, tuple[Path, Path, int]],
            predicted: dict[str, float], model: ModelConfig, args: argparse.Namespace,
            load_before: tuple[float, ...]) -> dict[str, Any]:
    tps = {name: statistics.median(samples[name]["tokens_per_s"]) for name in CONFIGS}
    both = tps["fast"] + tps["slow"]
    timing = ("its slowdown x the host profile's time for the work (--device-time profile)"
              if args.device_time == "profile" else
              "its slowdown x the measured CPU time of the work (--device-time measured)")
    per_round = [samples["planned"]["round_medians"][r]
                 / (samples["fast"]["round_medians"][r] + samples["slow"]["round_medians"][r])
                 for r in range(args.rounds)]
    return {
        "benchmark": "hetero_efficiency",
        "emulation": (f"CPU emulation: each kind is a CPU process whose compute regions are "
                      f"padded to {timing}; not a measurement of real accelerators"),
        "tokens_per_s": {"a_fast_only": tps["fast"], "b_slow_only": tps["slow"],
                         "c_uniform_split": tps["uniform"], "d_planned_split": tps["planned"]},
        "efficiency": tps["planned"] / both,
        "uniform_efficiency": tps["uniform"] / both,
        "efficiency_per_round": per_round,
        "predicted_efficiency": predicted["planned"] / (predicted["fast"] + predicted["slow"]),
        "predicted_tokens_per_s": predicted,
        "iteration_time_s": {name: statistics.median(samples[name]["iteration_time_s"])
                             for name in CONFIGS},
        "late_regions": {name: {"late": samples[name]["late"][0],
                                "of_regions_on_reporting_ranks": samples[name]["late"][1]}
                         for name in CONFIGS},
        "conditions": {
            "model": args.model, "num_layers": model.num_layers,
            "parameters_m": round(model.num_parameters() / 1e6, 2),
            "seq_length": args.seq_length, "global_batch_size": args.global_batch_size,
            "iterations": args.iters, "warmup_iterations": args.warmup, "rounds": args.rounds,
            "dtype": "fp32", "data": "mock", "dilation": args.dilation,
            "baselines": args.baselines, "device_time": args.device_time,
            "planner_costs": ("roofline" if args.roofline else
                              f"profile {args.profile}" if args.profile else
                              "profile of this host measured by the bench"),
            "fast_only_iterations": iterations("fast", args),
            "slowdowns": {"emu-fast": args.dilation, "emu-slow": 2.0 * args.dilation},
            "host_cpus": os.cpu_count(), "threads_per_rank": 1,
            "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "plans": {name: describe(json.loads(inputs[name][1].read_text()))
                      for name in CONFIGS},
        },
    }


def main() -> None:
    args = parse_args()
    model = model_preset(args.model).replace(num_layers=args.num_layers)
    load_before = os.getloadavg()
    print("[bench] EMULATION on this CPU host: emulated ranks are CPU processes that wait after "
          "each compute region until it has lasted their kind's slowdown x its reference time "
          f"({args.device_time}); the figures describe the system, not real accelerators",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="hetero_eff_") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        inputs, device_profile, predicted = write_inputs(work, model, args)
        for name in CONFIGS:
            print(f"[bench] plan {name}: {describe(json.loads(inputs[name][1].read_text()))}",
                  file=sys.stderr)
        samples = measure(inputs, work, args, model, device_profile)
        result = summary(samples, inputs, predicted, model, args, load_before)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
