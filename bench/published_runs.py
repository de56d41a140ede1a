"""The predictor against published large-scale training runs (no device needed).

    .venv/bin/python -m bench.published_runs [--pipeline-model simulate|closed_form]
                                             [--uncalibrated] [--h100-plain-schedule]

For every row of :mod:`megatron_het.perf.published_runs` (Narayanan et al. 2021 Table 1, the
calibration set; the Megatron-LM README's GPT-3 example and H100 weak-scaling table, held
out): the predicted iteration time at the row's kind's calibrated efficiencies
(:mod:`megatron_het.perf.calibration`; ``--uncalibrated``: the cost model's defaults) with the
attention kernel of the row's software (``unfused`` for Megatron-LM 2021, ``flash`` for 2024), the
published one (the source's TFLOP/s per GPU turned back into seconds with that source's own
FLOP count), and the relative error ``predicted / published - 1``. The pipeline is simulated
(the event-driven 1F1B of :mod:`megatron_het.perf.simulator`) unless ``--pipeline-model
closed_form``; about ten seconds either way (the memory figures of thousands of devices
dominate). ``--h100-plain-schedule``: the H100 rows with micro-batch 1 and no interleaving
instead of the schedule inferred for them (``published_runs.schedule_of``).

Prints one table row per run (stderr), then one JSON line last: median_abs_error and
max_abs_error over all rows, the calibration set's and the held-out set's medians and maxima
(and the held-out set's medians per study), every row's error, what each row did that the
predictor cannot express, and the conditions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from megatron_het.perf.cost_model import DEFAULT_EFFICIENCY
from megatron_het.perf.published_runs import (
    ALL_RUNS,
    PublishedRun,
    plain_schedule,
    predict_run,
    run_efficiency,
)
from megatron_het.perf.simulator import SimulationCache

ROOT = Path(__file__).resolve().parent.parent

HEADER = (
    f"{'run':28s} {'split':11s} {'gpu':9s} {'GPUs':>5s} {'TPxPPxDP':>10s} {'v':>3s} "
    f"{'mbs':>3s} {'published s':>11s} {'predicted s':>11s} {'error':>7s}"
)


def row_line(run: PublishedRun, predicted: float, error: float) -> str:
    layout = f"{run.tp}x{run.pp}x{run.dp}"
    return (
        f"{run.name:28s} {run.split:11s} {run.gpu:9s} {run.num_gpus:5d} {layout:>10s} "
        f"{run.virtual_stages:3d} {run.micro_batch:3d} "
        f"{run.published_iteration_s:11.3f} {predicted:11.3f} {error:+7.1%}"
    )


def median_abs(errors: list[float]) -> float:
    return statistics.median(abs(e) for e in errors) if errors else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline-model", choices=("simulate", "closed_form"), default="simulate")
    parser.add_argument(
        "--uncalibrated",
        action="store_true",
        help="the cost model's default efficiencies for every kind",
    )
    parser.add_argument(
        "--h100-plain-schedule",
        action="store_true",
        help="the H100 rows with micro-batch 1 and no interleaving",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    cache = SimulationCache()
    rows = []
    print(HEADER, file=sys.stderr)
    for run in ALL_RUNS:
        if args.h100_plain_schedule and run.study == "megatron-core-h100":
            run = plain_schedule(run)
        # None: the kind's calibrated figures; either way with the row's attention kernel.
        chosen = DEFAULT_EFFICIENCY if args.uncalibrated else None
        efficiency = run_efficiency(run, chosen)
        prediction = predict_run(run, chosen, args.pipeline_model, cache)
        predicted = prediction.iteration_time_s
        error = predicted / run.published_iteration_s - 1
        print(row_line(run, predicted, error), file=sys.stderr)
        rows.append(
            {
                "run": run.name,
                "split": run.split,
                "study": run.study,
                "source": run.source,
                "gpu": run.gpu,
                "num_gpus": run.num_gpus,
                "tp": run.tp,
                "pp": run.pp,
                "dp": run.dp,
                "virtual_stages": run.virtual_stages,
                "micro_batch": run.micro_batch,
                "published_s": run.published_iteration_s,
                "predicted_s": predicted,
                "error": error,
                "efficiency": vars(efficiency),
                "not_expressed": list(run.not_expressed),
            }
        )
    errors = [r["error"] for r in rows]
    calibration = [r["error"] for r in rows if r["split"] == "calibration"]
    held_out = [r for r in rows if r["split"] == "held_out"]
    by_study: dict[str, list[float]] = {}
    for r in held_out:
        by_study.setdefault(r["study"], []).append(r["error"])
    print(
        json.dumps(
            {
                "benchmark": "published_runs",
                "median_abs_error": median_abs(errors),
                "max_abs_error": max(abs(e) for e in errors),
                "calibration_median_abs_error": median_abs(calibration),
                "calibration_max_abs_error": max(abs(e) for e in calibration),
                "held_out_median_abs_error": median_abs([r["error"] for r in held_out]),
                "held_out_max_abs_error": max(abs(r["error"]) for r in held_out),
                "held_out_median_abs_error_by_study": {
                    k: median_abs(v) for k, v in by_study.items()
                },
                "errors": {r["run"]: r["error"] for r in rows},
                "rows": rows,
                "conditions": {
                    "pipeline_model": args.pipeline_model,
                    "efficiency": "defaults" if args.uncalibrated else "calibrated",
                    "h100_schedule": "plain" if args.h100_plain_schedule else "inferred",
                    "error": "predicted / published - 1",
                    "wall_s": time.perf_counter() - start,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
