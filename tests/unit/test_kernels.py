"""Fused-op wrappers against their pure-torch references, and the choice of kernel."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import megatron_het.kernels.autocast as autocast_queries
from megatron_het.kernels import (
    LIGER,
    AttentionKernel,
    LigerKernels,
    apex_rms_norm_available,
    causal_attention,
    choose_attention_kernel,
    reference_attention,
    rms_norm,
    swiglu,
)
from megatron_het.kernels import attention as attention_mod
from megatron_het.kernels.apex_norm import APEX_NORM_EXTENSION, load_apex_rms_norm
from megatron_het.kernels.extension import EXTENSION, KernelExtension
from megatron_het.kernels.gemm import (
    addmm_fp32_out_,
    fp32_out_gemm_supported,
    gemm_operand_dtype,
    mm_fp32_out,
)
from megatron_het.kernels.liger import load_liger
from megatron_het.kernels.norms import fused_rms_norm_kernel

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def reference_rms_norm(x, weight, eps):
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def fake_importer(modules: dict[str, object]):
    def import_module(name: str) -> object:
        if name not in modules:
            raise ImportError(name)
        return modules[name]

    return import_module


# -- RMSNorm ------------------------------------------------------------------------------------
def test_rms_norm_matches_reference_on_cpu():
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 64), torch.randn(64)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("x_dtype,w_dtype", [(BF16, BF16), (BF16, FP32), (FP32, BF16)])
def test_rms_norm_returns_the_input_dtype(x_dtype, w_dtype):
    torch.manual_seed(0)
    x, w = torch.randn(4, 64).to(x_dtype), (torch.randn(64) + 1).to(w_dtype)
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == x_dtype
    expected = reference_rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def apex_like(calls):
    """Behaves as apex's wrapper does: casts its inputs to the autocast dtype when autocast is
    on, computes in float32, returns its (cast) input's dtype."""

    def fused_rms_norm_affine(x, weight, shape, eps):
        calls.append(tuple(shape))
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
        return reference_rms_norm(x, weight, eps).to(x.dtype)

    return fused_rms_norm_affine


def test_apex_needs_its_compiled_extension():
    wrapper = types.SimpleNamespace(fused_rms_norm_affine=apex_like([]))
    python_only = fake_importer({"apex.normalization.fused_layer_norm": wrapper})
    assert load_apex_rms_norm(python_only) is None
    assert load_apex_rms_norm(fake_importer({})) is None
    complete = fake_importer(
        {
            "apex.normalization.fused_layer_norm": wrapper,
            APEX_NORM_EXTENSION: types.SimpleNamespace(),
        }
    )
    assert load_apex_rms_norm(complete) is not None
    assert isinstance(apex_rms_norm_available(), bool)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("params", [FP32, BF16])
def test_apex_and_torch_agree_on_the_output_dtype(autocast, params):
    calls = []
    wrapper = types.SimpleNamespace(fused_rms_norm_affine=apex_like(calls))
    apex = load_apex_rms_norm(
        fake_importer(
            {
                "apex.normalization.fused_layer_norm": wrapper,
                APEX_NORM_EXTENSION: types.SimpleNamespace(),
            }
        )
    )
    x, w = torch.randn(4, 32).to(params), torch.ones(32, dtype=params)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        with_apex, with_torch = rms_norm(x, w, 1e-5, fused=apex), rms_norm(x, w, 1e-5)
    assert calls == [(32,)]
    assert with_apex.dtype == with_torch.dtype == params
    torch.testing.assert_close(with_apex, with_torch, atol=1e-2, rtol=1e-2)


def test_fused_norm_is_chosen_only_on_device_tensors_of_one_dtype():
    def apex(x, w, eps):
        return x

    calls = []

    def liger_norm(x, w, eps):
        calls.append(x.shape)
        return x

    liger = LigerKernels(rms_norm=liger_norm)
    assert fused_rms_norm_kernel("cpu", FP32, FP32, apex, liger) is None
    assert fused_rms_norm_kernel("cuda", BF16, BF16, apex, liger) is apex
    assert fused_rms_norm_kernel("cuda", BF16, BF16, None, liger) is liger_norm
    assert fused_rms_norm_kernel("cuda", BF16, FP32, apex, liger) is None
    assert fused_rms_norm_kernel("cuda", BF16, BF16, None, LigerKernels()) is None
    on_cpu = LigerKernels(rms_norm=liger_norm, device_types=frozenset({"cpu"}))
    kernel = fused_rms_norm_kernel("cpu", FP32, FP32, None, on_cpu)
    assert kernel is liger_norm
    x = torch.randn(2, 8)
    assert torch.equal(rms_norm(x, torch.ones(8), 1e-6, fused=kernel), x) and calls == [(2, 8)]
    rms_norm(x, torch.ones(8, dtype=BF16), 1e-6, fused=kernel)  # mixed dtypes: torch's path
    assert calls == [(2, 8)]


