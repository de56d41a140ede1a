"""The predictor against published large-scale training runs (no device needed).

    .venv/bin/python -m bench.published_runs [--pipeline-model simulate|closed_form]
                                             [--uncalibrated] [--h100-plain-schedule]

For every row of the table (``bench/data/published_runs.yaml``: Narayanan et al. 2021 Table 1,
A100's calibration set; the Megatron-LM README's H100 weak-scaling table, whose rows without a
pipeline are H100's calibration set; held out: its rows with one, the README's GPT-3 example,
Narayanan et al. 2021 Table 2's PTD-P rows (175B and 530B at a fixed batch on 4x as many
GPUs) and Megatron-Turing NLG 530B on 2,240-3,360 GPUs with full recompute): the predicted
iteration time at the row's kind's calibrated efficiencies
(:mod:`megatron_het.perf.cost.calibration`; ``--uncalibrated``: the cost model's defaults)
with the attention kernel of the row's software (``unfused`` for Megatron-LM 2021, ``flash``
for 2024), the published one, and the relative error ``predicted / published - 1``. The
pipeline is simulated (:mod:`megatron_het.perf.schedule.simulator`) unless ``--pipeline-model
closed_form``; about fifteen seconds either way (the memory figures of thousands of devices
dominate). ``--h100-plain-schedule``: the H100 rows with micro-batch 1 and no interleaving
instead of the schedule inferred for them (:func:`schedule_of`). Prints one table row per run
(stderr), then one JSON line last: median_abs_error and max_abs_error over all rows, the
calibration set's and the held-out set's medians and maxima (and the held-out set's medians
per study), every row's error, what each row did that the predictor cannot express, and the
conditions.

Each :class:`PublishedRun` is one row of the data file (which holds the sources and what each
study's settings rest on): the GPT model's shape, the layout (TP, PP, virtual stages, DP,
GPUs), batch and micro-batch, sequence and vocabulary, the options that change time
(recompute, boundary scatter/gather, DP overlap, ZeRO-1, the gradient reduction's precision,
the software's attention kernel), what the run did that the predictor cannot express
(:attr:`PublishedRun.not_expressed`), the published throughput (TFLOP/s per GPU) and the FLOP
count that paper defines it with. :attr:`PublishedRun.published_iteration_s` turns the
throughput back into an iteration time with THAT formula (not ours); :func:`build` gives the
``(ModelConfig, ParallelPlan, ClusterSpec, seq_length)`` to predict; :func:`fit_efficiency`
refits a kind's calibration (the product's constants in
:mod:`megatron_het.perf.cost.calibration` are its results).

FLOP counts (B batch, s sequence, l layers, h hidden, V vocabulary):

* ``narayanan2021``: ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``, Narayanan et al. 2021's own
  count; it includes the recomputed forward (4 passes of the layers, 3 of the logits).
* ``megatron_core``: Megatron-LM's ``num_floating_point_operations`` (training.py, July 2024):
  ``12 B s l h^2 ((1 + g/a + s/h) q/h + (f/h) m + V/(2 l h))`` with g/a = 1 (MHA), q = h,
  f = 4h, m = 1 (no gated MLP): ``12 B s l h^2 (6 + s/h + V/(2 l h))``, no recompute counted.

GPT onto our Llama: multi-head attention (query groups = heads, head size h/a); a SwiGLU MLP
of ``f = 8h/3`` (rounded to a multiple of tp), whose three matrices have GPT's 4h GELU MLP's
FLOPs and parameters (``3 h 8h/3 = 2 h 4h``); tied embeddings (both sources tie them). What
differs: RMSNorm for LayerNorm and SwiGLU for GELU (the same memory traffic to within a few
%), RoPE instead of learned positions (no position table: ``s h`` parameters fewer), no biases
and no hidden dropouts (GPT's bias adds and its two bias-dropout-adds per layer are
memory-bound work our cost model lacks; the A100 GEMM fit absorbs them). The attention is the
software's: the 2021 rows run Megatron-LM's unfused attention (``attention_kernel="unfused"``,
:func:`~megatron_het.perf.cost.roofline.attention_ops`: materialised scores, the fused causal
softmax, attention dropout 0.1 -- Megatron's default, which the scripts keep), the 2024 rows a
flash-class kernel (TransformerEngine's fused attention: ``"flash"``, our runtime's too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_het.cluster import ClusterSpec, NodeGroup, get_accelerator
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.fileio import read_yaml_mapping
from megatron_het.parallel.buckets import megatron_default_bucket_size
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_builders import plan_from_megatron_flags
from megatron_het.perf import Prediction, SimulationCache, predict
from megatron_het.perf.cost.calibration import (
    FACTORS,
    STEP,
    CalibrationFit,
    efficiency_for,
    least_squares,
    sensitivity,
)
from megatron_het.perf.cost.roofline import DEFAULT_EFFICIENCY, Efficiency

TABLE = Path(__file__).resolve().parent / "data" / "published_runs.yaml"
TABLE_FORMAT = "megatron_het.published_runs/1"
GBIT_PER_GBYTE = 8.0
# What fit_efficiency solves for on Table 1 (calibration module docstring), and its rounds.
FITTED_FACTORS = ("gemm",)
FIT_ROUNDS = 4


@dataclass(frozen=True)
class PublishedRun:
    """One published training run (see the module docstring for the sources and fields)."""

    name: str
    study: str  # short name of the source, to group rows by
    source: str
    split: str  # "calibration" | "held_out"
    gpu: str  # accelerator kind
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    num_gpus: int
    global_batch: int
    micro_batch: int
    tflops_per_gpu: float  # published, per the FLOP count ``flop_formula``
    flop_formula: str  # "narayanan2021" | "megatron_core"
    seq_length: int = 2048
    vocab: int = 51200
    virtual_stages: int = 1
    recompute: bool = True
    dtype: str = "fp16"
    scatter_gather_p2p: bool = False
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_bf16: bool = False
    tp_comm_overlap: bool = False  # with sequence_parallel: the runtime's rings
    attention_kernel: str = "flash"  # the software's (cost_model.ATTENTION_KERNELS)
    gpus_per_node: int = 8
    nic_gbit_per_s: float = 1600.0  # per node, all NICs together
    published_time_s: float | None = None  # an iteration time the source states itself
    not_expressed: tuple[str, ...] = ()  # what the run did that the predictor cannot express
    ddp_bucket_size: int | None = None  # --ddp-bucket-size (None: the runtime's default)
    notes: str = ""

    @property
    def dp(self) -> int:
        return self.num_gpus // (self.tp * self.pp)

    @property
    def published_flops(self) -> float:
        """FLOPs of one iteration by the source's own count."""
        return FLOP_FORMULAS[self.flop_formula](self)

    @property
    def published_iteration_s(self) -> float:
        """The iteration time the published TFLOP/s per GPU stands for."""
        return self.published_flops / (self.tflops_per_gpu * 1e12 * self.num_gpus)


