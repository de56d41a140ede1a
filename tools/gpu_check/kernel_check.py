"""The ``kernels`` check: our compiled device ops (``csrc/``, ``torch.ops.megatron_het.*``) on the
GPU against float64 references of their contract, and the memory bandwidth each reaches.

``kernels.<op>.<dtype>`` (fp32, bf16), at the 7B layer's shapes
(:mod:`tools.gpu_check.kernel_refs`): rms_norm_fwd (with and without a residual), rms_norm_bwd
(with and without grad_sum and the weight gradient), rope_fwd (q and k as views of a fused qkv
projection, forward and inverse), cross_entropy_stats, cross_entropy_grad_ and
cross_entropy_fused_ (a vocabulary shard, labels outside it), swiglu_fwd and swiglu_bwd (gate
and up as the halves of a fused [N, 2F] projection, and contiguous). The value is the worst output's
max |difference| over its max |reference|. Thresholds: fp32 1e-5 (float32 arithmetic, sums of
4096 to 32000 terms in another order than float64's); bf16 1e-2 (one rounding of each output
to bfloat16, at most 2^-9 of a value).

``kernels.<op>.bandwidth`` (bf16): the bytes the op must read and write over its median time
of 20 runs (CUDA events, the L2 cache flushed before each), against the device's peak memory
bandwidth: the accelerator table's figure where it knows the device, else torch's device
properties. 80% of peak is a target: a row below it says so but does not fail (the rows have
no warning status).

Without a visible GPU every row is SKIP under ``--cpu-only`` (else FAIL, as in the other
checks); where ``megatron_het._C`` does not load or has no CUDA kernel for an op, that op's
rows are SKIP with the reason.
"""

from __future__ import annotations

import importlib
import statistics
from collections.abc import Callable
from typing import Any

import torch

from megatron_het.cluster.accelerators import AcceleratorRegistry
from megatron_het.comm.faults import first_line
from megatron_het.errors import UserError
from megatron_het.launcher.rank_device import local_accelerator
from tools.gpu_check import kernel_refs as refs
from tools.gpu_check.context import CheckContext
from tools.gpu_check.device_checks import max_rel_error, rows_or_fail, skip_all
from tools.gpu_check.report import PASS, SKIP, status_of

OPS = (
    "rms_norm_fwd",
    "rms_norm_bwd",
    "rope_fwd",
    "cross_entropy_stats",
    "cross_entropy_grad_",
    "cross_entropy_fused_",
    "swiglu_fwd",
    "swiglu_bwd",
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}
BANDWIDTH_TARGET = 0.8
TIMED_RUNS, WARMUP_RUNS = 20, 3
FLUSH_BYTES = 256 * 2**20  # past any GPU's L2 cache
Errors = dict[str, float]


def row_names(op: str) -> tuple[str, ...]:
    return (*(f"kernels.{op}.{label}" for label in DTYPES), f"kernels.{op}.bandwidth")


def check_kernels(ctx: CheckContext) -> None:
    """Rows ``kernels.<op>.<dtype>`` and ``kernels.<op>.bandwidth`` (see the module docstring)."""
    if not torch.cuda.is_available():
        skip_all(ctx, tuple(name for op in OPS for name in row_names(op)))
        return
    missing = missing_ops()
    device = torch.device("cuda", torch.cuda.current_device())
    peak, peak_source = peak_bandwidth(device)
    for op in OPS:
        if op in missing:
            for name in row_names(op):
                ctx.rows.add(name, SKIP, missing[op], "a compiled CUDA kernel")
            continue
        for label, dtype in DTYPES.items():
            name = f"kernels.{op}.{label}"
            with rows_or_fail(ctx, (name,)):
                errors = PARITY[op](device, dtype)
                worst = max(errors, key=lambda output: errors[output])
                ctx.rows.add(
                    name,
                    status_of(errors[worst] <= TOLERANCE[label]),
                    f"max rel err {errors[worst]:.1e} ({worst})",
                    f"<= {TOLERANCE[label]:g} of the largest reference value",
                    errors=errors,
                )
        with rows_or_fail(ctx, (f"kernels.{op}.bandwidth",)):
            bandwidth_row(ctx, op, device, peak, peak_source)
        torch.cuda.empty_cache()


