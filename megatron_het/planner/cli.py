"""Command line of ``tools/plan.py``: search a plan (or evaluate one) and write the outputs.

    python tools/plan.py --cluster scripts/clusters/hethub_llama140b.yaml --model llama-140b \\
        --global-batch-size 1024 --seq-length 4096 --out plan.json --report plan.md \\
        --chart plan.png --json

Without ``--evaluate`` the planner searches every layout and writes the best plan (``--out``,
ready for ``pretrain_llama.py --plan``); with ``--evaluate plan.json`` it predicts that plan
(what-if). Both report two efficiencies: against the homogeneous baseline (each kind's best
plan alone; a mixed plan may pass it, and the report says why) and against the compute ceiling
(no plan passes it). ``--json`` prints one
JSON line last: the predicted figures and the plan in short (stage groups with their pipeline
and rank counts); the full plan is what ``--out`` writes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from megatron_het.arguments.model_flags import (
    DEFAULT_VOCAB,
    add_model_shape_args,
    model_config_from_args,
)
from megatron_het.arguments.parser import ArgParser
from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.errors import UserError
from megatron_het.parallel.plan import PLAN_DTYPES, ParallelPlan
from megatron_het.parallel.plan_builders import interleave_plan
from megatron_het.perf import Profile, load_profiles
from megatron_het.planner.baseline import homogeneous_baseline
from megatron_het.planner.ceiling import MAX_MICRO_BATCH_SIZE, compute_ceiling
from megatron_het.planner.chart import save_chart
from megatron_het.planner.evaluate import evaluate_plan
from megatron_het.planner.report import markdown_report, summary_dict, text_summary
from megatron_het.planner.result import SearchResult
from megatron_het.planner.search import MAX_VIRTUAL_STAGES, search_plan

PROG = "tools/plan.py"


def build_parser() -> argparse.ArgumentParser:
    p = ArgParser(
        prog=PROG,
        description="Search (or evaluate) a parallel plan for a "
        "Llama model on a mixed cluster with the performance predictor.",
    )
    p.add_argument("--cluster", required=True, metavar="CLUSTER.yaml")
    add_model_shape_args(p, vocab_help=f"vocabulary (default: the preset's, else {DEFAULT_VOCAB})")
    p.add_argument(
        "--global-batch-size", type=int, help="sequences per iteration (required unless --evaluate)"
    )
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--dtype", choices=PLAN_DTYPES, default="bf16")
    p.add_argument(
        "--compile",
        action="store_true",
        help="plan for a run with --compile: GPU kinds' decoder layers are priced "
        "fused (by default they are priced eager in bf16/fp16, as a run "
        "without --compile computes them)",
    )
    p.add_argument(
        "--profile-dir",
        metavar="DIR",
        help="measured profiles (*.json, one per accelerator kind); roofline "
        "estimates for kinds without one",
    )
    p.add_argument("--out", metavar="plan.json", help="write the best plan here")
    p.add_argument("--report", metavar="report.md", help="write a markdown report here")
    p.add_argument("--chart", metavar="plan.png", help="draw the timeline and allocation here")
    p.add_argument(
        "--top",
        type=int,
        default=5,
        metavar="K",
        help="simulate and list the best K candidates (default 5)",
    )
    p.add_argument("--evaluate", metavar="plan.json", help="predict this plan, no search")
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="search: the most interleaved model chunks per device group to try "
        f"(default {MAX_VIRTUAL_STAGES}; 1 searches plain 1F1B only); with "
        "--evaluate: interleave that plan, every device group running V "
        "chunks (its layers dealt out in V rounds; default 1)",
    )
    p.add_argument(
        "--no-heterogeneous-dp",
        action="store_true",
        help="search only layouts whose DP replicas are the same pipeline (by "
        "default replicas of one kind each, the batch shared by speed, are "
        "searched too)",
    )
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the per-kind searches of the homogeneous baseline (the compute "
        "ceiling is always given)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary line last")
    return p


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    """The preset and/or the shape flags -> a validated ModelConfig."""
    return model_config_from_args(args, seq_length=args.seq_length)


def load_profile_dir(directory: str | None) -> dict[str, Profile] | None:
    if directory is None:
        return None
    path = Path(directory)
    if not path.is_dir():
        raise UserError(
            f"--profile-dir {directory} is not a directory; pass the folder that "
            f"holds the profiles written by tools/profile_device.py"
        )
    files = sorted(path.glob("*.json"))
    if not files:
        raise UserError(f"--profile-dir {directory} holds no *.json profiles")
    return load_profiles(files)


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--seq-length", args.seq_length),
        ("--top", args.top),
        ("--global-batch-size", args.global_batch_size),
        ("--virtual-stages", args.virtual_stages),
    ):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if args.evaluate is None and args.global_batch_size is None:
        raise UserError(
            "--global-batch-size is required to search a plan (or pass --evaluate plan.json)"
        )


def run(argv: Sequence[str]) -> SearchResult:
    """Parse ``argv``, search or evaluate, write the requested files and print the summary."""
    args = build_parser().parse_args(list(argv))
    _check_numbers(args)
    model = model_from_args(args)
    cluster = ClusterSpec.load(args.cluster)
    profiles = load_profile_dir(args.profile_dir)
    if args.evaluate is not None:
        plan = interleave_plan(ParallelPlan.load(args.evaluate), args.virtual_stages or 1)
        # the plan's own precision where it names one, else --dtype
        options = RunOptions.from_plan(
            plan, dtype=plan.dtype or args.dtype, fused_elementwise=args.compile
        )
        result = evaluate_plan(
            model,
            cluster,
            plan,
            args.seq_length,
            profiles,
            options,
            args.global_batch_size,
            not args.no_baseline,
        )
    else:
        options = RunOptions(dtype=args.dtype, fused_elementwise=args.compile)
        result = search_plan(
            model,
            cluster,
            args.global_batch_size,
            args.seq_length,
            profiles,
            options,
            top_k=args.top,
            max_virtual_stages=args.virtual_stages or MAX_VIRTUAL_STAGES,
            heterogeneous_dp=not args.no_heterogeneous_dp,
        )
        if not args.no_baseline:
            result = result.with_baseline(
                homogeneous_baseline(
                    model, cluster, args.global_batch_size, args.seq_length, profiles, options
                )
            )
    result = result.with_ceiling(
        compute_ceiling(
            model,
            cluster,
            result.plan.global_batch_size,
            args.seq_length,
            profiles,
            options.replace(dtype=result.plan.dtype or options.dtype),
            max_micro_batch_size=max(MAX_MICRO_BATCH_SIZE, result.plan.micro_batch_size),
        )
    )
    if args.out:
        result.plan.save(args.out)
    if args.report:
        Path(args.report).write_text(
            markdown_report(result, cluster, "What-if" if args.evaluate else "Planned")
        )
    if args.chart:
        save_chart(result.prediction, cluster, args.chart, result=result)
    print(text_summary(result, cluster))
    for what, path in (("plan", args.out), ("report", args.report), ("chart", args.chart)):
        if path:
            print(f"wrote {what} to {path}")
    if args.json:
        print(json.dumps({**summary_dict(result, cluster), "plan_file": args.out}))
    return result


__all__ = ["build_parser", "load_profile_dir", "model_from_args", "run"]
