"""Single-GPU MFU and peak memory of a ~1B Llama (TinyLlama's shape): bf16, seq 2048, mock data,
run twice: eager, and with ``--compile`` (each decoder layer compiled, its elementwise work
fused, as production runs fuse it).

Each run is ``pretrain_llama.py``'s own path (:func:`prepare_run`, :func:`train_prepared`) in a
driver process (``python -m tools.gpu_check.mfu --result R.json -- FLAGS``) that also
asks the predictor for the plan's peak memory and MFU (what ``--dry-run`` prints) and reads
``torch.cuda.max_memory_allocated`` after training, which the run itself does not report.
MFU is the metrics file's ``mfu`` (model FLOPs by Megatron's formula, full S x S attention,
over the kind's dense bf16 peak from the accelerator table), the median of the iterations after
the first two. A micro-batch that runs out of memory is halved and the run tried again.

Thresholds: MFU >= 40% for the compiled run, >= 45% for the eager one, whose RMSNorms, RoPE and
loss run the fused kernels of ``csrc/`` (30.8% on one H200 before they existed, 49.4% compiled);
measured peak within
25% of the memory model's prediction (which leaves out the CUDA context and allocator
fragmentation, as ``max_memory_allocated`` does); the measured iteration time (median after the
first two) within 25% of the predictor's for the same run (its calibrated figures for the kind:
:mod:`megatron_het.perf.cost.calibration`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import torch

from megatron_het.arguments import parse_run_config
from megatron_het.errors import UserError, run_cli
from megatron_het.launcher.rank_device import local_accelerator
from megatron_het.launcher.world import init_world, shutdown_world
from megatron_het.training.run import predict_run, train_prepared
from megatron_het.training.setup import RunSetup, prepare_run
from tools.gpu_check.context import CheckContext
from tools.gpu_check.device_checks import rows_or_fail, skip_all
from tools.gpu_check.metrics_file import median_field, train_records
from tools.gpu_check.report import FAIL, status_of

MFU_MIN = {"compile": 0.40, "eager": 0.45}
MEMORY_RTOL = 0.25
STEP_RTOL = 0.25
MICRO_BATCHES = 4  # per iteration (gradient accumulation): global batch = 4 x micro-batch
WARMUP_ITERS = 2
RUN_S = {"eager": 40.0, "compile": 60.0}  # per run (both took 61 s together on one H200)
GIB = 2**30
# TinyLlama-1.1B's shape: 1123M parameters with an untied 32000-token head.
MODEL_FLAGS = [
    "--num-layers",
    "22",
    "--hidden-size",
    "2048",
    "--ffn-hidden-size",
    "5632",
    "--num-attention-heads",
    "16",
    "--num-query-groups",
    "4",
    "--untie-embeddings-and-output-weights",
    "--max-position-embeddings",
    "2048",
    "--seq-length",
    "2048",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "31999",
]


def train_flags(
    micro_batch: int, iters: int, metrics: pathlib.Path, extra: Sequence[str] = ()
) -> list[str]:
    """``pretrain_llama.py`` flags of one MFU run: ``--bf16`` as training defines it (bf16
    weights and activations, fp32 main gradients, master weights and Adam state), eager
    (``extra`` may add ``--compile``), one global batch of 4 micro-batches per iteration."""
    return [
        *MODEL_FLAGS,
        "--bf16",
        "--micro-batch-size",
        str(micro_batch),
        "--global-batch-size",
        str(MICRO_BATCHES * micro_batch),
        "--train-iters",
        str(iters),
        "--lr",
        "1e-4",
        "--min-lr",
        "1e-5",
        "--lr-warmup-iters",
        "2",
        "--seed",
        "1234",
        "--eval-iters",
        "0",
        "--log-interval",
        "1",
        "--metrics-file",
        str(metrics),
        *extra,
    ]


def variants(extra: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """The runs of the check: ``("eager", extra)`` and ``("compile", extra + --compile)``;
    the compiled run alone where ``extra`` asks for ``--compile`` already."""
    extra = tuple(extra)
    if "--compile" in extra:
        return [("compile", extra)]
    return [("eager", extra), ("compile", (*extra, "--compile"))]


def rows_of(variant: str) -> tuple[str, str, str]:
    """The MFU, step-time and memory rows of a variant (``mfu.<variant>``, ...)."""
    return f"mfu.{variant}", f"mfu.{variant}.step", f"mfu.{variant}.memory"


def check_mfu(ctx: CheckContext) -> None:
    """Rows ``mfu.<variant>``, ``mfu.<variant>.step`` and ``mfu.<variant>.memory`` of the eager
    and the compiled run (see the module docstring)."""
    runs = variants(ctx.options.mfu_flags)
    if not torch.cuda.is_available():
        skip_all(ctx, tuple(row for variant, _ in runs for row in rows_of(variant)))
        return
    for variant, extra in runs:  # an error in one run fails its rows; the other still runs
        with rows_or_fail(ctx, rows_of(variant)):
            _check_variant(ctx, variant, extra)


def _check_variant(ctx: CheckContext, variant: str, extra: Sequence[str]) -> None:
    micro_batch, tried = ctx.options.mfu_micro_batch, []
    while micro_batch >= 1:
        metrics = ctx.work / f"metrics_{variant}_mb{micro_batch}.jsonl"
        result_path = ctx.work / f"result_{variant}_mb{micro_batch}.json"
        for stale in (metrics, result_path):  # a reused --work: an earlier run's files
            stale.unlink(missing_ok=True)
        flags = train_flags(micro_batch, ctx.options.mfu_iters, metrics, extra)
        run = ctx.run(
            [
                ctx.python,
                "-m",
                "tools.gpu_check.mfu",
                "--result",
                str(result_path),
                "--",
                *flags,
            ],
            RUN_S[variant],
            f"mfu_{variant}_mb{micro_batch}.log",
        )
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        tried.append(micro_batch)
        if result.get("oom") and micro_batch > 1:
            micro_batch //= 2
            continue
        break
    if not run.ok or "peak_bytes" not in result:
        why = "out of memory" if result.get("oom") else run.why()
        for name in rows_of(variant):
            ctx.rows.add(
                name,
                FAIL,
                f"micro-batch {micro_batch}: {why}",
                "run finishes",
                tried=tried,
                log_tail=run.tail(),
            )
        return
    _report(ctx, variant, micro_batch, tried, train_records(metrics), result)


def _report(
    ctx: CheckContext,
    variant: str,
    micro_batch: int,
    tried: list[int],
    records: list[dict[str, Any]],
    result: dict[str, Any],
) -> None:
    mfu_row, step_row, memory_row = rows_of(variant)
    mfu = median_field(records, "mfu", WARMUP_ITERS)
    tokens = median_field(records, "tokens_per_s", WARMUP_ITERS)
    tflops = median_field(records, "tflops_per_device", WARMUP_ITERS)
    predicted = result.get("predicted_mfu")
    # compiled: inductor fuses each layer's elementwise work; eager: the csrc kernels do
    minimum = MFU_MIN[variant]
    threshold = f">= {minimum:.0%} of {result['accelerator']} bf16 dense peak" + (
        " (eager: csrc kernels)" if variant == "eager" else ""
    )
    if mfu is None:
        ctx.rows.add(mfu_row, FAIL, "the metrics file has no mfu", threshold)
    else:
        ctx.rows.add(
            mfu_row,
            status_of(mfu >= minimum),
            f"{mfu:.1%} ({tflops:.0f} TFLOP/s, {tokens:,.0f} tokens/s, micro-batch "
            f"{micro_batch} x {MICRO_BATCHES}; predicted "
            + (f"{predicted:.1%})" if predicted is not None else "n/a)"),
            threshold,
            mfu=mfu,
            tokens_per_s=tokens,
            tflops_per_device=tflops,
            tried=tried,
            iteration_s=[r.get("iteration_time_s") for r in records],
            predicted_mfu=predicted,
            flags=result.get("flags"),
            attention_kernel=result.get("attention_kernel"),
            fp32_out_gemm=result.get("fp32_out_gemm"),
        )
    _report_step(ctx, step_row, records, result)
    peak, want = result["peak_bytes"], result.get("predicted_peak_bytes")
    if not want:
        ctx.rows.add(
            memory_row,
            FAIL,
            f"peak {peak / GIB:.1f} GiB; the predictor gave no "
            f"figure: {result.get('prediction_error')}",
            f"within {MEMORY_RTOL:.0%}",
        )
        return
    ratio = peak / want
    ctx.rows.add(
        memory_row,
        status_of(abs(ratio - 1) <= MEMORY_RTOL),
        f"peak {peak / GIB:.1f} GiB allocated ({result['peak_reserved_bytes'] / GIB:.1f}"
        f" reserved) vs predicted {want / GIB:.1f} GiB (x{ratio:.2f})",
        f"within {MEMORY_RTOL:.0%} of the prediction",
        ratio=ratio,
        breakdown=result.get("predicted_memory"),
    )


def _report_step(
    ctx: CheckContext, row: str, records: list[dict[str, Any]], result: dict[str, Any]
) -> None:
    """Row ``row``: the measured single-GPU iteration against the predicted one."""
    measured = median_field(records, "iteration_time_s", WARMUP_ITERS)
    predicted = result.get("predicted_iteration_s")
    threshold = f"predicted within {STEP_RTOL:.0%} of measured"
    if measured is None or not predicted:
        ctx.rows.add(
            row,
            FAIL,
            "no measured iteration time"
            if measured is None
            else f"the predictor gave no figure: {result.get('prediction_error')}",
            threshold,
        )
        return
    error = predicted / measured - 1
    ctx.rows.add(
        row,
        status_of(abs(error) <= STEP_RTOL),
        f"measured {measured:.3f} s vs predicted {predicted:.3f} s ({error:+.1%})",
        threshold,
        measured_s=measured,
        predicted_s=predicted,
        error=error,
    )


# ---- the driver process ----------------------------------------------------------------------
def driver_main(argv: Sequence[str]) -> int:
    """Predict, train and measure one run; writes ``--result`` JSON. Exit 3 on out-of-memory."""
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check.mfu")
    parser.add_argument("--result", required=True)
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args(list(argv))
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    setup = prepare_run(parse_run_config(flags), 1, local_accelerator())
    result: dict[str, Any] = {"accelerator": setup.accelerator(0).name, "flags": flags}
    result.update(_prediction(setup))
    path = pathlib.Path(args.result)
    cuda = setup.accelerator(0).device_type == "cuda"
    init_world(None, device_type=setup.accelerator(0).device_type)
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        train_prepared(setup, out=sys.stdout)
        if cuda:  # a CPU run (development) has no allocator figures
            result["peak_bytes"] = torch.cuda.max_memory_allocated()
            result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
            result.update(_kernels_used(setup))
    except RuntimeError as exc:  # OutOfMemoryError is one; cuBLAS reports its own plainly
        if not is_out_of_memory(exc):
            raise
        result["oom"] = str(exc).splitlines()[0][:300]
    finally:
        shutdown_world()
        path.write_text(json.dumps(result) + "\n")
    return 3 if "oom" in result else 0


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the device running out of memory (the allocator's error, or a
    library's that could not allocate its workspace)."""
    text = str(exc)
    return (
        isinstance(exc, torch.cuda.OutOfMemoryError)
        or "CUBLAS_STATUS_ALLOC_FAILED" in text
        or "out of memory" in text.lower()
    )