def missing_ops() -> dict[str, str]:
    """op -> why it cannot be checked, for the ops without a compiled CUDA kernel."""
    try:
        importlib.import_module("megatron_het._C")
    except Exception as exc:  # not built, or built against another torch
        return {op: f"megatron_het._C does not load: {first_line(exc)}" for op in OPS}
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    return {
        op: "megatron_het._C has no CUDA kernel for it (built without a device compiler?)"
        for op in OPS
        if not has_kernel(f"megatron_het::{op}", "CUDA")
    }


def peak_bandwidth(device: torch.device) -> tuple[float | None, str]:
    """(peak memory bandwidth in GB/s, where the figure comes from)."""
    try:
        kind = local_accelerator()
        spec = AcceleratorRegistry.builtin().get(kind)
        return spec.memory_bandwidth_gbps, f"{kind}, accelerator table"
    except UserError:
        pass
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:  # double data rate: two transfers per clock
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, f"{props.name}, device properties"
    return None, f"{props.name}: peak unknown"


def ops() -> Any:
    return torch.ops.megatron_het


# ---- parity --------------------------------------------------------------------------------
def err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.shape != expected.shape:
        return float("inf")
    return max_rel_error(actual, expected) if expected.numel() else 0.0


def rms_norm_fwd_errors(device: torch.device, dtype: torch.dtype) -> Errors:
    i = refs.rms_inputs(device, dtype)
    out, s, rstd = ops().rms_norm_fwd(i["x"], i["residual"], i["weight"], refs.EPS)
    ref_out, ref_s, ref_rstd = refs.rms_norm_fwd_ref(i["x"], i["residual"], i["weight"], refs.EPS)
    weight32 = i["weight"].float()
    plain, empty_sum, _ = ops().rms_norm_fwd(i["x"], None, weight32, refs.EPS)
    ref_plain = refs.rms_norm_fwd_ref(i["x"], None, weight32, refs.EPS)[0]
    return {
        "out": err(out, ref_out),
        "sum": err(s, ref_s),
        "rstd": err(rstd, ref_rstd),
        "out, no residual, float32 weight": err(plain, ref_plain),
        "sum is empty without a residual": 0.0 if empty_sum.numel() == 0 else float("inf"),
    }


def rms_norm_bwd_errors(device: torch.device, dtype: torch.dtype) -> Errors:
    i = refs.rms_inputs(device, dtype)
    inp, weight = i["x"], i["weight"]
    rstd = refs.rms_norm_fwd_ref(inp, None, weight, refs.EPS)[2].float()
    grad_input, grad_weight = ops().rms_norm_bwd(
        i["grad_out"], i["grad_sum"], inp, weight, rstd, True
    )
    ref_input, ref_weight = refs.rms_norm_bwd_ref(i["grad_out"], i["grad_sum"], inp, weight, rstd)
    plain, no_weight = ops().rms_norm_bwd(i["grad_out"], None, inp, weight, rstd, False)
    ref_plain = refs.rms_norm_bwd_ref(i["grad_out"], None, inp, weight, rstd)[0]
    return {
        "grad_input": err(grad_input, ref_input),
        "grad_weight": err(grad_weight, ref_weight),
        "grad_input, no grad_sum": err(plain, ref_plain),
        "grad_weight empty when not asked": 0.0 if no_weight.numel() == 0 else float("inf"),
    }


def rope_errors(device: torch.device, dtype: torch.dtype) -> Errors:
    q, k, cos, sin = refs.rope_inputs(device, dtype)
    offset = refs.ROPE_OFFSET
    q_out, k_out = ops().rope_fwd(q, k, cos, sin, offset, False)
    q_back, none_out = ops().rope_fwd(q, None, cos, sin, offset, True)
    return {
        "q": err(q_out, refs.rope_ref(q, cos, sin, offset, False)),
        "k": err(k_out, refs.rope_ref(k, cos, sin, offset, False)),
        "q, inverse": err(q_back, refs.rope_ref(q, cos, sin, offset, True)),
        "outputs contiguous": 0.0 if q_out.is_contiguous() and k_out.is_contiguous() else 1.0,
        "k_out empty without k": 0.0 if none_out.numel() == 0 else float("inf"),
    }


def ce_stats_errors(device: torch.device, dtype: torch.dtype) -> Errors:
    logits, labels, _ = refs.ce_inputs(device, dtype)
    top, sum_exp, target = ops().cross_entropy_stats(logits, labels, refs.VOCAB_START)
    ref_top, ref_sum, ref_target = refs.ce_stats_ref(logits, labels, refs.VOCAB_START)
    return {
        "max": err(top, ref_top),
        "sum_exp": err(sum_exp, ref_sum),
        "target": err(target, ref_target),
    }


