"""The raw fused ops of csrc/ (torch.ops.megatron_het.*) against float64 formulas written here
from the op contract, on every device where an op is registered: the CPU always (the build
always makes it), a CUDA/ROCm device where one is visible and the op has a kernel for it.

Accuracy: float32 outputs within 1e-6 relative of the float64 truth, bfloat16/float16 outputs
within one unit in the last place of their dtype (the op rounds once), each plus an absolute
floor where float32 arithmetic cancels (said at each use).
"""

from __future__ import annotations

import math

import pytest
import torch

BUILD = "MEGATRON_HET_KERNELS_BUILD=cpu .venv/bin/python setup.py -q build_ext --inplace"
try:
    import megatron_het._C  # noqa: F401  (registers torch.ops.megatron_het.*)

    IMPORT_ERROR = None
except ImportError as exc:  # reported by kernel_ops(): every test fails, none is skipped
    IMPORT_ERROR = exc

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
DTYPES = [FP32, BF16, FP16]
DTYPE_IDS = {FP32: "fp32", BF16: "bf16", FP16: "fp16"}.get
MANTISSA_BITS = {BF16: 7, FP16: 10}
MIN_NORMAL_EXPONENT = {BF16: -126, FP16: -14}


def devices(*names: str) -> list:
    """The devices to test ops `names` on: the CPU, and "cuda" (marked gpu) where a device is
    visible and each op has a CUDA kernel (torch.cuda.is_available() asks NVML here, see
    tests/conftest.py, so collection does not initialise CUDA)."""
    found: list = ["cpu"]
    if IMPORT_ERROR is None and torch.cuda.is_available():
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        if all(has(f"megatron_het::{name}", "CUDA") for name in names):
            found.append(pytest.param("cuda", marks=pytest.mark.gpu))
    return found


def kernel_ops():
    """torch.ops.megatron_het, failing the calling test (not skipping it) when the extension
    does not import: the CPU build is always expected."""
    if IMPORT_ERROR is not None:
        pytest.fail(
            f"megatron_het._C does not import ({IMPORT_ERROR}); build the kernels in place "
            f"with: {BUILD}",
            pytrace=False,
        )
    return torch.ops.megatron_het


