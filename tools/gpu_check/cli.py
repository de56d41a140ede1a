"""``python -m tools.gpu_check`` (``scripts/gpu_check.sh``): every check that needs a GPU,
each in its own process and time budget, then a table and a JSON summary.

Budgets (seconds; the whole run stops starting checks at :data:`DEADLINE_S`, under 8 minutes on
one H200 host with 16 cores): probe 25, numerics 20, kernels 30, relay 25, mixed pair 115,
MFU 105, profile 75, bench 65; probe, numerics, relay, mixed pair, MFU and profile took 7, 8,
13, 33, 61 and 15 on one H200 (before the profile's compiled sweep; the bench and the kernels
check had not run there), the mixed pair 101 on a 2-core host with a CPU pair.
``--cpu-only`` hides the GPU from every check (``CUDA_VISIBLE_DEVICES=``), so each reports SKIP
at once; it runs the same processes, for machines without a GPU and for the tests.

The summary goes to ``--out``, else ``$OUT`` when set, else ``./gpu_check_out``: gpu_check.json,
gpu_check_table.txt and gpu_check_logs.txt (the end of every check's and sub-run's log). Exit
status 0 when no check failed, 1 otherwise, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from megatron_het.errors import UserError, run_cli
from tools.gpu_check.context import CheckContext, Options
from tools.gpu_check.report import (
    LOGS_NAME,
    RowWriter,
    all_passed,
    format_table,
    write_summary,
)
from tools.gpu_check.runner import Check, run_checks

# name -> (budget seconds, "module:function" of the check)
CHECKS: dict[str, tuple[float, str]] = {
    "probe": (25.0, "tools.gpu_check.device_checks:check_probe"),
    "numerics": (20.0, "tools.gpu_check.device_checks:check_numerics"),
    "kernels": (30.0, "tools.gpu_check.kernel_check:check_kernels"),
    "relay": (25.0, "tools.gpu_check.relay_check:check_relay"),
    "mixed": (115.0, "tools.gpu_check.mixed_pair:check_mixed_pair"),
    "mfu": (105.0, "tools.gpu_check.mfu:check_mfu"),
    "profile": (75.0, "tools.gpu_check.profile_check:check_profile"),
    "bench": (65.0, "tools.gpu_check.bench_check:check_bench"),
}
DEADLINE_S = 460.0  # + a last check's grace and the script's start-up: under 8 minutes
_LOG_TAIL_LINES = 120


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--cpu-only",
        action="store_true",
        help="hide the GPU: every GPU check reports SKIP (no-GPU machines, tests)",
    )
    p.add_argument("--only", metavar="NAMES", help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument(
        "--out", metavar="DIR", help="summary directory (default $OUT, else ./gpu_check_out)"
    )
    p.add_argument(
        "--work",
        metavar="DIR",
        help="scratch files: checkpoints, metrics, logs "
        "(default: a new directory under the system's temp directory)",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=DEADLINE_S,
        metavar="S",
        help=f"start no check after S seconds (default {DEADLINE_S:g})",
    )
    p.add_argument(
        "--pair-kind",
        default="H200",
        metavar="KIND",
        help="accelerator of the mixed pair's rank 0 (default H200; cpu runs the "
        "pair and relay checks' logic on a machine without a GPU)",
    )
    p.add_argument(
        "--mfu-micro-batch",
        type=int,
        default=4,
        metavar="N",
        help="first micro-batch size of the MFU run, halved on out-of-memory",
    )
    p.add_argument("--mfu-iters", type=int, default=10, metavar="N")
    p.add_argument(
        "--mfu-flags",
        default="",
        metavar="FLAGS",
        help="extra pretrain_llama.py flags of the MFU runs (eager and --compile), "
        'given with "=", e.g. --mfu-flags="--recompute-activations"; with '
        "--compile among them only the compiled run is made",
    )
    return p


def options_of(args: argparse.Namespace) -> Options:
    if args.mfu_micro_batch < 1 or args.mfu_iters < 3:
        raise UserError("--mfu-micro-batch must be at least 1 and --mfu-iters at least 3")
    return Options(
        cpu_only=args.cpu_only,
        pair_kind=args.pair_kind,
        mfu_micro_batch=args.mfu_micro_batch,
        mfu_iters=args.mfu_iters,
        mfu_flags=tuple(shlex.split(args.mfu_flags)),
    )


def _option_argv(args: argparse.Namespace) -> list[str]:
    """The options a check process needs, as flags of ``run-one``."""
    return ["--cpu-only"] * args.cpu_only + [
        "--pair-kind",
        args.pair_kind,
        "--mfu-micro-batch",
        str(args.mfu_micro_batch),
        "--mfu-iters",
        str(args.mfu_iters),
        f"--mfu-flags={args.mfu_flags}",
    ]


def selected_checks(only: str | None) -> list[str]:
    if not only:
        return list(CHECKS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise UserError(f"--only: unknown check {unknown[0]!r}; checks: {', '.join(CHECKS)}")
    return names


def run_one(argv: Sequence[str]) -> None:
    """``run-one NAME ... --rows FILE --work DIR --budget S``: one check in this process."""
    parser = build_parser()
    parser.add_argument("name", choices=sorted(CHECKS))
    parser.add_argument("--rows", required=True)
    parser.add_argument("--budget", type=float, required=True)
    args = parser.parse_args(list(argv))
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ctx = CheckContext(
        RowWriter(args.rows, echo=sys.stdout),
        work,
        time.monotonic() + args.budget,
        options_of(args),
    )
    module, function = CHECKS[args.name][1].split(":")
    getattr(importlib.import_module(module), function)(ctx)


def main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """Run the selected checks (see the module docstring); returns the exit status."""
    if argv[:1] == ["run-one"]:
        run_one(argv[1:])
        return 0
    args = build_parser().parse_args(list(argv))
    options_of(args)  # refuse bad options before starting anything
    names = selected_checks(args.only)
    out = pathlib.Path(args.out or environ.get("OUT") or "gpu_check_out")
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="gpu_check_"))
    env = dict(environ)
    if args.cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    prefix = (sys.executable, "-m", "tools.gpu_check", "run-one")
    checks = [Check(name, CHECKS[name][0], (*prefix, name, *_option_argv(args))) for name in names]
    print(f"gpu check: {', '.join(names)}; budget {args.deadline:.0f} s; work {work}", flush=True)
    start, started = time.monotonic(), time.strftime("%Y-%m-%d %H:%M:%S")

    def summarise(rows: list, runs: list, finished: bool) -> tuple[pathlib.Path, dict]:
        meta = {
            "started": started,
            "host": platform.node(),
            "python": sys.executable,
            "argv": list(argv),
            "cpu_only": args.cpu_only,
            "elapsed_s": round(time.monotonic() - start, 1),
            "deadline_s": args.deadline,
            "work": str(work),
            "finished": finished,
            "checks": [vars(run) for run in runs],
        }
        path = write_summary(out, rows, meta)
        (out / LOGS_NAME).write_text(collect_logs(work), encoding="utf-8")
        return path, meta

    # the summary so far after every check: a run killed from outside still leaves it
    rows, runs = run_checks(
        checks,
        work,
        args.deadline,
        echo=sys.stdout,
        env=env,
        after_each=lambda rows, runs: summarise(rows, runs, False),
    )
    path, meta = summarise(rows, runs, True)
    print("\n" + format_table(rows))
    passed = all_passed(rows)
    print(
        f"\n{'all checks passed' if passed else 'some checks FAILED'} in "
        f"{meta['elapsed_s']:.0f} s; summary {path}",
        flush=True,
    )
    return 0 if passed else 1


def collect_logs(work: pathlib.Path, lines: int = _LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of every log under ``work``, each under its path."""
    parts = []
    for log in sorted(work.rglob("*.log")) + sorted(work.rglob("log.txt")):
        text = log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
        parts.append(f"===== {log.relative_to(work)}\n" + "\n".join(text))
    return "\n\n".join(parts) + "\n"


def entry() -> None:
    """Console entry: ``main`` over this process's argv and environment; exits with its status
    (2 and one line for a UserError)."""
    status = {"code": 0}
    run_cli(lambda: status.update(code=main(sys.argv[1:], os.environ)))
    raise SystemExit(status["code"])