def ce_grad_errors(device: torch.device, dtype: torch.dtype) -> Errors:
    logits, labels, scale = refs.ce_inputs(device, dtype)
    top, sum_exp, _ = refs.ce_stats_ref(logits, labels, refs.VOCAB_START)
    lse = refs.lse_of(top, sum_exp).float()
    grad = logits.clone()
    ops().cross_entropy_grad_(grad, labels, refs.VOCAB_START, lse, scale)
    ref = refs.ce_grad_ref(logits, labels, refs.VOCAB_START, lse, scale)
    return {"grad": err(grad, ref)}


def ce_fused_errors(device: torch.device, dtype: torch.dtype) -> Errors:
    logits, labels, _ = refs.ce_inputs(device, dtype)
    top, sum_exp, target = refs.ce_stats_ref(logits, labels, refs.VOCAB_START)
    lse = refs.lse_of(top, sum_exp)
    grad = logits.clone()
    loss = ops().cross_entropy_fused_(grad, labels, refs.VOCAB_START, None)
    ref_grad = refs.ce_grad_ref(logits, labels, refs.VOCAB_START, lse, None)
    return {"loss": err(loss, lse - target), "grad": err(grad, ref_grad)}


def contiguous_error(*tensors: torch.Tensor) -> float:
    return 0.0 if all(t.is_contiguous() for t in tensors) else 1.0


def swiglu_fwd_errors(device: torch.device, dtype: torch.dtype) -> Errors:
    gate, up, _ = refs.swiglu_inputs(device, dtype)
    out = ops().swiglu_fwd(gate, up)
    ref = refs.swiglu_ref(gate, up)
    plain = ops().swiglu_fwd(gate.contiguous(), up.contiguous())
    return {
        "out": err(out, ref),
        "out, contiguous inputs": err(plain, ref),
        "out contiguous": contiguous_error(out),
    }


def swiglu_bwd_errors(device: torch.device, dtype: torch.dtype) -> Errors:
    gate, up, grad = refs.swiglu_inputs(device, dtype)
    grad_gate, grad_up = ops().swiglu_bwd(grad, gate, up)
    ref_gate, ref_up = refs.swiglu_bwd_ref(grad, gate, up)
    plain_gate, _ = ops().swiglu_bwd(grad, gate.contiguous(), up.contiguous())
    return {
        "grad_gate": err(grad_gate, ref_gate),
        "grad_up": err(grad_up, ref_up),
        "grad_gate, contiguous inputs": err(plain_gate, ref_gate),
        "outputs contiguous": contiguous_error(grad_gate, grad_up),
    }


PARITY: dict[str, Callable[[torch.device, torch.dtype], Errors]] = {
    "rms_norm_fwd": rms_norm_fwd_errors,
    "rms_norm_bwd": rms_norm_bwd_errors,
    "rope_fwd": rope_errors,
    "cross_entropy_stats": ce_stats_errors,
    "cross_entropy_grad_": ce_grad_errors,
    "cross_entropy_fused_": ce_fused_errors,
    "swiglu_fwd": swiglu_fwd_errors,
    "swiglu_bwd": swiglu_bwd_errors,
}


