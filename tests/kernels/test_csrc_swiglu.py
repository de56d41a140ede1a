"""The raw SwiGLU ops of csrc/ (torch.ops.megatron_het.swiglu_fwd / swiglu_bwd) against float64
formulas written here from the op contract, and the autograd function over them against torch
autograd of ``silu(gate) * up``; on the CPU always and on a CUDA/ROCm device where one is
visible and the ops have kernels for it.

Accuracy as in test_csrc_ops.py: float32 within 1e-6 relative, bfloat16/float16 within one
unit in the last place (each output is rounded once), plus a floor where float32 arithmetic
cancels (said at each use).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_het.kernels.csrc_ops import CsrcSwiGLU
from tests.kernels.test_csrc_ops import (
    BF16,
    DTYPE_IDS,
    DTYPES,
    FP32,
    FP64,
    assert_matches,
    devices,
    kernel_ops,
    randn,
)

FWD, BWD = "swiglu_fwd", "swiglu_bwd"
# odd widths (no multiple of any vector width), and one past two of the CPU's column blocks
COLS = [1, 3, 17, 33, 1031, 4099]
# float32's subnormal spacing: exp(-|g|) for |g| > 87 is held only to that absolute step
SUBNORMAL = 2.0**-149


def silu_truth(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(g), its slope) in float64 with the limits at +-inf."""
    g64 = g.double()
    s = torch.sigmoid(g64)
    value = torch.where(g64 == -math.inf, 0.0, g64 * s)
    slope = s * (1 + g64 * (1 - s))
    slope = torch.where(g64 == math.inf, 1.0, torch.where(g64 == -math.inf, 0.0, slope))
    return value, slope


def operands(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """grad, gate, up [rows, cols]; gate at scale 4 so that silu's tails and its slope's zero
    (g near -1.28) are both crossed."""
    return [
        randn(rows, cols, dtype=dtype, seed=seed),
        randn(rows, cols, dtype=dtype, scale=4.0, seed=seed + 1),
        randn(rows, cols, dtype=dtype, seed=seed + 2),
    ]


def bwd_truth(grad, gate, up):
    """(grad_gate, its floor, grad_up, its floor) in float64."""
    value, slope = silu_truth(gate)
    g64, u64, d64 = gate.double(), up.double(), grad.double()
    s = torch.sigmoid(g64)
    # float32 cancels in 1 + g (1 - s) near the slope's zero: the floor scales with its terms
    terms = (d64 * u64 * s).abs() * (1 + g64.abs() * (1 - s))
    floor = 1e-6 * terms + 4 * SUBNORMAL * (d64 * u64 * g64).abs()
    return d64 * u64 * slope, floor, d64 * value, 4 * SUBNORMAL * (d64 * g64).abs()


@pytest.mark.parametrize("device", devices(FWD))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cols", COLS)
def test_swiglu_fwd(device, dtype, cols):
    ops = kernel_ops()
    _, gate, up = operands(5, cols, dtype)
    out = ops.swiglu_fwd(gate.to(device), up.to(device))
    assert out.dtype == dtype and out.is_contiguous()
    value, _ = silu_truth(gate)
    assert_matches(out, value * up.double(), floor=4 * SUBNORMAL * (gate.double() * up).abs())


@pytest.mark.parametrize("device", devices(BWD))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cols", COLS)
def test_swiglu_bwd(device, dtype, cols):
    ops = kernel_ops()
    grad, gate, up = operands(4, cols, dtype, seed=3)
    grad_gate, grad_up = ops.swiglu_bwd(grad.to(device), gate.to(device), up.to(device))
    assert grad_gate.dtype == grad_up.dtype == dtype
    gate_truth, gate_floor, up_truth, up_floor = bwd_truth(grad, gate, up)
    assert_matches(grad_gate, gate_truth, gate_floor)
    assert_matches(grad_up, up_truth, up_floor)


def fused_halves(shape: tuple[int, ...], dtype, device, seed=0):
    """gate and up [..., F] as the two halves of one [..., 2F] tensor made on `device`."""
    fused = randn(*shape[:-1], 2 * shape[-1], dtype=dtype, scale=3.0, seed=seed).to(device)
    return fused.chunk(2, dim=-1)


@pytest.mark.parametrize("device", devices(FWD, BWD))
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(6, 40), (2, 3, 17), (1, 1, 33)])
def test_swiglu_reads_strided_rows_like_contiguous_ones(device, dtype, shape):
    ops = kernel_ops()
    gate, up = fused_halves(shape, dtype, device)
    grad, _ = fused_halves(shape, dtype, device, seed=5)
    if math.prod(shape[:-1]) > 1:
        assert not gate.is_contiguous() and not up.is_contiguous()
    plain = [t.contiguous() for t in (grad, gate, up)]
    out = ops.swiglu_fwd(gate, up)
    assert out.shape == shape and out.is_contiguous()
    assert torch.equal(out, ops.swiglu_fwd(*plain[1:]))
    for got, want in zip(ops.swiglu_bwd(grad, gate, up), ops.swiglu_bwd(*plain)):
        assert got.shape == shape and got.is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize("device", devices(FWD, BWD))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_swiglu_large_gates_and_special_values(device, dtype):
    ops = kernel_ops()
    big = [-1e4, -200.0, -104.0, -100.0, -88.0, -20.0, 20.0, 88.0, 100.0, 200.0]
    values = [v for v in big if abs(v) <= torch.finfo(dtype).max]
    gate = torch.tensor([*values, -0.0, 0.0, -math.inf, math.inf, math.nan], dtype=dtype)
    up = torch.full_like(gate, 1.5)
    grad = torch.full_like(gate, -2.0)
    out = ops.swiglu_fwd(gate.to(device), up.to(device)).cpu()
    grad_gate, grad_up = (
        t.cpu() for t in ops.swiglu_bwd(*(t.to(device) for t in (grad, gate, up)))
    )
    finite = gate.isfinite()
    value, _ = silu_truth(gate)
    floor = 4 * SUBNORMAL * gate.double().abs().nan_to_num(posinf=0.0, neginf=0.0)
    assert_matches(out[finite], (value * 1.5)[finite], 1.5 * floor[finite])
    gate_truth, gate_floor, up_truth, up_floor = bwd_truth(grad, gate, up)
    assert_matches(grad_gate[finite], gate_truth[finite], gate_floor[finite])
    assert_matches(grad_up[finite], up_truth[finite], up_floor[finite])
    # the limits at -inf and +inf, and NaN through every output
    assert out[-3:-1].tolist() == [0.0, math.inf] and out[-1].isnan()
    assert grad_gate[-3:-1].tolist() == [0.0, -3.0] and grad_gate[-1].isnan()
    assert grad_up[-3:-1].tolist() == [0.0, -math.inf] and grad_up[-1].isnan()


