"""Fused-op wrappers against their pure-torch references."""
import torch

from megatron_het.kernels import apex_rms_norm_available, rms_norm


def reference_rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_rms_norm_matches_reference_on_cpu():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64)
    w = torch.randn(64)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))


def test_fused_kernel_is_only_used_on_device_tensors():
    calls = []

    def fake_kernel(x, weight, shape, eps):
        calls.append(shape)
        return x

    x = torch.randn(2, 8)
    rms_norm(x, torch.ones(8), 1e-6, fused=fake_kernel)
    assert calls == []  # CPU tensors take torch's op
    assert isinstance(apex_rms_norm_available(), bool)