# -- liger-kernel and SwiGLU ----------------------------------------------------------------------
def test_liger_loader_wraps_each_kernel_and_tolerates_absence():
    seen = []

    class Fn:
        def __init__(self, name, result):
            self.name, self.result = name, result

        def apply(self, *args):
            seen.append((self.name, len(args)))
            return self.result

    loss = torch.tensor(1.5)
    modules = {
        "liger_kernel.ops.rms_norm": types.SimpleNamespace(
            LigerRMSNormFunction=Fn("norm", torch.zeros(2))
        ),
        "liger_kernel.ops.swiglu": types.SimpleNamespace(
            LigerSiLUMulFunction=Fn("swiglu", torch.ones(2))
        ),
        "liger_kernel.ops.fused_linear_cross_entropy": types.SimpleNamespace(
            LigerFusedLinearCrossEntropyFunction=Fn("flce", (loss, None))
        ),
    }
    kernels = load_liger(fake_importer(modules))
    x = torch.zeros(2)
    kernels.rms_norm(x, x, 1e-5)
    kernels.swiglu(x, x)
    assert kernels.linear_cross_entropy(x, x, x) is loss  # the loss out of liger's tuple
    assert seen == [("norm", 3), ("swiglu", 2), ("flce", 3)]
    assert load_liger(fake_importer({})) == LigerKernels()


def test_installed_liger_matches_the_environment():
    if importlib.util.find_spec("liger_kernel") is None:
        assert LIGER == LigerKernels()


def test_swiglu_dispatch():
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    torch.testing.assert_close(swiglu(gate, up), F.silu(gate) * up)
    calls = []

    def fake(a, b):
        calls.append(a.shape)
        return a * 0

    unbuilt = KernelExtension(False, "megatron_het._C is not built")
    liger_on_cuda = LigerKernels(swiglu=fake)
    assert torch.equal(swiglu(gate, up, liger_on_cuda, extension=unbuilt), F.silu(gate) * up)
    assert calls == []  # liger's kernels run on CUDA tensors only
    present = LigerKernels(swiglu=fake, device_types=frozenset({"cpu"}))
    assert torch.equal(swiglu(gate, up, present, extension=unbuilt), gate * 0)
    assert calls == [(3, 8)]
    if EXTENSION.supports("swiglu", "cpu"):  # our compiled kernel comes before liger's
        torch.testing.assert_close(swiglu(gate, up, present), F.silu(gate) * up)
        assert calls == [(3, 8)]


# -- float32-output GEMMs -------------------------------------------------------------------------
def test_fp32_out_gemms_on_cpu_upcast_and_accumulate_in_float32():
    assert not fp32_out_gemm_supported(torch.device("cpu"))
    assert gemm_operand_dtype(BF16, torch.device("cpu")) == FP32
    assert gemm_operand_dtype(FP64, torch.device("cpu")) == FP64
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=g).to(BF16), torch.randn(32, 8, generator=g).to(BF16)
    exact = a.double() @ b.double()
    product = mm_fp32_out(a, b)
    assert product.dtype == FP32
    assert (product.double() - exact).abs().max() < 1e-4  # a bf16 result would be ~1e-2 off
    acc = torch.ones(16, 8)
    addmm_fp32_out_(acc, a, b)
    assert (acc.double() - exact - 1).abs().max() < 1e-4


