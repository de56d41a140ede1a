"""Heterogeneous-training efficiency on the CPU-emulated mixed cluster (EMULATION, not hardware).

scripts/clusters/cpu_emulated.yaml has 4 ranks on this machine: ranks 0-1 of kind emu-fast and
ranks 2-3 of kind emu-slow (half the speed: each compute region is followed by a sleep as long
as the region). Every configuration trains through ``pretrain_llama.py`` under torchrun
(``python -m torch.distributed.run --standalone --nproc_per_node N``) on mock data, and its
tokens/s is the median, over the iterations after the warm-up ones, of the metrics file's
``tokens_per_s``:

    (a) fast  the two emu-fast ranks alone (a 2-rank cluster of that group), the planner's plan
    (b) slow  the two emu-slow ranks alone, the planner's plan
    (c) uniform    all four ranks, the mixed plan's layout with layers split evenly
    (d) planned    all four ranks, the planner's plan (a split suited to the speeds)

    efficiency = d / (a + b)      uniform_efficiency = c / (a + b)

``--dilation F`` multiplies both kinds' slowdown by F (ratio kept at 2): the four emulated
devices then need 1.5 / F of the host's cores on average instead of 3 at F = 1, so that a host
with fewer cores than emulated devices does not decide the result. The configurations run in
``--rounds`` interleaved rounds (a, b, c, d, a, b, ...) so that a change in the host's load hits
them alike. The last line printed is one JSON object with the figures and the conditions.

    .venv/bin/python bench/hetero_efficiency.py --rounds 2
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
from typing import Any, Optional

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_het.cluster import ClusterSpec  # noqa: E402
from megatron_het.config import ModelConfig, model_preset  # noqa: E402
from megatron_het.planner import search_plan  # noqa: E402

CONFIGS = ("fast", "slow", "uniform", "planned")
BASE_CLUSTER = REPO / "scripts" / "clusters" / "cpu_emulated.yaml"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="model preset")
    p.add_argument("--num-layers", type=int, default=15,
                   help="layers (overrides the preset's; more layers give the split a finer "
                        "grain)")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--global-batch-size", type=int, default=64,
                   help="sequences per iteration, the same for every configuration")
    p.add_argument("--iters", type=int, default=5, help="training iterations per run")
    p.add_argument("--warmup", type=int, default=2, help="first iterations left out")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the 4 runs")
    p.add_argument("--dilation", type=float, default=2.0,
                   help="multiply both kinds' slowdown by this (>= 1; see the module doc)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
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
    base = yaml.safe_load(BASE_CLUSTER.read_text())
    full = ClusterSpec.load(BASE_CLUSTER)
    groups = {g["name"]: dict(g) for g in base["node_groups"]}
    overrides = {}
    if dilation != 1.0:
        for group in groups.values():
            kind = full.accelerator_of(full.ranks_of_accelerator(group["accelerator"])[0])
            overrides[kind.name] = {"slowdown": kind.slowdown * dilation}
    extra = {"accelerators": overrides} if overrides else {}
    mixed = {**base, **extra, "name": "cpu_emulated" + (f"_x{dilation:g}" if extra else "")}
    halves = {}
    for name, group in groups.items():
        alone = {k: v for k, v in group.items() if k != "colocate_with"}
        halves[name] = {"name": f"{mixed['name']}_{name}_only", "node_groups": [alone], **extra}
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


def searched_plan(model: ModelConfig, cluster_file: Path, args: argparse.Namespace,
                  distributed_optimizer: Optional[bool]) -> dict[str, Any]:
    """The planner's best fp32 plan for the cluster (roofline estimates of the kinds), with
    ``use_distributed_optimizer`` forced to ``distributed_optimizer`` when given."""
    result = search_plan(model, ClusterSpec.load(cluster_file), args.global_batch_size,
                         args.seq_length, dtype="fp32", with_upper_bound=False)
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


def write_inputs(work: Path, model: ModelConfig,
                 args: argparse.Namespace) -> dict[str, tuple[Path, Path, int]]:
    """Cluster and plan files of every configuration: name -> (cluster, plan, ranks)."""
    clusters = {}
    for key, data in cluster_dicts(args.dilation).items():
        path = work / f"cluster_{key}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        clusters[key] = path
    planned = searched_plan(model, clusters["mixed"], args, None)
    zero1 = bool(planned.get("use_distributed_optimizer"))
    plans = {"planned": planned, "uniform": uniform_split(planned, model.num_layers),
             "fast": searched_plan(model, clusters["fast"], args, zero1),
             "slow": searched_plan(model, clusters["slow"], args, zero1)}
    inputs = {}
    for name, plan in plans.items():
        path = work / f"plan_{name}.json"
        path.write_text(json.dumps(plan, indent=1))
        cluster = clusters["mixed"] if name in ("planned", "uniform") else clusters[name]
        ranks = sum(len(s["ranks"]) for p in plan["pipelines"] for s in p["stages"])
        inputs[name] = (cluster, path, ranks)
    return inputs


def run_once(name: str, cluster: Path, plan: Path, ranks: int, metrics: Path,
             args: argparse.Namespace, model: ModelConfig) -> list[dict[str, Any]]:
    """Train one configuration under torchrun; its metrics-file lines of split "train"."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(ranks), str(REPO / "pretrain_llama.py"),
           "--model", args.model, "--num-layers", str(model.num_layers),
           "--seq-length", str(args.seq_length), "--cluster", str(cluster), "--plan", str(plan),
           "--mock-data", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", str(model.vocab_size - 1),  # + its eod id = the model's vocabulary
           "--train-iters", str(args.iters), "--lr", "1e-4", "--lr-warmup-iters", "0",
           "--eval-iters", "0", "--log-interval", "1", "--metrics-file", str(metrics)]
    # One thread per rank: the ranks share the host's cores, and more threads only contend.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"error: run {name} failed (exit {proc.returncode}):\n{tail}")
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [line for line in lines if line.get("split") == "train"]
    print(f"[bench] {name}: {len(train)} iterations in {time.perf_counter() - start:.1f} s, "
          f"tokens/s {[round(t['tokens_per_s'], 1) for t in train]}", file=sys.stderr,
          flush=True)
    if len(train) != args.iters:
        raise SystemExit(f"error: run {name} logged {len(train)} iterations, expected "
                         f"{args.iters}")
    return train