def narayanan2021_flops(run: PublishedRun) -> float:
    """``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` (Narayanan et al. 2021)."""
    b, s, l, h, v = run.global_batch, run.seq_length, run.layers, run.hidden, run.vocab
    return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def megatron_core_flops(run: PublishedRun) -> float:
    """Megatron-LM's ``num_floating_point_operations`` for GPT (MHA, 4h GELU MLP):
    ``12 B s l h^2 (6 + s/h + V/(2 l h))``."""
    b, s, l, h, v = run.global_batch, run.seq_length, run.layers, run.hidden, run.vocab
    return 12.0 * b * s * l * h * h * (6 + s / h + v / (2 * l * h))


FLOP_FORMULAS: dict[str, Callable[[PublishedRun], float]] = {
    "narayanan2021": narayanan2021_flops,
    "megatron_core": megatron_core_flops,
}


def schedule_of(layers: int, pp: int, dp: int, global_batch: int) -> tuple[int, int]:
    """``(micro_batch, virtual_stages)`` inferred for a Megatron-Core H100 row (module
    docstring): with a pipeline, micro-batch 1 interleaved at one layer per virtual stage;
    without one, the whole local batch as one micro-batch."""
    if pp > 1:
        return 1, layers // pp
    return global_batch // dp, 1


