"""Fused-op kernels: our compiled kernels (``csrc/``) against torch eager and torch.compile.

Per op, model shape, dtype and pass (forward, or forward + backward) it times the package's
public function with the default kernel choice (``ours``), the same function on its torch
reference (``eager``, ``KernelChoice.references()``), the plain torch a user would write
(``formula``, where it differs) and ``torch.compile`` of the reference (``compiled``); also
one AdamW step over a decoder layer's parameters (ours: ``build_optimizer``'s choice, against
``fused=True``). The cases, their shapes and the
bytes behind each GB/s figure are listed in :mod:`bench.kernel_cases`.

Method: each case first runs every implementation once on fresh, seeded inputs and checks its
outputs (and input gradients) against the reference's (``max_rel_err``: the largest error of an
output over its largest magnitude); that first call is where torch.compile compiles, and it is
reported as ``first_call_s`` and ``compile_s`` (first call minus the median), never in the
medians. Then ``--warmup`` untimed rounds, and ``--rounds`` timed rounds in which the
implementations run back to back in an order that rotates round by round, each ``iters`` calls
long (enough for the fastest to take about ``--round-ms``). Per implementation: the median time
of a call over the rounds, its min and max, and GB/s; per case the ratios ``X/ours`` (X's median
over ours: above 1, ours is faster) and ``paired_ratios``, the median over rounds of each round's
own ratio (the two ran back to back, under nearly the same load from other processes).
On a host that other processes keep busy, ``--threads 2`` and more stall at every parallel
region (each waits for all its threads, one of which may not be scheduled): many small kernels
(torch eager, inductor's small kernels) suffer most; ``--threads 1`` is the robust figure there.

Shapes: the ``small`` preset at micro-batch 8 x sequence 256 and Llama-2-7B (32 heads, 32 query
groups, head dimension 128, vocabulary 32000) at 1 x 4096; ``--quick``: the ``tiny`` preset at
2 x 16, three rounds, for tests and CI (seconds; its figures mean nothing). Each case prints one
JSON line as it ends; the last line is one JSON object with every case and the conditions.

    .venv/bin/python -m bench.kernels
    .venv/bin/python -m bench.kernels --ops rms_norm,rope --dtypes bf16 --shapes llama2-7b
    .venv/bin/python -m bench.kernels --quick --no-compile
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.kernel_cases import (
    DTYPES,
    FULL_SHAPES,
    OPS,
    QUICK_SHAPES,
    Call,
    Case,
    Tensors,
    build_cases,
)
from megatron_het.kernels.selection import implementation_table
from megatron_het.launcher.host_memory import THP_VARIABLE
from megatron_het.pipeline.timing import synchronize

MIN_ROUNDS = 7
MAX_ITERS = 10_000


def _names(text: str, known: Sequence[str], flag: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{flag}: {', '.join(unknown) or 'nothing given'}; choose from {', '.join(known)}"
        )
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"of {', '.join(DTYPES)}")
    p.add_argument("--ops", default=",".join(OPS), help=f"of {', '.join(OPS)}")
    shape_names = [s.preset for s in FULL_SHAPES + QUICK_SHAPES]
    p.add_argument(
        "--shapes", default=None, help=f"of {', '.join(shape_names)} (default: small, llama2-7b)"
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes, 3 rounds (tests, CI)")
    p.add_argument("--rounds", type=int, default=None, help=f"timed rounds (>= {MIN_ROUNDS})")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument(
        "--round-ms",
        type=float,
        default=None,
        help="milliseconds the fastest implementation runs per round",
    )
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    try:
        args.dtypes = _names(args.dtypes, tuple(DTYPES), "--dtypes")
        args.ops = _names(args.ops, OPS, "--ops")
        wanted = _names(args.shapes, shape_names, "--shapes") if args.shapes else None
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    default_shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    every = {s.preset: s for s in FULL_SHAPES + QUICK_SHAPES}
    args.shape_list = [every[n] for n in wanted] if wanted else list(default_shapes)
    if args.rounds is None:
        args.rounds = 3 if args.quick else MIN_ROUNDS
    if args.round_ms is None:
        args.round_ms = 1.0 if args.quick else 50.0
    if args.rounds < (1 if args.quick else MIN_ROUNDS):
        p.error(f"--rounds must be at least {MIN_ROUNDS} (any positive number with --quick)")
    if args.threads < 1 or args.warmup < 0 or args.round_ms <= 0:
        p.error("--threads must be >= 1, --warmup >= 0 and --round-ms > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA/ROCm device here")
    return args


def max_rel_err(got: Tensors, want: Tensors) -> float:
    """The largest ``max |got - want| / max |want|`` over paired outputs (inf when the
    shapes differ or a value is not finite)."""
    worst = 0.0
    if len(got) != len(want):
        return math.inf
    for a, b in zip(got, want, strict=True):
        if a.shape != b.shape:
            return math.inf
        a32, b32 = a.detach().float(), b.detach().float()
        scale = b32.abs().max().item() if b32.numel() else 0.0
        diff = (a32 - b32).abs().max().item() if b32.numel() else 0.0
        err = diff / scale if scale > 0 else diff
        worst = max(worst, err if math.isfinite(err) else math.inf)
    return worst


def check(case: Case, device: str) -> tuple[dict[str, float], dict[str, float]]:
    """Each implementation's first call on fresh inputs: ``(max_rel_err, first_call_s)`` by
    name, errors against the case's reference."""
    outputs: dict[str, Tensors] = {}
    first: dict[str, float] = {}
    for variant in case.variants:
        call = variant.prepare(case.make_inputs())
        synchronize(torch.device(device))
        start = time.perf_counter()
        outputs[variant.name] = tuple(t.detach().clone() for t in call())
        synchronize(torch.device(device))
        first[variant.name] = time.perf_counter() - start
        del call
    want = outputs[case.reference]
    return {name: max_rel_err(got, want) for name, got in outputs.items()}, first