def ulp(truth: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at each float64 value (subnormals included)."""
    _, exponent = torch.frexp(truth)  # |truth| = m * 2**exponent, m in [0.5, 1)
    floor_log2 = torch.where(truth == 0, MIN_NORMAL_EXPONENT[dtype], exponent - 1)
    floor_log2 = floor_log2.clamp(min=MIN_NORMAL_EXPONENT[dtype])
    return torch.ldexp(torch.ones_like(truth), floor_log2 - MANTISSA_BITS[dtype])


def assert_matches(out: torch.Tensor, truth: torch.Tensor, floor=0.0) -> None:
    """out against the float64 truth: 1e-6 relative for float32, one ulp for bfloat16 and
    float16, plus `floor` (a number or a tensor broadcast to truth)."""
    assert out.shape == truth.shape, (out.shape, truth.shape)
    got = out.detach().cpu().double()
    if out.dtype == FP32:
        tol = 1e-6 * truth.abs() + floor
    else:
        tol = ulp(truth, out.dtype) + floor
    bad = ((got - truth).abs() > tol) | (got.isnan() != truth.isnan())
    if bad.any():
        index = tuple(bad.nonzero()[0].tolist())
        pytest.fail(
            f"{int(bad.sum())} of {bad.numel()} {out.dtype} elements off; first at {index}: "
            f"got {got[index].item()!r}, float64 truth {truth[index].item()!r}, "
            f"tolerance {tol.expand_as(truth)[index].item()!r}"
        )


def randn(*shape: int, dtype=FP32, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator, dtype=FP64) * scale).to(dtype)


# ---- rms_norm ----


def rms_norm_truth(s: torch.Tensor, weight: torch.Tensor, eps: float):
    s64 = s.double()
    rstd = 1.0 / torch.sqrt(s64.pow(2).mean(-1) + eps)
    return s64 * rstd[:, None] * weight.double(), rstd


@pytest.mark.parametrize("device", devices("rms_norm_fwd"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [1, 3, 7, 17, 33, 1031])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_fwd(device, dtype, hidden, residual):
    ops = kernel_ops()
    x, w = randn(5, hidden, dtype=dtype, seed=1), randn(hidden, dtype=dtype, seed=2)
    r = randn(5, hidden, dtype=dtype, seed=3) if residual else None
    weights = [w] if dtype == FP32 else [w, w.float()]  # float32 weights with half-width x
    for weight in weights:
        out, sum_, rstd = ops.rms_norm_fwd(
            x.to(device), None if r is None else r.to(device), weight.to(device), 1e-5
        )
        s = x if r is None else (x.double() + r.double()).to(dtype)  # the rounded sum
        if r is None:
            assert sum_.shape == (0,) and sum_.dtype == dtype
        else:
            assert sum_.dtype == dtype and torch.equal(sum_.cpu(), s)
        out_truth, rstd_truth = rms_norm_truth(s, weight, 1e-5)
        assert out.dtype == dtype and rstd.dtype == FP32
        assert_matches(out, out_truth)
        assert_matches(rstd, rstd_truth)


def rms_norm_bwd_truth(grad_out, grad_sum, s, weight, rstd):
    n = s.double() * rstd.double()[:, None]
    g = grad_out.double()
    wg = weight.double() * g
    mean = (wg * n).mean(-1, keepdim=True)
    grad_input = (wg - n * mean) * rstd.double()[:, None]
    if grad_sum is not None:
        grad_input = grad_input + grad_sum.double()
    # float32 cancels in wg - n * mean (and in + grad_sum), and mean is a float32 sum of terms
    # that may cancel: the floor scales with the terms, not with their sum
    mean_abs = (wg * n).abs().mean(-1, keepdim=True)
    floor = 4e-6 * (wg.abs() + n.abs() * mean_abs) * rstd.double()[:, None]
    if grad_sum is not None:
        floor = floor + 4e-7 * grad_sum.double().abs()
    terms = g * n
    return grad_input, floor, terms.sum(0), 1e-6 * terms.abs().sum(0)


def run_rms_norm_bwd(ops, device, rows, hidden, dtype, weight_dtype, with_grad_sum, seed=0):
    s = randn(rows, hidden, dtype=dtype, seed=seed)
    weight = randn(hidden, dtype=weight_dtype, seed=seed + 1)
    grad_out = randn(rows, hidden, dtype=dtype, seed=seed + 2)
    grad_sum = randn(rows, hidden, dtype=dtype, seed=seed + 3) if with_grad_sum else None
    rstd = rms_norm_truth(s, weight, 1e-5)[1].float()
    args = [grad_out, grad_sum, s, weight, rstd]
    on_device = [None if a is None else a.to(device) for a in args]
    return args, ops.rms_norm_bwd(*on_device, True)


@pytest.mark.parametrize("device", devices("rms_norm_bwd"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [1, 3, 7, 17, 33, 1031])
@pytest.mark.parametrize("with_grad_sum", [False, True])
def test_rms_norm_bwd(device, dtype, hidden, with_grad_sum):
    ops = kernel_ops()
    for weight_dtype in [dtype] if dtype == FP32 else [dtype, FP32]:
        args, (grad_input, grad_weight) = run_rms_norm_bwd(
            ops, device, 6, hidden, dtype, weight_dtype, with_grad_sum
        )
        truth, floor, weight_truth, weight_floor = rms_norm_bwd_truth(*args)
        assert grad_input.dtype == dtype and grad_weight.dtype == FP32
        assert_matches(grad_input, truth, floor)
        assert_matches(grad_weight, weight_truth, weight_floor)
        no_weight_grad = ops.rms_norm_bwd(
            *[None if a is None else a.to(device) for a in args], False
        )
        assert torch.equal(no_weight_grad[0], grad_input)
        assert no_weight_grad[1].shape == (0,) and no_weight_grad[1].dtype == FP32


@pytest.mark.parametrize("device", devices("rms_norm_bwd"))
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=DTYPE_IDS)
def test_rms_norm_grad_weight_many_rows_is_deterministic(device, dtype):
    ops = kernel_ops()
    args, (grad_input, grad_weight) = run_rms_norm_bwd(ops, device, 2049, 257, dtype, FP32, True)
    _, _, weight_truth, weight_floor = rms_norm_bwd_truth(*args)
    assert_matches(grad_weight, weight_truth, weight_floor)
    again = ops.rms_norm_bwd(*[None if a is None else a.to(device) for a in args], True)
    assert torch.equal(again[0], grad_input) and torch.equal(again[1], grad_weight)
    if device == "cpu":  # the row blocks do not depend on the thread count either
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1 if threads > 1 else 2)
            other = ops.rms_norm_bwd(*args, True)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(other[1], grad_weight)


@pytest.mark.parametrize("device", devices("rms_norm_fwd", "rms_norm_bwd"))
def test_rms_norm_empty(device):
    ops = kernel_ops()
    x = torch.empty(0, 8, dtype=BF16, device=device)
    w = torch.ones(8, device=device)
    out, sum_, rstd = ops.rms_norm_fwd(x, x, w, 1e-5)
    assert out.shape == (0, 8) and sum_.shape == (0, 8) and rstd.shape == (0,)
    grad_input, grad_weight = ops.rms_norm_bwd(x, None, x, w, rstd, True)
    assert grad_input.shape == (0, 8) and torch.equal(grad_weight.cpu(), torch.zeros(8))


def test_checks_say_what_is_wrong():
    ops = kernel_ops()
    with pytest.raises(RuntimeError, match="rms_norm_fwd: x must be float32, bfloat16 or"):
        ops.rms_norm_fwd(torch.ones(2, 3, dtype=torch.long), None, torch.ones(3), 1e-5)
    with pytest.raises(RuntimeError, match="rope_fwd: the cos/sin tables hold 4 positions"):
        table = torch.ones(4, 1)
        ops.rope_fwd(torch.ones(1, 3, 1, 1, 2), None, table, table, 2, False)


# ---- rope ----


def rope_tables(positions: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 10000.0 ** (-torch.arange(dim // 2, dtype=FP64) * 2 / dim)
    angles = torch.arange(positions, dtype=FP64)[:, None] * inv_freq
    return torch.cos(angles).float(), torch.sin(angles).float()


def rope_truth(x, cos, sin, offset, inverse):
    half = x.shape[-1] // 2
    a, c = x.double()[..., :half], x.double()[..., half:]
    seq = x.shape[1]
    cos64 = cos.double()[offset : offset + seq][None, :, None, None]
    sin64 = sin.double()[offset : offset + seq][None, :, None, None] * (-1 if inverse else 1)
    out = torch.cat([a * cos64 - c * sin64, c * cos64 + a * sin64], -1)
    # float32 cancels in a cos - c sin (and c cos + a sin): the floor scales with the products
    floor = 2e-7 * torch.cat(
        [(a * cos64).abs() + (c * sin64).abs(), (c * cos64).abs() + (a * sin64).abs()], -1
    )
    return out, floor


def fused_qkv(batch, seq, groups, reps, dim, dtype, device, seed=0):
    """q [B, S, G, R, D] and k [B, S, G, 1, D] on `device` as views of a fused qkv
    [B, S, G, R + 2, D] (made there: copying a view to a device would make it contiguous)."""
    qkv = randn(batch, seq, groups, reps + 2, dim, dtype=dtype, seed=seed).to(device)
    return qkv[:, :, :, :reps], qkv[:, :, :, reps : reps + 1]


@pytest.mark.parametrize("device", devices("rope_fwd"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dim", [2, 6, 64, 130])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_fused_qkv_views(device, dtype, dim, inverse):
    ops = kernel_ops()
    q, k = fused_qkv(2, 5, 3, 2, dim, dtype, device)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = rope_tables(9, dim)
    q_out, k_out = ops.rope_fwd(q, k, cos.to(device), sin.to(device), 3, inverse)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert q_out.dtype == dtype and k_out.dtype == dtype
    for out, x in [(q_out, q), (k_out, k)]:
        assert_matches(out, *rope_truth(x.cpu(), cos, sin, 3, inverse))
    q_only, none = ops.rope_fwd(q, None, cos.to(device), sin.to(device), 3, inverse)
    assert torch.equal(q_only, q_out) and none.shape == (0,)


@pytest.mark.parametrize("device", devices("rope_fwd"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope_offset_shard_equals_full_rotation(device, dtype):
    ops = kernel_ops()
    q, k = fused_qkv(1, 12, 2, 4, 64, dtype, device, seed=4)
    cos, sin = (t.to(device) for t in rope_tables(12, 64))
    full_q, full_k = ops.rope_fwd(q, k, cos, sin, 0, False)
    for offset, seq in [(0, 5), (5, 4), (9, 3)]:
        part = slice(offset, offset + seq)
        shard_q, shard_k = ops.rope_fwd(q[:, part], k[:, part], cos, sin, offset, False)
        assert torch.equal(shard_q, full_q[:, part]) and torch.equal(shard_k, full_k[:, part])


@pytest.mark.parametrize("device", devices("rope_fwd"))
def test_rope_inverse_undoes_forward(device):
    ops = kernel_ops()
    q, k = (x.cpu().double() for x in fused_qkv(2, 7, 2, 2, 130, FP32, device, seed=5))
    cos, sin = (t.to(device) for t in rope_tables(10, 130))
    rotated = ops.rope_fwd(q.float().to(device), k.float().to(device), cos, sin, 2, False)
    back_q, back_k = ops.rope_fwd(*rotated, cos, sin, 2, True)
    assert_matches(back_q, q, floor=1e-6 * q.abs().amax())
    assert_matches(back_k, k, floor=1e-6 * k.abs().amax())


@pytest.mark.parametrize("device", devices("rope_fwd"))
@pytest.mark.parametrize("shape", [(0, 4, 2, 1, 8), (2, 0, 2, 1, 8)])
def test_rope_empty(device, shape):
    ops = kernel_ops()
    cos, sin = (t.to(device) for t in rope_tables(4, 8))
    q = torch.empty(shape, dtype=BF16, device=device)
    q_out, k_out = ops.rope_fwd(q, q, cos, sin, 0, False)
    assert q_out.shape == shape and k_out.shape == shape


# ---- cross_entropy ----


def logits_and_labels(rows, vocab, dtype, vocab_start, seed=0):
    """logits [rows, vocab] with a row stride of vocab + 7 (the columns after vocab are the
    sentinel 123.0, which no op may write), labels in and out of the shard and -100."""
    base = torch.full((rows, vocab + 7), 123.0, dtype=dtype)
    base[:, :vocab] = randn(rows, vocab, dtype=dtype, scale=3.0, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    labels = torch.randint(0, vocab_start + vocab + 50, (rows,), generator=generator)
    labels[::2] = vocab_start + torch.randint(
        0, max(vocab, 1), (labels[::2].numel(),), generator=generator
    )
    labels[1::5] = -100
    return base, base[:, :vocab], labels


def ce_stats_truth(logits, labels, vocab_start):
    x = logits.double()
    rows, vocab = x.shape
    row_max = x.amax(-1) if vocab else torch.full((rows,), -math.inf, dtype=FP64)
    sum_exp = (x - row_max[:, None]).exp().sum(-1)
    t = labels - vocab_start
    inside = (t >= 0) & (t < vocab)
    target = torch.zeros(rows, dtype=FP64)
    target[inside] = x[inside.nonzero()[:, 0], t[inside]]
    return row_max, sum_exp, target, inside, t


def ce_grad_truth(logits, labels, vocab_start, lse, scale):
    _, _, _, inside, t = ce_stats_truth(logits, labels, vocab_start)
    shifted = logits.double() - lse.double()[:, None]
    prob = shifted.exp()
    grad = prob.clone()
    grad[inside.nonzero()[:, 0], t[inside]] -= 1.0
    scale64 = scale.double()[:, None] if scale is not None else torch.ones(1, 1, dtype=FP64)
    # float32 rounds logit - lse (1e-7 |logit - lse| relative, beyond 1e-6 far in the tail),
    # and its error in p stays when p - 1 cancels at the label
    floor = scale64.abs() * prob * (5e-7 + 1e-7 * shifted.abs())
    return grad * scale64, floor


VOCABS = [1, 5, 1000, 32003]


@pytest.mark.parametrize("device", devices("cross_entropy_stats"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_cross_entropy_stats(device, dtype, vocab):
    ops = kernel_ops()
    _, logits, labels = logits_and_labels(6, vocab, dtype, vocab_start=100)
    row_max, sum_exp, target = ops.cross_entropy_stats(logits.to(device), labels.to(device), 100)
    truth_max, truth_sum, truth_target, _, _ = ce_stats_truth(logits, labels, 100)
    assert row_max.dtype == sum_exp.dtype == target.dtype == FP32
    assert torch.equal(row_max.cpu().double(), truth_max)
    assert torch.equal(target.cpu().double(), truth_target)
    assert_matches(sum_exp, truth_sum)


@pytest.mark.parametrize("device", devices("cross_entropy_grad_"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("with_scale", [False, True])
def test_cross_entropy_grad(device, dtype, vocab, with_scale):
    ops = kernel_ops()
    base, logits, labels = logits_and_labels(6, vocab, dtype, vocab_start=100, seed=2)
    x = logits.double()
    lse = (x.amax(-1) + (x - x.amax(-1, keepdim=True)).exp().sum(-1).log()).float()
    scale = randn(6, seed=3).abs().float() if with_scale else None
    if scale is not None:
        scale[2] = 0.0  # an ignored row
    truth, floor = ce_grad_truth(logits, labels, 100, lse, scale)
    base_on = base.to(device)
    ops.cross_entropy_grad_(
        base_on[:, :vocab],
        labels.to(device),
        100,
        lse.to(device),
        None if scale is None else scale.to(device),
    )
    assert_matches(base_on[:, :vocab], truth, floor)
    assert torch.equal(base_on[:, vocab:].cpu(), base[:, vocab:])


@pytest.mark.parametrize("device", devices("cross_entropy_fused_"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("with_scale", [False, True])
def test_cross_entropy_fused(device, dtype, vocab, with_scale):
    ops = kernel_ops()
    base, logits, labels = logits_and_labels(6, vocab, dtype, vocab_start=0, seed=4)
    scale = torch.full((6,), 0.25) if with_scale else None
    truth_max, truth_sum, truth_target, _, _ = ce_stats_truth(logits, labels, 0)
    lse = truth_max + truth_sum.log()
    grad_truth, floor = ce_grad_truth(logits, labels, 0, lse, scale)
    base_on = base.to(device)
    loss = ops.cross_entropy_fused_(
        base_on[:, :vocab], labels.to(device), 0, None if scale is None else scale.to(device)
    )
    assert loss.dtype == FP32
    # float32 cancels in lse - target: the floor scales with both
    assert_matches(loss, lse - truth_target, floor=1e-6 * (lse.abs() + truth_target.abs()))
    assert_matches(base_on[:, :vocab], grad_truth, floor)
    assert torch.equal(base_on[:, vocab:].cpu(), base[:, vocab:])


@pytest.mark.parametrize(
    "device", devices("cross_entropy_stats", "cross_entropy_grad_", "cross_entropy_fused_")
)
def test_cross_entropy_empty(device):
    ops = kernel_ops()
    labels = torch.zeros(3, dtype=torch.long, device=device)
    row_max, sum_exp, target = ops.cross_entropy_stats(torch.empty(3, 0, device=device), labels, 0)
    assert torch.equal(row_max.cpu(), torch.full((3,), -math.inf))
    assert torch.equal(sum_exp.cpu(), torch.zeros(3)) and torch.equal(target.cpu(), torch.zeros(3))
    none = torch.empty(0, dtype=torch.long, device=device)
    stats = ops.cross_entropy_stats(torch.empty(0, 16, dtype=BF16, device=device), none, 0)
    assert all(s.shape == (0,) for s in stats)
    empty = torch.empty(0, 16, device=device)
    ops.cross_entropy_grad_(empty, none, 0, torch.empty(0, device=device), None)
    assert ops.cross_entropy_fused_(empty, none, 0, None).shape == (0,)


def test_cross_entropy_grad_on_cpu_is_exp_within_its_contract():
    """With lse = 0, scale 1 and no label in the chunk, the gradient is exp(logit) itself: the
    CPU kernels' vectorised exp (csrc/common/cpu_vec.h) against float64 over its whole range:
    1.2e-7 relative where the result is a normal float32, one subnormal unit below that, 0
    from -104 down, inf where float64 exp rounds past float32's largest, NaN kept."""
    ops = kernel_ops()
    sweep = torch.linspace(-104.0, 89.0, 200_003, dtype=FP64).float()
    special = [-math.inf, -1e30, -104.5, -104.0, -87.4, -0.0, 0.0, 88.72, 88.73, 88.8, 89.0]
    x = torch.cat([sweep, torch.tensor([*special, 1e30, math.inf, math.nan, -math.nan])])
    got = x[None, :].clone()
    ops.cross_entropy_grad_(got, torch.tensor([-100]), 0, torch.zeros(1), None)
    got, truth = got[0].double(), x.double().exp()
    rounded = truth.float().double()
    normal = (rounded >= torch.finfo(FP32).tiny) & rounded.isfinite()
    assert ((got - truth).abs() <= 1.2e-7 * truth)[normal].all()
    subnormal = rounded < torch.finfo(FP32).tiny
    assert ((got - truth).abs() <= 2.0**-149)[subnormal].all()
    assert (got[x <= -104.0] == 0.0).all()
    assert torch.equal(got.isinf(), rounded.isinf()) and torch.equal(got.isnan(), x.isnan())