def _kernels_used(setup: RunSetup) -> dict[str, Any]:
    """The attention kernel and GEMM path the run's shapes take on this device."""
    from megatron_het.kernels.attention import kernel_for
    from megatron_het.kernels.gemm import fp32_out_gemm_supported

    config, device = setup.model_config, torch.device("cuda", torch.cuda.current_device())
    q = torch.empty(
        1, 16, config.num_attention_heads, config.kv_channels, dtype=torch.bfloat16, device=device
    )
    kernel = kernel_for(q, q[:, :, : config.num_query_groups])
    return {"attention_kernel": kernel.label, "fp32_out_gemm": fp32_out_gemm_supported(device)}


def _prediction(setup: RunSetup) -> dict[str, Any]:
    """The predictor's peak memory (the dry run's), MFU and iteration time for ``setup``."""
    try:
        prediction = predict_run(setup)
    except UserError as exc:
        return {"prediction_error": str(exc)}
    stage = max(prediction.stages, key=lambda s: s.memory.total_bytes)
    return {
        "predicted_peak_bytes": prediction.peak_memory_bytes,
        "predicted_memory": stage.memory.to_dict(),
        "predicted_mfu": prediction.mfu,
        "predicted_iteration_s": prediction.iteration_time_s,
    }


if __name__ == "__main__":
    run_cli(lambda: sys.exit(driver_main(sys.argv[1:])))