def time_calls(
    calls: dict[str, Call], rounds: int, warmup: int, round_s: float, device: str
) -> tuple[dict[str, list[float]], int]:
    """Seconds per call of each of ``calls`` in every timed round, and the calls per round.

    The warm-up rounds (at least one) are untimed except to choose the calls per round; then
    in round ``r`` the implementations run in their order rotated by ``r``, so each one runs
    first, last and between the others equally often."""
    sync = torch.device(device)
    single: dict[str, float] = {}
    for _ in range(max(1, warmup)):
        for name, call in calls.items():
            synchronize(sync)
            start = time.perf_counter()
            call()
            synchronize(sync)
            single[name] = time.perf_counter() - start
    iters = max(1, min(MAX_ITERS, math.ceil(round_s / max(min(single.values()), 1e-7))))
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize(sync)
            start = time.perf_counter()
            for _ in range(iters):
                calls[name]()
            synchronize(sync)
            seconds[name].append((time.perf_counter() - start) / iters)
    return seconds, iters


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """Check, then time, one case: its JSON record."""
    torch._dynamo.reset()  # each case compiles its own graphs, within dynamo's recompile limit
    record: dict[str, Any] = {
        "op": case.op,
        "shape": case.shape,
        "dims": case.dims,
        "dtype": case.dtype,
        "pass": case.passes,
        "bytes": case.bytes_moved,
        "reference": case.reference,
        "tolerance": case.tolerance,
    }
    try:
        errors, first = check(case, args.device)
    except Exception as exc:  # a variant that fails (a compile error) is reported, not fatal
        record["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        return record
    inputs = case.make_inputs()  # shared: every implementation reads the same tensors
    calls = {variant.name: variant.prepare(inputs) for variant in case.variants}
    seconds, iters = time_calls(calls, args.rounds, args.warmup, args.round_ms / 1e3, args.device)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    record["iters_per_round"] = iters
    record["results"] = {
        variant.name: {
            "implementation": variant.label,
            "median_ms": round(medians[variant.name] * 1e3, 4),
            "min_ms": round(min(seconds[variant.name]) * 1e3, 4),
            "max_ms": round(max(seconds[variant.name]) * 1e3, 4),
            "gb_per_s": round(case.bytes_moved / medians[variant.name] / 1e9, 2),
            "first_call_s": round(first[variant.name], 4),
            "max_rel_err": errors[variant.name],
            "matches_reference": errors[variant.name] <= case.tolerance,
        }
        for variant in case.variants
    }
    if "compiled" in medians:
        record["results"]["compiled"]["compile_s"] = round(
            first["compiled"] - medians["compiled"], 3
        )
    others = [name for name in medians if name != "ours"]
    record["ratios"] = {f"{n}/ours": round(medians[n] / medians["ours"], 3) for n in others}
    record["paired_ratios"] = {
        f"{n}/ours": round(
            statistics.median(a / b for a, b in zip(seconds[n], seconds["ours"], strict=True)), 3
        )
        for n in others
    }
    return record


def summary_line(record: dict[str, Any]) -> str:
    """``op shape dtype pass: ours X ms, eager/ours r, ...`` for a record."""
    head = f"{record['op']} {record['shape']} {record['dtype']} {record['pass']}"
    if "error" in record:
        return f"{head}: {record['error']}"
    ratios = ", ".join(f"{k} {v}" for k, v in record["ratios"].items())
    return f"{head}: ours {record['results']['ours']['median_ms']} ms, {ratios}"


def main(argv: Sequence[str] | None = None, echo: Callable[[str], None] = print) -> dict:
    """Run the benchmark; ``echo`` receives each case's JSON line and then the whole record's
    (the last line)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = build_cases(
        args.shape_list, args.ops, args.dtypes, args.device, with_compile=not args.no_compile
    )
    records = []
    for case in cases:
        records.append(run_case(case, args))
        echo(json.dumps(records[-1]))
    record = {
        "benchmark": "kernels",
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "shapes": {s.preset: {"micro_batch": s.micro_batch, "seq": s.seq} for s in args.shape_list},
        "dtypes": list(args.dtypes),
        "ops": list(args.ops),
        "compile": not args.no_compile,
        "rounds": args.rounds,
        "warmup_rounds": args.warmup,
        "round_ms": args.round_ms,
        "implementations": {
            f"{row.family}/{row.device_type}": row.name
            for row in implementation_table((args.device,))
        },
        "summary": [summary_line(r) for r in records],
        "cases": records,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "thp_mem_alloc_enable": os.environ.get(THP_VARIABLE, ""),
    }
    echo(json.dumps(record))
    return record


if __name__ == "__main__":
    from megatron_het.errors import run_cli
    from megatron_het.launcher.host_memory import prefer_huge_pages

    prefer_huge_pages(os.environ)  # as training runs allocate (before torch does)
    run_cli(main)