def test_where_only_the_product_has_a_float32_output_sums_add_it(monkeypatch):
    """A torch whose mm takes out_dtype but whose addmm refuses a float32 sum with bf16
    operands (before late 2025): the sum adds a float32 product, never a bf16 one."""
    from megatron_het.kernels import gemm

    calls = []
    real_mm = torch.mm

    def mm(a, b, out_dtype=None):  # stands in for a device's aten::mm.dtype kernel
        calls.append(out_dtype)
        return real_mm(a.float(), b.float()) if out_dtype is not None else real_mm(a, b)

    monkeypatch.setattr(gemm, "_probe", lambda device: (True, False))
    monkeypatch.setattr(torch, "mm", mm)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=g).to(BF16), torch.randn(32, 8, generator=g).to(BF16)
    acc = torch.ones(16, 8)
    gemm.addmm_fp32_out_(acc, a, b)
    assert calls == [FP32]
    assert (acc.double() - a.double() @ b.double() - 1).abs().max() < 1e-4
    assert gemm.gemm_operand_dtype(BF16, torch.device("cpu")) == BF16


# -- attention ----------------------------------------------------------------------------------
FLASH = AttentionKernel("flash_attn")
SDPA_FLASH = AttentionKernel("sdpa", (SDPBackend.FLASH_ATTENTION,))
MATH = AttentionKernel("sdpa", (SDPBackend.MATH,))
DEFAULT = AttentionKernel("sdpa")


def efficient(expand):
    return AttentionKernel("sdpa", (SDPBackend.EFFICIENT_ATTENTION,), expand_kv=expand)


# (device type, dtype, gqa, head dim, flash-attn installed, device runs flash) -> kernel
CHOICES = [
    (("cpu", FP32, True, 64, False, True), SDPA_FLASH),
    (("cpu", BF16, False, 64, True, True), SDPA_FLASH),
    (("cpu", FP16, True, 80, False, True), SDPA_FLASH),
    (("cpu", FP64, True, 12, False, True), SDPA_FLASH),
    (("cuda", BF16, True, 128, True, True), FLASH),
    (("cuda", FP16, False, 64, True, True), FLASH),
    (("cuda", BF16, True, 128, False, True), SDPA_FLASH),
    (("cuda", FP16, True, 64, False, True), SDPA_FLASH),
    (("cuda", BF16, True, 512, True, True), efficient(True)),
    (("cuda", FP16, False, 64, True, False), efficient(False)),
    (("cuda", FP16, True, 64, False, False), efficient(True)),
    (("cuda", BF16, True, 64, True, False), MATH),
    (("cuda", FP16, True, 300, False, True), MATH),
    (("cuda", FP32, True, 128, True, True), efficient(True)),
    (("cuda", FP32, False, 64, False, False), efficient(False)),
    (("cuda", FP32, True, 12, False, True), MATH),
    (("cuda", FP64, True, 64, True, True), MATH),
    (("mps", FP32, True, 64, False, True), DEFAULT),
    (("xpu", BF16, False, 64, True, True), DEFAULT),
]


@pytest.mark.parametrize("case,expected", CHOICES)
def test_attention_kernel_choice(case, expected):
    assert choose_attention_kernel(*case) == expected