def load_runs(path: str | Path = TABLE) -> tuple[PublishedRun, ...]:
    """Every row of the table at ``path``, study by study in file order (the data file's header
    says how its rows are spelled). ValueError for a file of another format."""
    data = read_yaml_mapping(path, "published-runs table")
    if data.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path}: expected format {TABLE_FORMAT!r}, got {data.get('format')!r}")
    runs = []
    for study in data["studies"]:
        for values in study["rows"]:
            if len(values) != len(study["columns"]):
                raise ValueError(f"{path}: a {study['study']} row has {len(values)} values")
            row = {**study["settings"], **dict(zip(study["columns"], values))}
            runs.append(_run(study["study"], study["source"], row))
    return tuple(runs)


def _run(study: str, source: str, row: dict[str, Any]) -> PublishedRun:
    """One row's :class:`PublishedRun`, with what the loader derives (the data file's header)."""
    size = row.pop("size")
    per_virtual = row.pop("layers_per_virtual_stage", None)
    if per_virtual:
        row["virtual_stages"] = row["layers"] // row["pp"] // per_virtual
    dp = row["num_gpus"] // (row["tp"] * row["pp"])
    if row.get("micro_batch") == "inferred":
        row["micro_batch"], row["virtual_stages"] = schedule_of(
            row["layers"], row["pp"], dp, row["global_batch"]
        )
    if row.get("ddp_bucket_size") == "megatron_default":
        row["ddp_bucket_size"] = megatron_default_bucket_size(dp)
    row["tp_comm_overlap"] = bool(row.get("tp_comm_overlap")) and row["tp"] > 1
    row["not_expressed"] = tuple(row.get("not_expressed", ()))
    return PublishedRun(name=f"{study}-{size}", study=study, source=source, **row)


ALL_RUNS: tuple[PublishedRun, ...] = load_runs()
NARAYANAN_RUNS = tuple(r for r in ALL_RUNS if r.study == "narayanan2021")
(GPT3_README_RUN,) = (r for r in ALL_RUNS if r.study == "megatron-readme-gpt3")
MEGATRON_CORE_H100_RUNS = tuple(r for r in ALL_RUNS if r.study == "megatron-core-h100")
# Calibration: Table 1 (A100's GEMM) and the H100 rows without a pipeline (H100's GEMM);
# held out: the GPT-3 example, the H100 rows with one, Table 2 and MT-NLG.
CALIBRATION_RUNS = tuple(r for r in ALL_RUNS if r.split == "calibration")
HELD_OUT_RUNS = tuple(r for r in ALL_RUNS if r.split == "held_out")


@dataclass(frozen=True)
class BuiltRun:
    """What :func:`predict` takes for a run."""

    model: ModelConfig
    plan: ParallelPlan
    cluster: ClusterSpec
    seq_length: int


def model_config(run: PublishedRun) -> ModelConfig:
    """The GPT of ``run`` as our Llama (module docstring): MHA, SwiGLU of ~8h/3, tied."""
    ffn = run.tp * round(8 * run.hidden / (3 * run.tp))
    return ModelConfig(
        num_layers=run.layers,
        hidden_size=run.hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=run.heads,
        num_query_groups=run.heads,
        vocab_size=run.vocab,
        max_position_embeddings=run.seq_length,
        tie_embeddings=True,
        name=run.name,
    )


