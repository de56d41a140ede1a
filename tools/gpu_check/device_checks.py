"""In-process checks of the device: what the software stack offers (``probe``) and whether the
model computes the same on CUDA as on the CPU (``numerics``).

Thresholds. fp32 on CUDA runs with TF32 off, so CUDA and CPU differ only in summation order:
the tiny model's loss and every gradient tensor (max |difference| over max |value|) agree
within 1e-4. bf16 parameters (``model.to(torch.bfloat16)``, no autocast) keep ~3 significant
digits, and the loss over ~128 tokens averages their rounding: within 2e-2 of fp32. The fused
head + loss against ``F.cross_entropy`` on the full logits: 1e-5 (loss) and 1e-4 (gradients)
in fp32; 1e-3 and 2e-2 in bf16, whose GEMMs round the logits and the softmax gradient (on the
same bf16-rounded inputs the loss averages the logits' rounding over 4096 tokens). The TP
rings of ``--tp-comm-overlap`` with two ranks as threads on the GPU
(:mod:`tools.gpu_check.tp_rings`) against float32 products on the CPU: 1e-4 in fp32,
2e-2 in bf16.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from megatron_het.comm.faults import first_line
from megatron_het.config import model_preset
from megatron_het.errors import UserError
from megatron_het.launcher.rank_device import local_accelerator
from megatron_het.model.llama import build_model
from megatron_het.model.loss import IGNORE_INDEX, linear_cross_entropy
from tools.gpu_check.context import CheckContext
from tools.gpu_check.report import FAIL, PASS, SKIP, status_of
from tools.gpu_check.tp_rings import ring_errors

SEED = 1234
NO_GPU = "no CUDA device"
# name -> (required: FAIL when unusable, else SKIP), for bf16 causal attention.
SDPA_BACKENDS = {"flash": True, "mem_efficient": True, "cudnn": False}
OPTIONAL_PACKAGES = ("flash_attn", "apex", "liger_kernel")


@contextlib.contextmanager
def rows_or_fail(ctx: CheckContext, names: tuple[str, ...]) -> Iterator[None]:
    """Run a block that reports rows ``names``: an exception in it gives each of those not
    reported yet a FAIL row naming the error, and the check goes on with its next block."""
    try:
        yield
    except Exception as exc:
        reported = {row.check for row in ctx.rows.rows}
        for name in names:
            if name not in reported:
                ctx.rows.add(
                    name,
                    FAIL,
                    f"raised {type(exc).__name__}: {first_line(exc)}",
                    "runs without an error",
                )


def skip_all(
    ctx: CheckContext, names: tuple[str, ...], why: str = NO_GPU, missing_fails: bool = True
) -> None:
    """Rows ``names`` that cannot run without a GPU: SKIP under ``--cpu-only`` (the GPU is
    hidden on purpose), else FAIL (a GPU host whose device torch cannot see must not pass),
    unless ``missing_fails`` is False (another row already failed for it)."""
    fails = missing_fails and not ctx.options.cpu_only
    for name in names:
        ctx.rows.add(
            name,
            FAIL if fails else SKIP,
            f"{why} (not --cpu-only: a GPU was expected)" if fails else why,
        )


# ---- probe ---------------------------------------------------------------------------------
def check_probe(ctx: CheckContext) -> None:
    """Rows ``probe.torch``, ``probe.device``, ``probe.pending`` (the device events that
    mark device-backend operations for the run's deadline, :mod:`megatron_het.comm.pending`),
    ``probe.sdpa.<backend>``, ``probe.<package>``."""
    cuda = torch.cuda.is_available()
    nccl = _nccl_version() if cuda else "n/a"
    status = PASS if cuda else (SKIP if ctx.options.cpu_only else FAIL)
    ctx.rows.add(
        "probe.torch",
        status,
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}",
        "a CUDA device is visible",
        hip=torch.version.hip,
        tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        tf32_cudnn=torch.backends.cudnn.allow_tf32,
    )
    if not cuda:
        skip_all(
            ctx,
            (
                "probe.device",
                "probe.pending",
                *(f"probe.sdpa.{b}" for b in SDPA_BACKENDS),
                "probe.gemm-fp32-out",
                "probe.attention",
                *(f"probe.{p}" for p in OPTIONAL_PACKAGES),
            ),
            missing_fails=False,
        )
        return
    with rows_or_fail(ctx, ("probe.device",)):
        _probe_device(ctx)
    with rows_or_fail(ctx, ("probe.pending",)):
        _probe_pending(ctx)
    # the optional backends last: a crash inside one (a segfault takes the process) leaves
    # every other row reported
    required = [backend for backend, needed in SDPA_BACKENDS.items() if needed]
    for backend in required:
        with rows_or_fail(ctx, (f"probe.sdpa.{backend}",)):
            _probe_sdpa(ctx, backend)
    with rows_or_fail(ctx, ("probe.gemm-fp32-out", "probe.attention")):
        _probe_kernels(ctx)
    for package in OPTIONAL_PACKAGES:
        with rows_or_fail(ctx, (f"probe.{package}",)):
            _probe_package(ctx, package)
    for backend in (b for b in SDPA_BACKENDS if b not in required):
        with rows_or_fail(ctx, (f"probe.sdpa.{backend}",)):
            _probe_sdpa(ctx, backend)


def _probe_sdpa(ctx: CheckContext, backend: str) -> None:
    required = SDPA_BACKENDS[backend]
    ok, value, details = sdpa_usable(backend)
    status = PASS if ok else (FAIL if required else SKIP)
    ctx.rows.add(
        f"probe.sdpa.{backend}",
        status,
        value,
        "bf16 causal fwd+bwd, vs math <= 2e-2 rel" + ("" if required else " (optional)"),
        **details,
    )


def _probe_kernels(ctx: CheckContext, device: torch.device | None = None) -> None:
    """Rows ``probe.gemm-fp32-out`` (bf16 GEMMs with float32 sums, which the fused head and
    the TP layers' weight gradients need to stay in bf16) and ``probe.attention`` (the kernel
    training picks for the MFU model's bf16 GQA attention)."""
    from megatron_het.kernels.attention import FLASH_ATTN, SDPA_FLASH, kernel_for
    from megatron_het.kernels.gemm import fp32_out_addmm_supported, fp32_out_gemm_supported

    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    ok = fp32_out_gemm_supported(device)
    if ok and fp32_out_addmm_supported(device):
        value = "torch.mm/addmm(bf16, out_dtype=float32) run"
    elif ok:
        value = (
            f"torch.mm(bf16, out_dtype=float32) runs; addmm with a float32 sum does not "
            f"in torch {torch.__version__}: sums add a float32 product"
        )
    else:
        value = "unsupported: the fused head's GEMMs fall back to float32 operands (slow)"
    ctx.rows.add("probe.gemm-fp32-out", status_of(ok), value, "bf16 GEMMs with float32 sums")
    q = torch.empty(1, 16, 16, 128, dtype=torch.bfloat16, device=device)
    kernel = kernel_for(q, q[:, :, :4])
    chosen = kernel.label
    ctx.rows.add(
        "probe.attention",
        status_of(kernel in (FLASH_ATTN, SDPA_FLASH)),
        f"bf16 GQA (16 heads, 4 kv, head 128) -> {chosen}",
        "a flash kernel",
        kernel=chosen,
    )


def _nccl_version() -> str:
    try:
        version = torch.cuda.nccl.version()
    except Exception as exc:  # a build without NCCL raises from deep inside torch
        return f"unavailable ({type(exc).__name__})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _probe_device(ctx: CheckContext) -> None:
    props = torch.cuda.get_device_properties(0)
    shape = (
        f"{props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}"
        f"{props.minor}, {props.multi_processor_count} SMs"
    )
    try:
        kind = local_accelerator()
    except UserError as exc:
        ctx.rows.add("probe.device", FAIL, f"{shape}; {exc}", "a kind of the accelerator table")
        return
    ctx.rows.add(
        "probe.device",
        PASS,
        f"{shape} -> kind {kind}",
        "a kind of the accelerator table",
        devices=torch.cuda.device_count(),
    )


def _probe_pending(ctx: CheckContext) -> None:
    """A marker recorded behind queued work is pending until the work is done: the deadline
    sees a running operation as running and a finished one as finished."""
    from megatron_het.comm.pending import PendingOps, stream_marker

    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):  # ~3 TFLOP of queued work
        a = a @ a
        a = a / a.norm()
    marker = stream_marker("cuda")
    ops = PendingOps()
    ops.add(marker, "probe", "matmuls", "cuda stream")
    running = ops.stuck(0.0) is not None
    torch.cuda.synchronize()
    finished = ops.stuck(0.0) is None and len(ops) == 0
    ctx.rows.add(
        "probe.pending",
        PASS if running and finished else FAIL,
        f"pending while queued: {running}, done after synchronize: {finished}",
        "a marker is pending behind queued work and done after it",
    )


def sdpa_usable(
    backend: str, device: str = "cuda", seq: int = 1024
) -> tuple[bool, str, dict[str, Any]]:
    """Whether SDPA runs bf16 causal attention forward and backward on ``backend``, with
    plain and grouped-query heads (16 query heads of 128, 4 kv heads), and agrees with the math
    backend (max |difference| over max |output|: one bf16 ulp of the largest outputs is ~4e-3
    of them). Returns (usable, table text, per-variant error or reason)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "mem_efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[backend]
    generator = torch.Generator(device=device).manual_seed(SEED)
    details: dict[str, Any] = {}
    for label, kv_heads in (("mha", 16), ("gqa", 4)):
        q, k, v = (
            torch.randn(
                2, heads, seq, 128, device=device, dtype=torch.bfloat16, generator=generator
            )
            for heads in (16, kv_heads, kv_heads)
        )
        try:
            with sdpa_kernel([chosen]):
                out = _attention(q, k, v)
            with sdpa_kernel([SDPBackend.MATH]):
                ref = _attention(q, k, v)
            details[label] = max_rel_error(out, ref)
        except RuntimeError as exc:
            details[label] = f"unusable: {str(exc).splitlines()[0][:80]}"
    # flash runs training's grouped-query attention natively, so it must pass both; the
    # memory-efficient backend gets kv heads repeated (plain heads) in training
    needed = ("mha", "gqa") if backend == "flash" else ("mha",)
    ok = all(isinstance(details[n], float) and details[n] <= 2e-2 for n in needed)
    value = ", ".join(
        f"{k} " + (f"rel diff {v:.1e}" if isinstance(v, float) else v) for k, v in details.items()
    )
    return ok, value, details


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
    )
    out.float().square().mean().backward()
    if out.is_cuda:
        torch.cuda.synchronize()
    return out.detach()


def _probe_package(ctx: CheckContext, package: str) -> None:
    name = f"probe.{package}"
    if importlib.util.find_spec(package) is None:
        ctx.rows.add(name, SKIP, "not installed", "imports (optional)")
        return
    try:
        importlib.import_module(package)
        if package == "apex":  # apex's Python parts install without the CUDA extensions
            importlib.import_module("fused_layer_norm_cuda")
    except Exception as exc:  # a broken install fails in many ways; say which
        ctx.rows.add(name, FAIL, f"{type(exc).__name__}: {str(exc)[:160]}", "imports (optional)")
        return
    version = _version(package)
    extra = ""
    if package == "apex":
        from megatron_het.kernels import apex_rms_norm_available

        extra = f", fused_layer_norm_cuda ok, RMSNorm uses it: {apex_rms_norm_available()}"
    ctx.rows.add(name, PASS, f"{version}{extra}", "imports (optional)")


def _version(package: str) -> str:
    for dist_name in (package, package.replace("_", "-")):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "version unknown"


# ---- numerics ------------------------------------------------------------------------------
NUMERICS_ROWS = (
    "numerics.fp32-loss",
    "numerics.fp32-grads",
    "numerics.bf16-loss",
    "numerics.fused-loss-fp32",
    "numerics.fused-loss-bf16",
    "numerics.tp-rings-fp32",
    "numerics.tp-rings-bf16",
)


def check_numerics(ctx: CheckContext) -> None:
    """The tiny model on CUDA vs the CPU (fp32), bf16 parameters vs fp32, and the fused loss
    vs ``F.cross_entropy`` on CUDA (thresholds in the module docstring)."""
    if not torch.cuda.is_available():
        skip_all(ctx, NUMERICS_ROWS)
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gpu_loss = None
    with rows_or_fail(ctx, ("numerics.fp32-loss", "numerics.fp32-grads")):
        cpu_loss, cpu_grads = tiny_loss_and_grads("cpu", torch.float32)
        gpu_loss, gpu_grads = tiny_loss_and_grads("cuda", torch.float32)
        rel = abs(gpu_loss - cpu_loss) / abs(cpu_loss)
        ctx.rows.add(
            "numerics.fp32-loss",
            status_of(rel <= 1e-4),
            f"rel diff {rel:.2e} (cpu {cpu_loss:.6f}, cuda {gpu_loss:.6f})",
            "<= 1e-4 rel",
        )
        worst, name = max((max_rel_error(gpu_grads[n], cpu_grads[n]), n) for n in cpu_grads)
        ctx.rows.add(
            "numerics.fp32-grads",
            status_of(worst <= 1e-4),
            f"max rel diff {worst:.2e} ({name})",
            "<= 1e-4 of each tensor's max",
        )
    with rows_or_fail(ctx, ("numerics.bf16-loss",)):
        if gpu_loss is None:  # the fp32 run failed: the bf16 one has nothing to compare with
            gpu_loss, _ = tiny_loss_and_grads("cuda", torch.float32)
        bf16_loss, bf16_grads = tiny_loss_and_grads("cuda", torch.bfloat16)
        rel = abs(bf16_loss - gpu_loss) / abs(gpu_loss)
        finite = all(bool(torch.isfinite(g).all()) for g in bf16_grads.values())
        ctx.rows.add(
            "numerics.bf16-loss",
            status_of(rel <= 2e-2 and finite),
            f"rel diff {rel:.2e} vs fp32 ({bf16_loss:.5f}), gradients finite: {finite}",
            "<= 2e-2 rel",
        )
    for dtype, loss_tol, grad_tol in ((torch.float32, 1e-5, 1e-4), (torch.bfloat16, 1e-3, 2e-2)):
        label = "fp32" if dtype == torch.float32 else "bf16"
        with rows_or_fail(ctx, (f"numerics.fused-loss-{label}",)):
            loss_rel, grad_rel = fused_loss_errors("cuda", dtype)
            ok = loss_rel <= loss_tol and grad_rel <= grad_tol
            ctx.rows.add(
                f"numerics.fused-loss-{label}",
                status_of(ok),
                f"loss {loss_rel:.2e}, grads {grad_rel:.2e} rel",
                f"loss <= {loss_tol:g}, grads <= {grad_tol:g}",
            )
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        label = "fp32" if dtype == torch.float32 else "bf16"
        with rows_or_fail(ctx, (f"numerics.tp-rings-{label}",)):
            worst = ring_errors("cuda", dtype)
            ctx.rows.add(
                f"numerics.tp-rings-{label}",
                status_of(worst <= tol),
                f"max rel diff {worst:.2e} (2 ranks as threads)",
                f"<= {tol:g} of each tensor's max",
            )


def tiny_loss_and_grads(device: str, dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    """The "tiny" preset's fused loss on a fixed batch of 2 x 64 tokens and its parameter
    gradients (float32, on the CPU), with the parameters in ``dtype`` on ``device``."""
    config = model_preset("tiny")
    tokens = torch.randint(
        0, config.vocab_size, (2, 65), generator=torch.Generator().manual_seed(SEED)
    )
    model = build_model(config, SEED, device=device)
    if dtype != torch.float32:
        model.to(dtype)
    loss = model(tokens[:, :-1].to(device), tokens[:, 1:].to(device))
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    return float(loss.detach()), grads


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (a scale-free error of a whole tensor)."""
    scale = float(expected.abs().max())
    return float((actual.float() - expected.float()).abs().max()) / max(scale, 1e-30)


def fused_loss_errors(
    device: str, dtype: torch.dtype, tokens: int = 4096, hidden: int = 256, vocab: int = 32000
) -> tuple[float, float]:
    """(loss, worst gradient) relative errors of the fused head + loss in ``dtype`` against
    ``F.cross_entropy`` over the full float32 logits of the same (rounded) inputs; every
    17th label is ignored."""
    generator = torch.Generator().manual_seed(SEED)
    h = torch.randn(tokens, hidden, generator=generator).to(dtype)
    w = (0.02 * torch.randn(vocab, hidden, generator=generator)).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[::17] = IGNORE_INDEX
    labels = labels.to(device)

    def run(fn: Callable[..., torch.Tensor], cast: torch.dtype) -> tuple[float, list]:
        leaves = [t.to(device=device, dtype=cast, copy=True).requires_grad_() for t in (h, w)]
        loss = fn(*leaves)
        loss.backward()
        return float(loss.detach()), [t.grad.float().cpu() for t in leaves]

    fused, fused_grads = run(lambda a, b: linear_cross_entropy(a, b, labels), dtype)
    ref, ref_grads = run(
        lambda a, b: F.cross_entropy(a @ b.t(), labels, ignore_index=IGNORE_INDEX), torch.float32
    )
    grad_rel = max(max_rel_error(a, b) for a, b in zip(fused_grads, ref_grads))
    return abs(fused - ref) / abs(ref), grad_rel
