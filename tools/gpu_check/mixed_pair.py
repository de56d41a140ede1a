"""The real mixed pair: ``pretrain_llama.py`` under torchrun on one H200 rank and one CPU rank,
against single-process runs of the same model, seed and batch.

Runs (each under its own timeout; independent ones at the same time):

- ``ref_gpu``, ``ref_cpu``: one process on the GPU, and on the CPU (``CUDA_VISIBLE_DEVICES=``);
- ``pp_full``: the pp=2 plan for 2N iterations; ``pp_half`` + ``pp_resume``: the same run
  saved and stopped at N, then resumed from the checkpoint to 2N;
- ``dp``: the dp=2 plan (one pipeline per kind) with ``--use-distributed-optimizer``,
  ``--overlap-grad-reduce`` and ``--overlap-param-gather``.

While the second wave (``pp_resume`` and ``dp``, two pairs) runs, NVML is sampled for the
processes holding a context on the GPU (:mod:`tools.gpu_check.gpu_processes`): the
pairs' CPU ranks (local rank 1) must hold none (``mixed.cpu-context``).

Tolerances. The CPU and the GPU sum in different orders (blocked GEMMs, SDPA kernels), so the
fp32 losses of a pair cannot be expected to equal a one-device run bit for bit: a forward pass
differs in the ~1e-7 relative range, and training with Adam lets such differences grow. As in
the project's parallel tests, ``--adam-eps 1e-6`` keeps Adam from turning rounding in near-zero
gradient elements into lr-sized steps, and the losses must agree within 1e-4 relative over 2N
iterations. The ``ref_gpu`` / ``ref_cpu`` row measures the same effect without any parallelism
(the floor a pair cannot beat). A resume runs the same kernels on the same devices, so it must
agree far closer (1e-5; equal unless a kernel is non-deterministic).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable

import torch

from megatron_het.arguments import parse_run_config, resolve_model_config
from megatron_het.config import ModelConfig
from megatron_het.data.tokenizer import build_tokenizer
from megatron_het.errors import UserError
from tools.gpu_check.context import REPO, CheckContext
from tools.gpu_check.device_checks import skip_all
from tools.gpu_check.gpu_processes import GpuProcessWatch, nvml
from tools.gpu_check.metrics_file import compare_losses, losses
from tools.gpu_check.pair_files import (
    GLOBAL_BATCH,
    MICRO_BATCH,
    PairFiles,
    load_and_validate,
    pair_files,
)
from tools.gpu_check.report import FAIL, PASS, SKIP, status_of
from tools.gpu_check.runner import CommandResult, run_parallel

HALF = 4  # N: the resume run stops at N and resumes to 2N
LOSS_RTOL = 1e-4
RESUME_RTOL = 1e-5
RUN_S = 75.0  # per sub-run
THREADS = "2"  # CPU threads per process: up to 7 processes share the host's cores

MODEL_FLAGS = [
    "--model",
    "small",
    "--seq-length",
    "128",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "4000",
]
TRAIN_FLAGS = [
    "--train-iters",
    str(2 * HALF),
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-warmup-iters",
    "2",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "1.0",
    "--adam-eps",
    "1e-6",
    "--seed",
    "1234",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
]


def pair_model_config() -> ModelConfig:
    """The model the pair trains, resolved as ``pretrain_llama.py`` resolves its flags."""
    run = parse_run_config([*MODEL_FLAGS, *TRAIN_FLAGS])
    data = run.data
    tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_size)
    return resolve_model_config(run.model, tokenizer.vocab_size, data.seq_length)


def check_mixed_pair(ctx: CheckContext) -> None:
    """Rows ``mixed.files``, ``mixed.reference``, ``mixed.pp``, ``mixed.resume``, ``mixed.dp``,
    ``mixed.cpu-context``."""
    kind = ctx.options.pair_kind
    files = pair_files(kind, ctx.work / "files")
    try:
        load_and_validate(files, pair_model_config())
    except UserError as exc:
        ctx.rows.add("mixed.files", FAIL, str(exc), "cluster and plans load and validate")
        return
    ctx.rows.add(
        "mixed.files",
        PASS,
        f"{files.cluster.name}, {files.pp_plan.name}, {files.dp_plan.name}",
        "cluster and plans load and validate",
    )
    if kind.lower() != "cpu" and not torch.cuda.is_available():
        skip_all(ctx, RUN_ROWS)
        return
    with_cpu_ref = kind.lower() != "cpu"  # else ref_gpu already runs on the CPU
    runs = _runs(ctx, files)

    def metrics(name: str) -> dict[int, float]:
        return losses(ctx.work / f"{name}.jsonl")

    # Two waves of sub-runs in parallel; each wave's rows go out as soon as it ends, so a
    # check stopped in the second wave keeps the first wave's rows.
    first = ["ref_gpu", "pp_full", "pp_half"] + (["ref_cpu"] if with_cpu_ref else [])
    results: dict[str, CommandResult | None] = _wave(ctx, runs, first)
    ref = metrics("ref_gpu")
    # A pair runs part of the model on the CPU, so it can be no closer to the GPU run than
    # the CPU run is: past LOSS_RTOL that floor fails mixed.reference alone, and the pair's
    # runs are held to twice it.
    pair_rtol = LOSS_RTOL
    if with_cpu_ref:
        floor = _compare(
            ctx,
            "mixed.reference",
            "single process GPU vs CPU",
            metrics("ref_cpu"),
            ref,
            [results["ref_cpu"], results["ref_gpu"]],
            LOSS_RTOL,
        )
        if floor is not None and math.isfinite(floor):
            pair_rtol = max(LOSS_RTOL, 2 * floor)
    _compare(
        ctx,
        "mixed.pp",
        f"pp=2 {kind}+cpu vs single process",
        metrics("pp_full"),
        ref,
        [results["pp_full"], results["ref_gpu"]],
        pair_rtol,
    )
    second = (["pp_resume"] if results["pp_half"].ok else []) + ["dp"]
    module = nvml() if with_cpu_ref else None
    watch = (
        GpuProcessWatch(module, ("LOCAL_RANK", RUN_MARKER)).start() if module is not None else None
    )
    try:
        results.update(_wave(ctx, runs, second))
    finally:
        seen = watch.stop() if watch is not None else None
    _cpu_context_row(
        ctx,
        seen,
        watch.samples if watch is not None else 0,
        runs["dp"][1][RUN_MARKER],
        module is None and with_cpu_ref,
    )
    _compare(
        ctx,
        "mixed.resume",
        f"save at {HALF}, resume to {2 * HALF} vs uninterrupted",
        metrics("pp_resume"),
        metrics("pp_full"),
        [results["pp_half"], results.get("pp_resume"), results["pp_full"]],
        RESUME_RTOL,
    )
    _compare(
        ctx,
        "mixed.dp",
        "dp=2 across kinds, ZeRO-1 + overlapped grad reduce vs single",
        metrics("dp"),
        ref,
        [results["dp"], results["ref_gpu"]],
        pair_rtol,
    )


RUN_ROWS = ("mixed.reference", "mixed.pp", "mixed.resume", "mixed.dp", "mixed.cpu-context")
CPU_LOCAL_RANK = 1  # the pair's CPU rank (pair_files: rank 0 on the GPU, rank 1 on the CPU)
# in the environment of this check's runs (a token of its own), to tell them from other jobs'
# processes on the host's GPUs
RUN_MARKER = "MEGATRON_HET_GPU_CHECK_RUN"


def _cpu_context_row(
    ctx: CheckContext,
    seen: dict[int, dict[str, str]] | None,
    samples: int,
    token: str,
    no_nvml: bool,
) -> None:
    """Row ``mixed.cpu-context`` from the processes NVML saw on the GPU during the second
    wave (``seen``: pid -> its LOCAL_RANK and marker; None: not watched): of this check's
    runs (marker ``token``), FAIL where a pair's CPU rank held a context, PASS where only the
    GPU ranks did, SKIP where NVML cannot tell (missing, or no GPU rank of ours seen, as in
    a container whose process ids NVML does not share)."""
    threshold = "the CPU ranks hold no CUDA context"
    if seen is None:
        ctx.rows.add(
            "mixed.cpu-context",
            SKIP,
            "NVML (pynvml) is not usable here" if no_nvml else "no GPU rank in this pair",
            threshold,
        )
        return
    ours = [env.get("LOCAL_RANK") for env in seen.values() if env.get(RUN_MARKER) == token]
    gpu, cpu = ours.count("0"), ours.count(str(CPU_LOCAL_RANK))
    value = (
        f"{gpu} GPU rank(s) and {cpu} CPU rank(s) of the pairs on the GPU over {samples} "
        f"samples ({len(seen)} processes seen)"
    )
    if cpu:
        ctx.rows.add("mixed.cpu-context", FAIL, value, threshold, processes=seen)
    elif not gpu:
        ctx.rows.add("mixed.cpu-context", SKIP, f"cannot tell: {value}", threshold)
    else:
        ctx.rows.add("mixed.cpu-context", PASS, value, threshold)


_METRICS = ("ref_gpu", "ref_cpu", "pp_full", "pp_resume", "dp")  # metrics files, work/NAME.jsonl


def _runs(ctx: CheckContext, files: PairFiles) -> dict[str, tuple[list[str], dict]]:
    """The sub-runs (module docstring): name -> (argv, environment)."""
    env = {
        **ctx.env,
        "OMP_NUM_THREADS": THREADS,
        RUN_MARKER: f"{os.getpid()}-{time.monotonic_ns()}",
    }
    metrics = {name: str(ctx.work / f"{name}.jsonl") for name in _METRICS}
    single = [
        ctx.python,
        str(REPO / "pretrain_llama.py"),
        *MODEL_FLAGS,
        *TRAIN_FLAGS,
        "--micro-batch-size",
        str(MICRO_BATCH),
        "--global-batch-size",
        str(GLOBAL_BATCH),
    ]
    pair = [
        *ctx.torchrun(2),
        str(REPO / "pretrain_llama.py"),
        *MODEL_FLAGS,
        *TRAIN_FLAGS,
        "--cluster",
        str(files.cluster),
    ]
    pp = [*pair, "--plan", str(files.pp_plan)]
    ckpt = str(ctx.work / "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)  # a --work directory used before
    runs = {
        "ref_gpu": ([*single, "--metrics-file", metrics["ref_gpu"]], env),
        "pp_full": ([*pp, "--metrics-file", metrics["pp_full"]], env),
        "pp_half": (
            [
                *pp,
                "--metrics-file",
                metrics["pp_resume"],
                "--save",
                ckpt,
                "--save-interval",
                str(HALF),
                "--exit-interval",
                str(HALF),
            ],
            env,
        ),
        "ref_cpu": (
            [*single, "--metrics-file", metrics["ref_cpu"]],
            {**env, "CUDA_VISIBLE_DEVICES": ""},
        ),
        "pp_resume": (
            [*pp, "--metrics-file", metrics["pp_resume"], "--load", ckpt, "--save", ckpt],
            env,
        ),
        "dp": (
            [
                *pair,
                "--plan",
                str(files.dp_plan),
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
                "--metrics-file",
                metrics["dp"],
            ],
            env,
        ),
    }
    return runs


def _wave(
    ctx: CheckContext, runs: dict[str, tuple[list[str], dict]], names: list[str]
) -> dict[str, CommandResult]:
    def job(name: str) -> Callable[[], CommandResult]:
        argv, env = runs[name]
        return lambda: ctx.run(argv, RUN_S, f"{name}.log", env)

    return dict(zip(names, run_parallel([job(name) for name in names], len(names))))


def _compare(
    ctx: CheckContext,
    check: str,
    what: str,
    run: dict[int, float],
    reference: dict[int, float],
    results: list,
    rtol: float,
) -> float | None:
    """One row: FAIL naming the sub-run that did not finish, else the loss comparison, whose
    largest relative difference is returned (None: not compared)."""
    for result in results:
        if result is None:
            ctx.rows.add(check, FAIL, "not run: the run it continues failed", f"<= {rtol:g} rel")
            return None
        if not result.ok:
            ctx.rows.add(
                check,
                FAIL,
                f"{result.log_path.stem} {result.why()}",
                f"<= {rtol:g} rel",
                log_tail=result.tail(),
            )
            return None
    comparison = compare_losses(run, reference)
    ctx.rows.add(
        check,
        status_of(comparison.within(rtol)),
        comparison.describe(),
        f"<= {rtol:g} rel",
        what=what,
        max_rel=comparison.max_rel,
        losses=[list(t) for t in comparison.per_iteration],
        seconds=[round(r.seconds, 1) for r in results],
    )
    return comparison.max_rel
