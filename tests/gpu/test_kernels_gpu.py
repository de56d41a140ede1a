"""Fused ops on a CUDA/ROCm device against the pure-torch references (skipped without a GPU).

Nothing here touches CUDA at import time: tensors are made inside the tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from megatron_het.kernels import (
    LIGER,
    apex_rms_norm_available,
    causal_attention,
    reference_attention,
    rms_norm,
    swiglu,
)
from megatron_het.kernels.attention import device_runs_flash, kernel_for
from megatron_het.kernels.extension import KernelExtension
from megatron_het.kernels.gemm import mm_fp32_out
from megatron_het.kernels.main_grad import MAIN_GRAD, ON_MAIN_GRAD_ADDED
from megatron_het.model.loss import linear_cross_entropy
from megatron_het.tensor_parallel.cross_entropy import vocab_parallel_linear_cross_entropy

pytestmark = pytest.mark.gpu
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def reference_rms_norm(x, w, eps=1e-5):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_rms_norm_on_device(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 128, 512, device="cuda", dtype=dtype)
    w = torch.randn(512, device="cuda", dtype=dtype)
    tol = 1e-5 if dtype == FP32 else 2e-2
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, reference_rms_norm(x, w), atol=tol, rtol=tol)
    with torch.autocast("cuda", dtype=BF16):  # the output keeps the input's dtype
        assert rms_norm(x, w, 1e-5).dtype == dtype


def test_fused_norm_kernels_match_torch():
    if not apex_rms_norm_available() and LIGER.rms_norm is None:
        pytest.skip("neither apex nor liger-kernel is installed")
    x = torch.randn(8, 256, 1024, device="cuda", dtype=BF16)
    w = torch.randn(1024, device="cuda", dtype=BF16)
    torch.testing.assert_close(
        rms_norm(x, w, 1e-5), F.rms_norm(x, (1024,), w, 1e-5), atol=2e-2, rtol=2e-2
    )


def test_liger_swiglu_matches_torch():
    if LIGER.swiglu is None:
        pytest.skip("liger-kernel is not installed")
    gate, up = (torch.randn(4, 64, 512, device="cuda", dtype=BF16) for _ in range(2))
    unbuilt = KernelExtension(False, "liger's path: ours would come first where built")
    got = swiglu(gate, up, extension=unbuilt)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize("groups", [2, 8])
def test_attention_on_device_matches_reference(dtype, groups):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 256, 8, 64, device="cuda", dtype=dtype, generator=g).requires_grad_()
    kv = torch.randn(
        2, 256, groups, 2, 64, device="cuda", dtype=dtype, generator=g
    ).requires_grad_()
    kernel = kernel_for(q, kv[:, :, :, 0])
    if dtype != FP32 and device_runs_flash(q.device):
        assert kernel.name == "flash_attn" or kernel.backends == (SDPBackend.FLASH_ATTENTION,)
    if dtype == FP32:
        assert kernel.backends == (SDPBackend.EFFICIENT_ATTENTION,)
    results = []
    for fn in (causal_attention, reference_attention):
        q.grad = kv.grad = None
        out = fn(q, *kv.unbind(3))
        out.float().pow(2).mean().backward()
        results.append((out.detach(), q.grad, kv.grad))
    tol = 2e-4 if dtype == FP32 else 3e-2
    for ours, expected in zip(*results):
        torch.testing.assert_close(ours.float(), expected.float(), atol=tol, rtol=tol)


def test_fp32_gqa_attention_does_not_build_the_score_matrix():
    S, N = 4096, 16
    q = torch.randn(1, S, N, 64, device="cuda")
    kv = torch.randn(1, S, 4, 2, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    causal_attention(q, *kv.unbind(3))
    torch.cuda.synchronize()
    score_bytes = N * S * S * 4
    assert torch.cuda.max_memory_allocated() - base < score_bytes / 8


def test_mm_fp32_out_on_device():
    a = torch.randn(256, 512, device="cuda", dtype=BF16)
    b = torch.randn(512, 128, device="cuda", dtype=BF16)
    out = mm_fp32_out(a, b)
    assert out.dtype == FP32
    exact = a.double() @ b.double()
    assert (out.double() - exact).abs().max() < 1e-3  # bf16 rounding would be ~0.1 off


class OneRankGroup:
    size, rank = 1, 0

    def all_reduce(self, tensor, op="sum", async_op=False):
        return None


def head_inputs(dtype, V=4096, H=256, N=1024):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, H, device="cuda", generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=g) * 0.05).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    labels[:7] = -100
    return hidden, weight, labels


def reference_head(hidden, weight, labels):
    h, w = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    loss = F.cross_entropy(h @ w.t(), labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("tp", [False, True])
def test_fused_head_fp32_and_chunk_independence(tp):
    hidden, weight, labels = head_inputs(FP32)
    expected = reference_head(hidden, weight, labels)
    for chunk in (None, 100):
        hidden.grad = weight.grad = None
        if tp:
            loss = vocab_parallel_linear_cross_entropy(
                hidden, weight, labels, OneRankGroup(), 0, chunk_tokens=chunk
            )
        else:
            loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
        loss.backward()
        for got, want in zip((loss.detach(), hidden.grad, weight.grad), expected):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tp", [False, True])
def test_fused_head_main_grad_beats_a_bf16_rounded_gradient(tp):
    hidden, weight, labels = head_inputs(BF16)
    events = []
    setattr(weight, MAIN_GRAD, torch.zeros(weight.shape, device="cuda"))
    setattr(weight, ON_MAIN_GRAD_ADDED, lambda: events.append(1))
    if tp:
        loss = vocab_parallel_linear_cross_entropy(hidden, weight, labels, OneRankGroup(), 0)
    else:
        loss = linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    assert weight.grad is None and events == [1]
    _, ref_hidden, ref_weight = reference_head(hidden, weight, labels)
    error = (weight.main_grad - ref_weight).norm()
    assert error < (ref_weight.bfloat16().float() - ref_weight).norm()
    torch.testing.assert_close(hidden.grad.float(), ref_hidden, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tp", [False, True])
def test_fused_head_makes_no_host_sync(tp):
    hidden, weight, labels = head_inputs(BF16)

    def run():
        if tp:
            return vocab_parallel_linear_cross_entropy(
                hidden, weight, labels, OneRankGroup(), 0, chunk_tokens=128
            )
        return linear_cross_entropy(hidden, weight, labels, chunk_tokens=128)

    run().backward()  # warm-up: one-time device probes may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_liger_head_matches_ours():
    if LIGER.linear_cross_entropy is None:
        pytest.skip("liger-kernel is not installed")
    hidden, weight, labels = head_inputs(FP32)
    expected = reference_head(hidden, weight, labels)
    loss = linear_cross_entropy(hidden, weight, labels)  # liger: mean loss, no main_grad
    loss.backward()
    for got, want in zip((loss.detach(), hidden.grad, weight.grad), expected):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