def cluster_spec(run: PublishedRun) -> ClusterSpec:
    """``num_gpus / gpus_per_node`` nodes of ``run.gpu``; the kind's NVLink-class figure inside
    a node, the node's NICs between nodes."""
    if run.num_gpus % run.gpus_per_node:
        raise ValueError(
            f"{run.name}: {run.num_gpus} GPUs do not fill nodes of {run.gpus_per_node}"
        )
    group = NodeGroup(
        run.gpu.lower(),
        get_accelerator(run.gpu),
        run.num_gpus // run.gpus_per_node,
        run.gpus_per_node,
        run.nic_gbit_per_s / GBIT_PER_GBYTE,
    )
    return ClusterSpec([group], name=run.name)


def build(run: PublishedRun) -> BuiltRun:
    """The model, plan (Megatron's rank order; validated) and cluster of ``run``; scatter/gather
    boundaries are not a plan option (:func:`predict_run` passes them to the predictor)."""
    model, cluster = model_config(run), cluster_spec(run)
    plan = plan_from_megatron_flags(
        model,
        run.num_gpus,
        run.tp,
        run.pp,
        run.micro_batch,
        run.global_batch,
        accelerator_of=cluster,
        recompute=run.recompute,
        virtual_stages=run.virtual_stages if run.virtual_stages > 1 else None,
    )
    sharded = run.tp > 1 and run.sequence_parallel
    plan = dataclasses.replace(
        plan,
        dtype=run.dtype,
        sequence_parallel=sharded,
        use_distributed_optimizer=run.distributed_optimizer,
        overlap_grad_reduce=run.overlap_grad_reduce,
        overlap_param_gather=run.overlap_param_gather,
        grad_reduce_in_bf16=run.grad_reduce_in_bf16,
        tp_comm_overlap=(sharded and run.tp_comm_overlap) or None,
    )
    return BuiltRun(model, plan, cluster, run.seq_length)


def plain_schedule(run: PublishedRun) -> PublishedRun:
    """``run`` with micro-batch 1 and no interleaving (the plainest reading of an H100 row,
    ``bench/published_runs.py --h100-plain-schedule``)."""
    return dataclasses.replace(run, micro_batch=1, virtual_stages=1)


def run_efficiency(run: PublishedRun, efficiency: Efficiency | None = None) -> Efficiency:
    """The factors ``run`` is priced at: ``efficiency`` (None: its kind's calibrated figures,
    :func:`~megatron_het.perf.cost.calibration.efficiency_for`) with the row's attention kernel
    (the software's, not the device's)."""
    base = efficiency_for(get_accelerator(run.gpu)) if efficiency is None else efficiency
    return dataclasses.replace(base, attention_kernel=run.attention_kernel)


def predict_run(
    run: PublishedRun,
    efficiency: Efficiency | None = None,
    pipeline_model: str = "simulate",
    cache: SimulationCache | None = None,
) -> Prediction:
    """The predictor's estimate of ``run`` at :func:`run_efficiency` ``(run, efficiency)``, with
    the row's scatter/gather boundaries."""
    built = build(run)
    return predict(
        built.model,
        built.plan,
        built.cluster,
        built.seq_length,
        options=RunOptions.from_plan(built.plan, ddp_bucket_size=run.ddp_bucket_size),
        efficiency=run_efficiency(run, efficiency),
        pipeline_model=pipeline_model,
        cache=cache,
        validate=False,
        scatter_gather_tensors_in_pipeline=run.scatter_gather_p2p,
    )