@pytest.mark.parametrize("device", devices(FWD, BWD))
@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (2, 0, 5)])
def test_swiglu_empty(device, shape):
    ops = kernel_ops()
    x = torch.empty(shape, dtype=BF16, device=device)
    assert ops.swiglu_fwd(x, x).shape == shape
    assert [t.shape for t in ops.swiglu_bwd(x, x, x)] == [shape, shape]


def test_swiglu_checks_say_what_is_wrong():
    ops = kernel_ops()
    x = torch.ones(2, 4)
    cases = [
        (lambda: ops.swiglu_fwd(x.long(), x.long()), "swiglu_fwd: gate must be float32, bfloat16"),
        (lambda: ops.swiglu_fwd(x, x.to(BF16)), "swiglu_fwd: up must be Float, got BFloat16"),
        (lambda: ops.swiglu_fwd(x, torch.ones(2, 5)), "swiglu_fwd: up must have gate's shape"),
        (lambda: ops.swiglu_bwd(torch.ones(4), x, x), "swiglu_bwd: grad must have gate's shape"),
        (lambda: ops.swiglu_fwd(x.t(), x.t()), "swiglu_fwd: gate must have stride 1 in its last"),
        (
            lambda: ops.swiglu_fwd(torch.ones(4, 6, 5)[:, :3], torch.ones(4, 3, 5)),
            "swiglu_fwd: gate must be rows [N, F] with one stride between rows",
        ),
        (lambda: ops.swiglu_fwd(x[0, 0], x[0, 0]), "swiglu_fwd: gate must have a last dimension"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
            call()


@pytest.mark.parametrize("device", [d for d in devices(FWD, BWD) if d != "cpu"])
def test_swiglu_operands_on_two_devices_are_refused(device):
    ops = kernel_ops()
    gate = torch.ones(2, 4, device=device)
    with pytest.raises(RuntimeError, match="swiglu_fwd: up must be on cuda"):
        ops.swiglu_fwd(gate, torch.ones(2, 4))


# ---- the autograd function ----


@pytest.mark.parametrize("device", devices(FWD, BWD))
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=DTYPE_IDS)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-halves"])
def test_autograd_function_matches_torch_autograd_in_fp32(device, dtype, fused):
    torch.manual_seed(0)
    source = (torch.randn(3, 5, 2 * 37) * 3).to(dtype)
    grad = torch.randn(3, 5, 37)
    results = []
    for run in ("kernel", "reference"):
        leaf = source.clone().to(device).requires_grad_()
        inputs = leaf if run == "kernel" else leaf.float()
        if fused:
            gate, up = inputs.chunk(2, dim=-1)
        else:
            gate, up = (t.contiguous() for t in inputs.chunk(2, dim=-1))
        out = CsrcSwiGLU.apply(gate, up) if run == "kernel" else F.silu(gate) * up
        out.backward(grad.to(device, out.dtype))
        results.append((out, leaf.grad))
    (out, grad_in), (want_out, want_grad) = results
    assert out.dtype == grad_in.dtype == dtype
    tol = {"rtol": 2e-6, "atol": 2e-6} if dtype == FP32 else {"rtol": 1.6e-2, "atol": 1.6e-2}
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
    torch.testing.assert_close(grad_in.float(), want_grad.float(), **tol)


def test_autograd_function_saves_only_gate_and_up():
    gate, up = (randn(4, 9, seed=s).requires_grad_() for s in (1, 2))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = CsrcSwiGLU.apply(gate, up)
    assert len(saved) == 2 and saved[0] is gate and saved[1] is up
    out.sum().backward()
    assert gate.grad.shape == up.grad.shape == (4, 9)
    assert torch.allclose(up.grad.double(), silu_truth(gate.detach())[0], rtol=1e-6, atol=0)


def test_float64_truth_is_what_torch_computes():
    g = torch.linspace(-30, 30, 601, dtype=FP64)
    value, slope = silu_truth(g)
    torch.testing.assert_close(value, F.silu(g))
    leaf = g.clone().requires_grad_()
    F.silu(leaf).sum().backward()
    torch.testing.assert_close(slope, leaf.grad)