def qkv(dtype, heads=6, groups=2, seed=0, S=24, D=16):
    """Leaf ``q[2, S, heads, D]`` and ``kv[2, S, groups, 2, D]``; k and v are strided views of
    kv (last dimension contiguous), as the model's are of its qkv projection."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, S, heads, D, generator=g).to(dtype).requires_grad_()
    kv = torch.randn(2, S, groups, 2, D, generator=g).to(dtype).requires_grad_()
    return q, kv


@pytest.mark.parametrize("dtype,groups", [(FP32, 2), (FP32, 6), (BF16, 3), (FP64, 1)])
def test_cpu_attention_matches_reference_forward_and_backward(dtype, groups):
    tol = {FP32: 1e-5, FP64: 1e-10, BF16: 2e-2}[dtype]
    results = []
    for fn in (causal_attention, reference_attention):
        q, kv = qkv(dtype, groups=groups)
        out = fn(q, *kv.unbind(3))
        assert out.shape == q.shape and out.dtype == dtype
        out.float().pow(2).sum().backward()
        results.append((out.detach(), q.grad, kv.grad))
    for ours, expected in zip(*results):
        torch.testing.assert_close(ours, expected, atol=tol, rtol=tol)


def _graph_has_flash(fn) -> bool:
    """Whether a flash-attention node is in the autograd graph below ``fn``."""
    stack, seen = [fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "Flash" in node.name():
            return True
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return False


def test_cpu_path_uses_the_flash_kernel_not_math():
    q, kv = qkv(FP32, groups=2)
    k, v = kv.unbind(3)
    assert attention_mod.kernel_for(q, k) == SDPA_FLASH
    assert _graph_has_flash(causal_attention(q, k, v).grad_fn)
    assert not _graph_has_flash(causal_attention(q, k, v, kernel=MATH).grad_fn)


@pytest.mark.parametrize(
    "kernel", [MATH, DEFAULT, AttentionKernel("sdpa", (SDPBackend.MATH,), expand_kv=True)]
)
def test_every_sdpa_variant_gives_the_same_attention(kernel):
    q, kv = qkv(FP32, groups=2)
    k, v = kv.unbind(3)
    torch.testing.assert_close(
        causal_attention(q, k, v, kernel=kernel), reference_attention(q, k, v), atol=1e-5, rtol=1e-5
    )


def test_flash_attn_path_passes_native_gqa_layout():
    calls = []

    def fake_flash_attn_func(q, k, v, causal):
        calls.append((q.shape, k.shape, v.shape, causal))
        return reference_attention(q, k, v)

    q, kv = qkv(BF16, heads=6, groups=2)
    k, v = kv.unbind(3)
    out = causal_attention(q, k, v, kernel=FLASH, flash_attn_func=fake_flash_attn_func)
    assert calls == [((2, 24, 6, 16), (2, 24, 2, 16), (2, 24, 2, 16), True)]
    assert torch.equal(out, reference_attention(q, k, v))


def test_device_runs_flash_off_cuda():
    assert attention_mod.device_runs_flash(torch.device("cpu"))
    assert not attention_mod.device_runs_flash(torch.device("meta"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_autograd_matches_torch_and_saves_only_x_and_rstd(dtype):
    from megatron_het.kernels.norms import _RMSNorm

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 48, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype).requires_grad_()
    grad = torch.randn(3, 7, 48, generator=g).to(dtype)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = _RMSNorm.apply(x, w, 1e-5)
    ref = F.rms_norm(x_ref, (48,), w_ref, 1e-5)  # torch's composite op, the reference
    out.backward(grad)
    ref.backward(grad)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    torch.testing.assert_close(
        w.grad.float(),
        w_ref.grad.float(),
        rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
        atol=5e-2 if dtype == torch.bfloat16 else 1e-5,
    )
    assert [(tuple(t.shape), t.dtype) for t in saved] == [
        ((3, 7, 48), dtype),
        ((48,), dtype),
        ((3, 7, 1), torch.float32),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_autograd_matches_torch_and_saves_only_its_inputs(dtype):
    g = torch.Generator().manual_seed(6)
    gate = torch.randn(4, 33, generator=g).to(dtype).requires_grad_()
    up = torch.randn(4, 33, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(4, 33, generator=g).to(dtype)
    gate_ref, up_ref = (t.detach().float().requires_grad_() for t in (gate, up))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = swiglu(gate, up)
    ref = F.silu(gate_ref) * up_ref  # float32 reference
    out.backward(grad)
    ref.backward(grad.float())
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(out.float(), ref, **tol)
    torch.testing.assert_close(gate.grad.float(), gate_ref.grad, **tol)
    torch.testing.assert_close(up.grad.float(), up_ref.grad, **tol)
    assert len(saved) == 2 and saved[0] is gate and saved[1] is up


def test_autocast_is_asked_of_the_build_once_per_device_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list = []
    monkeypatch.setattr(autocast_queries, "_AVAILABLE", {"cpu": True})
    monkeypatch.setattr(
        torch.amp, "is_autocast_available", lambda device_type: calls.append(device_type) or False
    )
    assert autocast_queries.autocast_dtype("meta") is None
    assert autocast_queries.autocast_dtype("meta") is None
    assert calls == ["meta"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_queries.autocast_dtype("cpu") is torch.bfloat16  # the kept answer
    assert calls == ["meta"]


def test_compiled_code_reads_the_kept_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Some torch releases' dynamo cannot trace the build's answer (a C function), so compiled
    code must not ask it; here asking fails the test."""

    def forbidden(device_type: str) -> bool:
        raise AssertionError("asked the build inside compiled code")

    @torch.compile(fullgraph=True, backend="eager")
    def scaled(x: torch.Tensor) -> torch.Tensor:
        with autocast_queries.autocast_off(x.device.type):
            return x * 2 if autocast_queries.autocast_dtype(x.device.type) is None else x

    monkeypatch.setattr(torch.amp, "is_autocast_available", forbidden)
    assert torch.equal(scaled(torch.ones(3)), torch.full((3,), 2.0))
    torch._dynamo.reset()