def fit_efficiency(
    runs: Sequence[PublishedRun] | None = None,
    factors: Sequence[str] = FITTED_FACTORS,
    base: Efficiency = DEFAULT_EFFICIENCY,
    rounds: int = FIT_ROUNDS,
    gpu: str = "A100-80G",
) -> CalibrationFit:
    """Refit ``factors`` of one kind on ``runs`` (default: the calibration rows of ``gpu``) as
    :mod:`megatron_het.perf.cost.calibration` describes: per run, a closed-form prediction at the
    current factors and one with each fitted factor raised by ``STEP``, then
    :func:`~megatron_het.perf.cost.calibration.least_squares`; repeated from the fitted factors
    (``rounds`` in all, or until they move less than 1e-4) so that the linear form is taken
    where the fit lands (an op near its roofline's ridge changes sides between factors)."""
    if runs is None:
        runs = [run for run in CALIBRATION_RUNS if run.gpu == gpu]
    runs = list(runs)
    if not runs:
        raise ValueError(f"no calibration rows of {gpu!r}")
    kinds = {run.gpu for run in runs}
    if len(kinds) != 1:
        raise ValueError(f"fit one accelerator kind at a time, got {sorted(kinds)}")
    unknown = set(factors) - set(FACTORS)
    if unknown or not factors:
        raise ValueError(f"fit some of {', '.join(FACTORS)}; got {list(factors)}")
    if rounds < 1:
        raise ValueError(f"a fit takes at least one round, got {rounds}")
    cache = SimulationCache()
    current = base
    for _ in range(rounds):
        found = []
        for run in runs:

            def time_at(e: Efficiency) -> float:
                return predict_run(run, e, "closed_form", cache).iteration_time_s

            raised = {
                f: time_at(dataclasses.replace(current, **{f: getattr(current, f) * STEP}))
                for f in factors
            }
            found.append(
                sensitivity(run.name, run.published_iteration_s, current, time_at(current), raised)
            )
        fitted = least_squares(found, current)
        moved = max(abs(getattr(fitted, f) / getattr(current, f) - 1) for f in factors)
        current = fitted
        if moved < 1e-4:
            break
    return CalibrationFit(current, tuple(found))


HEADER = (
    f"{'run':32s} {'split':11s} {'gpu':9s} {'GPUs':>5s} {'TPxPPxDP':>10s} {'v':>3s} "
    f"{'mbs':>3s} {'published s':>11s} {'predicted s':>11s} {'error':>7s}"
)


def row_line(run: PublishedRun, predicted: float, error: float) -> str:
    layout = f"{run.tp}x{run.pp}x{run.dp}"
    return (
        f"{run.name:32s} {run.split:11s} {run.gpu:9s} {run.num_gpus:5d} {layout:>10s} "
        f"{run.virtual_stages:3d} {run.micro_batch:3d} "
        f"{run.published_iteration_s:11.3f} {predicted:11.3f} {error:+7.1%}"
    )


def median_abs(errors: list[float]) -> float:
    return statistics.median(abs(e) for e in errors) if errors else float("nan")


def predicted_rows(args: argparse.Namespace, cache: SimulationCache) -> list[dict[str, Any]]:
    """Every run's predicted and published time and error, as JSON rows (one table line
    each to stderr)."""
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
    return rows


def summary(rows: list[dict[str, Any]], conditions: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's JSON: errors over all rows, per split and per held-out study."""
    errors = [r["error"] for r in rows]
    calibration = [r["error"] for r in rows if r["split"] == "calibration"]
    held_out = [r for r in rows if r["split"] == "held_out"]
    by_study: dict[str, list[float]] = {}
    for r in held_out:
        by_study.setdefault(r["study"], []).append(r["error"])
    return {
        "benchmark": "published_runs",
        "median_abs_error": median_abs(errors),
        "max_abs_error": max(abs(e) for e in errors),
        "calibration_median_abs_error": median_abs(calibration),
        "calibration_max_abs_error": max(abs(e) for e in calibration),
        "held_out_median_abs_error": median_abs([r["error"] for r in held_out]),
        "held_out_max_abs_error": max(abs(r["error"]) for r in held_out),
        "held_out_median_abs_error_by_study": {k: median_abs(v) for k, v in by_study.items()},
        "errors": {r["run"]: r["error"] for r in rows},
        "rows": rows,
        "conditions": conditions,
    }


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
    rows = predicted_rows(args, SimulationCache())
    conditions = {
        "pipeline_model": args.pipeline_model,
        "efficiency": "defaults" if args.uncalibrated else "calibrated",
        "h100_schedule": "plain" if args.h100_plain_schedule else "inferred",
        "error": "predicted / published - 1",
        "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(summary(rows, conditions)))


if __name__ == "__main__":
    main()