# ---- bandwidth -----------------------------------------------------------------------------
def bandwidth_case(op: str, device: torch.device) -> tuple[Callable[[], Any], int, str]:
    """(one call of ``op`` on bf16 inputs of the 7B layer, the bytes it must move, the shape)."""
    dtype = torch.bfloat16
    if op.startswith("rms_norm"):
        i = refs.rms_inputs(device, dtype)
        x, weight = i["x"], i["weight"]
        if op == "rms_norm_fwd":
            outs = ops().rms_norm_fwd(x, i["residual"], weight, refs.EPS)
            nbytes = refs.bytes_moved(x, i["residual"], weight, *outs)
            return (
                lambda: ops().rms_norm_fwd(x, i["residual"], weight, refs.EPS),
                nbytes,
                (f"x, residual [{refs.ROWS}, {refs.HIDDEN}]"),
            )
        rstd = ops().rms_norm_fwd(x, None, weight, refs.EPS)[2]
        grad = i["grad_out"]
        outs = ops().rms_norm_bwd(grad, None, x, weight, rstd, True)
        nbytes = refs.bytes_moved(grad, x, weight, rstd, *outs)
        return (
            lambda: ops().rms_norm_bwd(grad, None, x, weight, rstd, True),
            nbytes,
            (f"[{refs.ROWS}, {refs.HIDDEN}], weight gradient"),
        )
    if op == "rope_fwd":
        q, k, cos, sin = refs.rope_inputs(device, dtype)
        q, k = q.contiguous(), k.contiguous()
        outs = ops().rope_fwd(q, k, cos, sin, refs.ROPE_OFFSET, False)
        nbytes = refs.bytes_moved(q, k, *outs) + refs.table_bytes(cos, q.shape[1], refs.ROPE_OFFSET)
        shape = f"q {list(q.shape)}, k {list(k.shape)}"
        return lambda: ops().rope_fwd(q, k, cos, sin, refs.ROPE_OFFSET, False), nbytes, shape
    if op.startswith("swiglu"):
        return swiglu_bandwidth_case(op, device, dtype)
    logits, labels, scale = refs.ce_inputs(device, dtype)
    shape = f"[{refs.CE_ROWS}, {refs.VOCAB}]"
    start = refs.VOCAB_START
    if op == "cross_entropy_stats":
        outs = ops().cross_entropy_stats(logits, labels, start)
        nbytes = refs.bytes_moved(logits, labels, *outs)
        return lambda: ops().cross_entropy_stats(logits, labels, start), nbytes, shape
    if op == "cross_entropy_grad_":
        top, sum_exp, _ = ops().cross_entropy_stats(logits, labels, start)
        lse = top + sum_exp.log()
        nbytes = refs.bytes_moved(logits, logits, labels, lse, scale)  # read and written
        return lambda: ops().cross_entropy_grad_(logits, labels, start, lse, scale), nbytes, shape
    loss = ops().cross_entropy_fused_(logits, labels, start, None)
    nbytes = refs.bytes_moved(logits, logits, labels, loss)
    return lambda: ops().cross_entropy_fused_(logits, labels, start, None), nbytes, shape


def swiglu_bandwidth_case(
    op: str, device: torch.device, dtype: torch.dtype
) -> tuple[Callable[[], Any], int, str]:
    """swiglu_fwd or swiglu_bwd on contiguous gate and up (the model's separate projections)."""
    gate, up, grad = refs.swiglu_inputs(device, dtype)
    gate, up = gate.contiguous(), up.contiguous()
    shape = f"gate, up [{refs.ROWS}, {refs.FFN}]"
    if op == "swiglu_fwd":
        nbytes = refs.bytes_moved(gate, up, ops().swiglu_fwd(gate, up))
        return lambda: ops().swiglu_fwd(gate, up), nbytes, shape
    nbytes = refs.bytes_moved(grad, gate, up, *ops().swiglu_bwd(grad, gate, up))
    return lambda: ops().swiglu_bwd(grad, gate, up), nbytes, shape


def median_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds of ``fn`` over TIMED_RUNS runs, the L2 cache flushed before each."""
    flush = torch.empty(FLUSH_BYTES // 4, device=device)
    for _ in range(WARMUP_RUNS):
        fn()
    times = []
    for _ in range(TIMED_RUNS):
        flush.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bandwidth_row(
    ctx: CheckContext, op: str, device: torch.device, peak: float | None, peak_source: str
) -> None:
    fn, nbytes, shape = bandwidth_case(op, device)
    ms = median_ms(fn, device)
    gbps = refs.gigabytes_per_second(nbytes, ms)
    threshold = f">= {BANDWIDTH_TARGET:.0%} of peak (a target: below it is noted, not failed)"
    details = {"gbps": gbps, "ms": ms, "bytes": nbytes, "shape": shape, "peak_source": peak_source}
    if peak is None:
        value = f"{gbps:,.0f} GB/s ({ms:.3f} ms, bf16 {shape}); {peak_source}"
        ctx.rows.add(f"kernels.{op}.bandwidth", PASS, value, threshold, **details)
        return
    fraction = gbps / peak
    value = (
        f"{gbps:,.0f} GB/s, {fraction:.0%} of {peak:,.0f} ({peak_source}); {ms:.3f} ms, "
        f"bf16 {shape}" + ("; below the target" if fraction < BANDWIDTH_TARGET else "")
    )
    ctx.rows.add(
        f"kernels.{op}.bandwidth",
        PASS,
        value,
        threshold,
        fraction_of_peak=fraction,
        peak_gbps=peak,
        below_target=fraction < BANDWIDTH_TARGET,
        **details,
    )