def measure(inputs: dict[str, tuple[Path, Path, int]], work: Path, args: argparse.Namespace,
            model: ModelConfig) -> dict[str, dict[str, Any]]:
    """Run the configurations in interleaved rounds; per configuration, the post-warm-up
    tokens/s and iteration times of every round."""
    samples: dict[str, dict[str, list[float]]] = {
        name: {"tokens_per_s": [], "iteration_time_s": [], "round_medians": []}
        for name in CONFIGS}
    for round_index in range(args.rounds):
        for name in CONFIGS:
            cluster, plan, ranks = inputs[name]
            metrics = work / f"metrics_{name}_r{round_index}.jsonl"
            kept = run_once(name, cluster, plan, ranks, metrics, args, model)[args.warmup:]
            tokens = [line["tokens_per_s"] for line in kept]
            samples[name]["tokens_per_s"] += tokens
            samples[name]["iteration_time_s"] += [line["iteration_time_s"] for line in kept]
            samples[name]["round_medians"].append(statistics.median(tokens))
    return samples


def summary(samples: dict[str, dict[str, list[float]]], inputs: dict[str, tuple[Path, Path, int]],
            model: ModelConfig, args: argparse.Namespace,
            load_before: tuple[float, ...]) -> dict[str, Any]:
    tps = {name: statistics.median(samples[name]["tokens_per_s"]) for name in CONFIGS}
    both = tps["fast"] + tps["slow"]
    per_round = [samples["planned"]["round_medians"][r]
                 / (samples["fast"]["round_medians"][r] + samples["slow"]["round_medians"][r])
                 for r in range(args.rounds)]
    return {
        "benchmark": "hetero_efficiency",
        "emulation": ("CPU emulation: emu-slow is emu-fast plus injected sleep; not a "
                      "measurement of real accelerators"),
        "tokens_per_s": {"a_fast_only": tps["fast"], "b_slow_only": tps["slow"],
                         "c_uniform_split": tps["uniform"], "d_planned_split": tps["planned"]},
        "efficiency": tps["planned"] / both,
        "uniform_efficiency": tps["uniform"] / both,
        "efficiency_per_round": per_round,
        "iteration_time_s": {name: statistics.median(samples[name]["iteration_time_s"])
                             for name in CONFIGS},
        "conditions": {
            "model": args.model, "num_layers": model.num_layers,
            "parameters_m": round(model.num_parameters() / 1e6, 2),
            "seq_length": args.seq_length, "global_batch_size": args.global_batch_size,
            "iterations": args.iters, "warmup_iterations": args.warmup, "rounds": args.rounds,
            "dtype": "fp32", "data": "mock", "dilation": args.dilation,
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
    print("[bench] EMULATION on this CPU host: emu-slow ranks are emu-fast ranks that sleep after "
          "each compute region; the figures describe the system, not real accelerators",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="hetero_eff_") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        inputs = write_inputs(work, model, args)
        for name in CONFIGS:
            print(f"[bench] plan {name}: {describe(json.loads(inputs[name][1].read_text()))}",
                  file=sys.stderr)
        samples = measure(inputs, work, args, model)
        result = summary(samples, inputs, model, args, load_before)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
