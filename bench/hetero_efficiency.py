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
    (c) uniform    all four ranks, the planner's best plain plan of identical mixed
                   pipelines (no heterogeneous DP, no interleaving) with its layers split
                   evenly (--long)
    (d) planned    all four ranks, the planner's plan over its whole space (on this cluster
                   heterogeneous DP: every rank a replica, the batch shared by speed)
    (e) interleaved  that plain plan of identical mixed pipelines with 2 interleaved chunks
                   per device group
    (f) hetero_dp  one replica per kind (the plans of a and b side by side), the batch shared
                   by the kinds' predicted speeds (not run again where it is the planned plan:
                   ``hetero_dp_is_the_planned_plan``)

    efficiency = d / (a + b)      uniform_efficiency = c / (a + b)
    interleaved_efficiency = e / (a + b)    hetero_dp_efficiency = f / (a + b)
    best_efficiency = max(d, e, f) / (a + b)

(a) and (b) are two separate jobs, run at the same time by default (``--baselines together``),
as the two halves of a real cluster would train side by side, so the host carries four emulated
devices in every measurement. The fast job runs ``slowdown ratio`` x as many iterations as the
slow one so that both run for about the same time. ``--baselines apart`` runs them one after
the other, each with the host to itself.

``--dilation F`` multiplies both kinds' slowdown by F (ratio kept at 2): the four emulated
devices then need 1.5 / F of the host's cores on average instead of 3 at F = 1, so that a host
with fewer cores than emulated devices does not decide the result (padding to slowdown x the
CPU time absorbs sharing up to the slowdown). F = 3 is the default: when all four ranks
compute at once each gets half a core of a 2-core host, which an emu-fast rank at F = 2 needs
exactly, so at F = 2 most of its regions ran late (175 of 240 in the fast-only job) and its
kind ran slower than nominal, which put the measured efficiency above 1 (1.14); at F = 4 no
region was late and the efficiency was 0.994 (predicted 0.999). The defaults (11 layers,
global batch 192, sequence 256) give the planner's pipelines about a hundred micro-batches, so
that the fill-and-drain bubble (1/(m + 1) of an iteration at 2 stages) is small as in
pretraining, where micro-batches far outnumber stages, and a layer split of 4 and 7 layers that
balances the kinds. The configurations run in ``--rounds`` interleaved rounds, every other one in
reverse order (a + b, d, e, f, f, e, d, a + b, ...): this host's speed drifts by several
percent over minutes (one run's tokens/s rose 4-12% between its early and late iterations in
the runs we looked at), so a single round compares configurations measured at different host
speeds; ``efficiency_per_round`` shows the spread. The defaults (1 round of 3 iterations, 1 of
them warm-up) finish in about 13 minutes on 2 cores; ``--long --global-batch-size 256`` adds
(c) and runs 2 rounds of 5 iterations (2 warm-up), about 50 minutes. The last line printed is
one JSON object with the figures and the conditions, next to ``predicted_efficiency`` (the
predictor's figures for the mixed plans, with the planner's costs) and ``late_regions`` (regions the
host could not finish within their kind's time: they make a kind slower than its nominal speed).

    .venv/bin/python -m bench.hetero_efficiency
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.hetero_plans import (
    cluster_dicts,
    describe,
    interleaved,
    replicas_by_kind,
    uniform_split,
)
from bench.hetero_runs import iterations, measure
from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, RunOptions, model_preset
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import Profile, predict
from megatron_het.perf.measure.profiler import Sweep, profile_device
from megatron_het.planner import search_plan
from megatron_het.planner.search import MAX_VIRTUAL_STAGES

REPO = Path(__file__).resolve().parents[1]

CONFIGS = ("fast", "slow", "uniform", "planned", "interleaved", "hetero_dp")
INTERLEAVED_CHUNKS = 2
LABELS = {
    "fast": "a_fast_only",
    "slow": "b_slow_only",
    "uniform": "c_uniform_split",
    "planned": "d_planned_split",
    "interleaved": "e_interleaved",
    "hetero_dp": "f_hetero_dp",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="model preset")
    p.add_argument(
        "--num-layers",
        type=int,
        default=11,
        help="layers (overrides the preset's; more layers give the split a finer grain)",
    )
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=192,
        help="sequences per iteration, the same for every configuration",
    )
    p.add_argument(
        "--iters", type=int, default=None, help="training iterations per run (default 3, --long 5)"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="first iterations left out (default 1, --long 2)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds of the runs (default 1, --long 2)",
    )
    p.add_argument(
        "--long",
        action="store_true",
        help="the longer mode: also the uniform split, 2 rounds of 5 iterations",
    )
    p.add_argument(
        "--dilation",
        type=float,
        default=3.0,
        help="multiply both kinds' slowdown by this (>= 1; see the module doc)",
    )
    p.add_argument(
        "--baselines",
        choices=("together", "apart"),
        default="together",
        help="run the fast-only and slow-only jobs at the same time (default) or "
        "one after the other",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument(
        "--profile",
        help="the host's cpu profile for the planner (default: "
        "measure one first, about ten seconds)",
    )
    p.add_argument(
        "--device-time",
        choices=("profile", "measured"),
        default="profile",
        help="what an emulated stage's forward and backward last: slowdown x the "
        "host profile's figures (default) or x their measured CPU time",
    )
    p.add_argument(
        "--roofline",
        action="store_true",
        help="plan with the kinds' roofline estimates instead of a profile",
    )
    p.add_argument("--work-dir", default=None, help="keep clusters, plans and metrics here")
    args = p.parse_args()
    for key, quick, long in (("iters", 3, 5), ("warmup", 1, 2), ("rounds", 1, 2)):
        if getattr(args, key) is None:
            setattr(args, key, long if args.long else quick)
    args.configs = tuple(c for c in CONFIGS if args.long or c != "uniform")
    if args.iters <= args.warmup:
        p.error("--iters must exceed --warmup")
    if args.dilation < 1:
        p.error("--dilation must be >= 1")
    return args


def host_profile(
    model: ModelConfig, args: argparse.Namespace, work: Path
) -> tuple[Profile | None, Path | None]:
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
        sweep = Sweep(
            seq_lengths=(args.seq_length,),
            micro_batch_sizes=(1, 2, 4),
            tp_sizes=(1, 2),
            dtype="fp32",
            warmup=2,
            iters=7,
        )
        print(
            "[bench] profiling this host as 'cpu' (1 thread) for the planner and the "
            "emulated device times",
            file=sys.stderr,
            flush=True,
        )
        profile = profile_device(model, sweep, "cpu", torch.device("cpu"))
        path = work / "cpu.json"
        profile.save(path)
    return (
        None if args.roofline else profile,
        path.resolve() if args.device_time == "profile" else None,
    )


def searched_plan(
    model: ModelConfig,
    cluster_file: Path,
    args: argparse.Namespace,
    distributed_optimizer: bool | None,
    profiles: dict[str, Profile] | None,
    heterogeneous_dp: bool = True,
    plain: bool = False,
) -> dict[str, Any]:
    """The planner's best fp32 plan for the cluster (with the host profile, else roofline
    estimates of the kinds), with ``use_distributed_optimizer`` forced to
    ``distributed_optimizer`` when given; ``heterogeneous_dp=False``: the best plan of
    identical replicas; ``plain``: without interleaving."""
    result = search_plan(
        model,
        ClusterSpec.load(cluster_file),
        args.global_batch_size,
        args.seq_length,
        profiles=profiles,
        options=RunOptions(dtype="fp32", fused_elementwise=True),
        heterogeneous_dp=heterogeneous_dp,
        max_virtual_stages=1 if plain else MAX_VIRTUAL_STAGES,
    )
    plan = result.plan.to_dict()
    if distributed_optimizer is not None:
        plan["use_distributed_optimizer"] = distributed_optimizer
    return plan


def write_inputs(
    work: Path, model: ModelConfig, args: argparse.Namespace
) -> tuple[dict[str, tuple[Path, Path, int]], Path | None, dict[str, float]]:
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
    pipelined = searched_plan(
        model, clusters["mixed"], args, None, profiles, heterogeneous_dp=False, plain=True
    )
    zero1 = bool(pipelined.get("use_distributed_optimizer"))
    plans = {
        "planned": planned,
        "uniform": uniform_split(pipelined, model.num_layers),
        "fast": searched_plan(model, clusters["fast"], args, zero1, profiles),
        "slow": searched_plan(model, clusters["slow"], args, zero1, profiles),
    }
    plans["interleaved"] = interleaved(pipelined, INTERLEAVED_CHUNKS)
    predicted = {
        name: _predicted(model, plans[name], clusters[cluster_key(name)], args, profiles)
        for name in ("fast", "slow")
    }
    fast_ranks = ClusterSpec.load(clusters["fast"]).world_size
    # Finer micro-batches share the batch closer to the speeds: take the predictor's pick.
    options = [
        replicas_by_kind(
            plans["fast"], plans["slow"], fast_ranks, predicted["fast"], predicted["slow"], mbs
        )
        for mbs in (None, 1)
    ]
    plans["hetero_dp"] = max(
        options, key=lambda plan: _predicted(model, plan, clusters["mixed"], args, profiles)
    )
    # the planner may pick that very plan (heterogeneous DP is in its space): run it once
    args.hetero_dp_is_planned = _same_plan(plans["hetero_dp"], plans["planned"])
    if args.hetero_dp_is_planned:
        args.configs = tuple(c for c in args.configs if c != "hetero_dp")
        predicted["hetero_dp"] = _predicted(
            model, plans["hetero_dp"], clusters["mixed"], args, profiles
        )
    inputs = {}
    for name in args.configs:
        plan = plans[name]
        path = work / f"plan_{name}.json"
        path.write_text(json.dumps(plan, indent=1))
        ranks = sum(len(g) for p in ParallelPlan.load(plan).pipelines for g in p.device_groups)
        inputs[name] = (clusters[cluster_key(name)], path, ranks)
        predicted[name] = _predicted(model, plan, inputs[name][0], args, profiles)
    return inputs, device_profile, predicted


def _same_plan(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two plan mappings run alike (their descriptions aside)."""

    def key(plan: dict[str, Any]) -> Any:
        return ParallelPlan.load({**plan, "description": ""}).to_dict()

    return key(a) == key(b)


def cluster_key(name: str) -> str:
    """The cluster a configuration runs on: a half of it, or all of it ("mixed")."""
    return name if name in ("fast", "slow") else "mixed"


def _predicted(
    model: ModelConfig,
    plan: dict[str, Any],
    cluster: Path,
    args: argparse.Namespace,
    profiles: dict[str, Profile] | None,
) -> float:
    loaded = ParallelPlan.load(plan)
    options = RunOptions.from_plan(loaded, dtype="fp32")
    return predict(
        model, loaded, ClusterSpec.load(cluster), args.seq_length, profiles, options
    ).tokens_per_s


def summary(
    samples: dict[str, dict[str, Any]],
    inputs: dict[str, tuple[Path, Path, int]],
    predicted: dict[str, float],
    model: ModelConfig,
    args: argparse.Namespace,
    load_before: tuple[float, ...],
) -> dict[str, Any]:
    tps = {name: statistics.median(samples[name]["tokens_per_s"]) for name in args.configs}
    if getattr(args, "hetero_dp_is_planned", False):
        tps["hetero_dp"] = tps["planned"]
    both = tps["fast"] + tps["slow"]
    mixed = [name for name in ("planned", "interleaved", "hetero_dp") if name in tps]
    best = max(mixed, key=lambda name: tps[name])
    timing = (
        "its slowdown x the host profile's time for the work (--device-time profile)"
        if args.device_time == "profile"
        else "its slowdown x the measured CPU time of the work (--device-time measured)"
    )
    per_round = [
        samples["planned"]["round_medians"][r]
        / (samples["fast"]["round_medians"][r] + samples["slow"]["round_medians"][r])
        for r in range(args.rounds)
    ]
    return {
        "benchmark": "hetero_efficiency",
        "emulation": (
            f"CPU emulation: each kind is a CPU process whose compute regions are "
            f"padded to {timing}; not a measurement of real accelerators"
        ),
        "tokens_per_s": {label: tps[name] for name, label in LABELS.items() if name in tps},
        "efficiency": tps["planned"] / both,
        "uniform_efficiency": tps["uniform"] / both if "uniform" in tps else None,
        "interleaved_efficiency": tps["interleaved"] / both,
        "hetero_dp_efficiency": tps["hetero_dp"] / both,
        "best_efficiency": tps[best] / both,
        "best_plan": best,
        "hetero_dp_is_the_planned_plan": bool(getattr(args, "hetero_dp_is_planned", False)),
        "efficiency_per_round": per_round,
        "predicted_efficiency": {
            name: predicted[name] / (predicted["fast"] + predicted["slow"]) for name in mixed
        },
        "predicted_tokens_per_s": predicted,
        "iteration_time_s": {
            name: statistics.median(samples[name]["iteration_time_s"]) for name in args.configs
        },
        "warmup_dropped": {name: samples[name]["warmup_dropped"] for name in args.configs},
        "unsettled_runs": {name: samples[name]["unsettled_runs"] for name in args.configs},
        "late_regions": {
            name: {
                "late": samples[name]["late"][0],
                "of_regions_on_reporting_ranks": samples[name]["late"][1],
            }
            for name in args.configs
        },
        "conditions": {
            "model": args.model,
            "num_layers": model.num_layers,
            "parameters_m": round(model.num_parameters() / 1e6, 2),
            "seq_length": args.seq_length,
            "global_batch_size": args.global_batch_size,
            "iterations": args.iters,
            "warmup_iterations": args.warmup,
            "rounds": args.rounds,
            "dtype": "fp32",
            "data": "mock",
            "dilation": args.dilation,
            "baselines": args.baselines,
            "device_time": args.device_time,
            "planner_costs": (
                "roofline"
                if args.roofline
                else f"profile {args.profile}"
                if args.profile
                else "profile of this host measured by the bench"
            ),
            "fast_only_iterations": iterations("fast", args),
            "slowdowns": {"emu-fast": args.dilation, "emu-slow": 2.0 * args.dilation},
            "host_cpus": os.cpu_count(),
            "threads_per_rank": 1,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "plans": {
                name: describe(json.loads(inputs[name][1].read_text())) for name in args.configs
            },
            "long_mode": args.long,
        },
    }


def main() -> None:
    args = parse_args()
    model = model_preset(args.model).replace(num_layers=args.num_layers)
    load_before = os.getloadavg()
    print(
        "[bench] EMULATION on this CPU host: emulated ranks are CPU processes that wait after "
        "each compute region until it has lasted their kind's slowdown x its reference time "
        f"({args.device_time}); the figures describe the system, not real accelerators",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="hetero_eff_") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        inputs, device_profile, predicted = write_inputs(work, model, args)
        for name in args.configs:
            print(
                f"[bench] plan {name}: {describe(json.loads(inputs[name][1].read_text()))}",
                file=sys.stderr,
            )
        samples = measure(inputs, work, args, model, device_profile)
        result = summary(samples, inputs, predicted, model, args, load_before)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    from megatron_het.launcher.host_memory import prefer_huge_pages

    prefer_huge_pages(os.environ)  # as the training runs it starts allocate
    main()
