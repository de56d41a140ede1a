"""The overlapped TP rings (tensor_parallel.comm_overlap) under autocast: they multiply into
preallocated blocks, which autocast does not cover, so they cast to the autocast dtype
themselves; outputs come out in it, as F.linear's would, and backward runs in one dtype. Two
ranks as threads of this process (tools.gpu_check.tp_rings.ThreadRing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_het.tensor_parallel.comm_overlap import all_gather_linear, linear_reduce_scatter
from tools.gpu_check.tp_rings import ThreadRing


def test_rings_under_autocast_give_the_autocast_dtype_and_fp32_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 16, generator=g)
    gate = torch.randn(2, 12, 16, generator=g)
    down = torch.randn(2, 16, 12, generator=g)
    act = torch.randn(2, 1, 8, 12, generator=g)

    def work(member):
        r = member.rank
        xs = x[:, r * 4 : (r + 1) * 4].clone().requires_grad_()
        w = gate[r].clone().requires_grad_()
        a, wd = act[r].clone().requires_grad_(), down[r].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (out,) = all_gather_linear(xs, [w], member)
            y = linear_reduce_scatter(a, wd, member)
        (out.float().sum() + y.float().sum()).backward()
        return out, y, w.grad, wd.grad

    results = ThreadRing(2).run(work)
    expected_y = sum(F.linear(act[r], down[r]) for r in range(2))
    for r, (out, y, w_grad, wd_grad) in enumerate(results):
        assert out.dtype == y.dtype == torch.bfloat16
        assert w_grad.dtype == wd_grad.dtype == torch.float32
        torch.testing.assert_close(out.float(), F.linear(x, gate[r]), atol=0.1, rtol=2e-2)
        torch.testing.assert_close(
            y.float(), expected_y[:, r * 4 : (r + 1) * 4], atol=0.2, rtol=2e-2
        )
        torch.testing.assert_close(
            w_grad, x.reshape(8, 16).sum(0).expand(12, 16), atol=0.1, rtol=2e-2
        )


def test_bf16_weight_gradients_are_summed_in_float32_into_main_grad() -> None:
    """bf16 parameters (Megatron's mixed precision): the per-block weight-gradient products are
    summed in float32 and go straight into ``main_grad``, never rounded to bf16 per block."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 16, generator=g).bfloat16()
    gate = torch.randn(2, 12, 16, generator=g).bfloat16()
    act = torch.randn(2, 2, 8, 12, generator=g).bfloat16()
    down = torch.randn(2, 16, 12, generator=g).bfloat16()
    dout = torch.randn(2, 2, 8, 12, generator=g).bfloat16()

    def work(member):
        r = member.rank
        xs = x[:, r * 4 : (r + 1) * 4].clone()
        w, wd = gate[r].clone().requires_grad_(), down[r].clone().requires_grad_()
        added = []
        for param in (w, wd):
            param.main_grad = torch.zeros(param.shape)
            param.on_main_grad_added = lambda param=param: added.append(param)
        (out,) = all_gather_linear(xs, [w], member)
        y = linear_reduce_scatter(act[r].clone(), wd, member)
        ((out.float() * dout[r].float()).sum() + y.float().sum()).backward()
        return w, wd, len(added)

    results = ThreadRing(2).run(work)
    for r, (w, wd, added) in enumerate(results):
        assert w.grad is None and wd.grad is None and added == 2
        want_w = dout[r].float().reshape(16, 12).t() @ x.float().reshape(16, 16)
        torch.testing.assert_close(w.main_grad, want_w, rtol=1e-5, atol=1e-5)
        # y's gradient is ones on every rank's block: gathered, ones over the whole sequence
        want_wd = torch.ones(16, 16) @ act[r].float().reshape(16, 12)
        torch.testing.assert_close(wd.main_grad, want_wd, rtol=1e-5, atol=1e-5)
