"""Fused ops on a CUDA/ROCm device against the pure-torch reference (skipped without a GPU)."""
import pytest
import torch

from megatron_het.kernels import rms_norm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_device(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 128, 512, device="cuda", dtype=dtype)
    w = torch.randn(512, device="cuda", dtype=dtype)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
           * w.float()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(rms_norm(x, w, 1e-5), ref, atol=tol, rtol=tol)
