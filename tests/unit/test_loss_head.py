"""The fused output layer + cross-entropy: parity with F.cross_entropy on full logits, chunk
sizes, bf16 weights, the float32 main_grad path, ignored labels, liger dispatch, and the
vocabulary-parallel head on a one-rank group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_het.kernels import LigerKernels
from megatron_het.kernels.main_grad import MAIN_GRAD, ON_MAIN_GRAD_ADDED
from megatron_het.model.loss import (
    CHUNK_LOGIT_BYTES_ACCELERATOR,
    CHUNK_LOGIT_BYTES_CPU,
    IGNORE_INDEX,
    default_chunk_tokens,
    linear_cross_entropy,
)
from megatron_het.tensor_parallel.cross_entropy import vocab_parallel_linear_cross_entropy

V, H = 37, 16


class OneRankGroup:
    """A tensor-parallel group of one rank: every collective is the identity."""

    size, rank = 1, 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> None:
        return None


def make_inputs(dtype=torch.float32, seed=0, shape=(5, 7), ignore=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, V, shape, generator=g)
    if ignore:
        labels.view(-1)[:3] = IGNORE_INDEX
    loss_weights = torch.rand(*shape, generator=g)
    return hidden, weight, labels, loss_weights


def reference(hidden, weight, labels, loss_weights=None, scale=1.5):
    """Loss and float32 gradients from F.cross_entropy on the full float32 logits."""
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    per_token = F.cross_entropy((h @ w.t()).view(-1, w.shape[0]), labels.view(-1), reduction="none")
    if loss_weights is None:
        loss = per_token.sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)
    else:
        loss = (per_token * loss_weights.view(-1)).sum()
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def ours(hidden, weight, labels, loss_weights=None, scale=1.5, tp=False, **kwargs):
    hidden.grad = weight.grad = None
    if tp:
        loss = vocab_parallel_linear_cross_entropy(
            hidden, weight, labels, OneRankGroup(), 0, loss_weights, **kwargs
        )
    else:
        loss = linear_cross_entropy(hidden, weight, labels, loss_weights, **kwargs)
    assert loss.dtype == torch.float32
    (loss * scale).backward()
    return loss.detach(), hidden.grad, weight.grad


def test_chunks_hold_a_budget_of_float32_logit_bytes():
    assert default_chunk_tokens(32000, "cuda") == 2048
    assert default_chunk_tokens(128256, "cuda") == 512
    assert default_chunk_tokens(32000, "cpu") == 64
    assert default_chunk_tokens(10**9, "cuda") == 1
    for vocab in (61, 1000, 32000, 50257, 128256, 256000):
        for device, budget in (
            ("cuda", CHUNK_LOGIT_BYTES_ACCELERATOR),
            ("cpu", CHUNK_LOGIT_BYTES_CPU),
        ):
            tokens = default_chunk_tokens(vocab, device)
            assert tokens * vocab * 4 <= budget
            assert tokens < 64 or tokens % 64 == 0
            assert (tokens + 64) * vocab * 4 > budget or tokens < 64  # near the budget


@pytest.mark.parametrize("tp", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_cross_entropy_on_full_logits_for_any_chunk_size(tp, weighted):
    hidden, weight, labels, loss_weights = make_inputs()
    loss_weights = loss_weights if weighted else None
    expected = reference(hidden, weight, labels, loss_weights)
    by_chunk = {}
    for chunk in (1, 4, 35, 1000, None):
        by_chunk[chunk] = ours(hidden, weight, labels, loss_weights, tp=tp, chunk_tokens=chunk)
        for got, want in zip(by_chunk[chunk], expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got in by_chunk.values():  # chunking only reorders float32 sums
        for a, b in zip(got, by_chunk[1]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tp", [False, True])
def test_bf16_weights_within_bf16_tolerance(tp):
    hidden, weight, labels, loss_weights = make_inputs(torch.bfloat16)
    got = ours(hidden, weight, labels, loss_weights, tp=tp, chunk_tokens=8)
    expected = reference(hidden, weight, labels, loss_weights)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.float(), b, atol=1e-2, rtol=1e-2)


def with_main_grad(weight: torch.Tensor) -> list[int]:
    events: list[int] = []
    setattr(weight, MAIN_GRAD, torch.zeros(weight.shape, dtype=torch.float32))
    setattr(weight, ON_MAIN_GRAD_ADDED, lambda: events.append(1))
    return events


@pytest.mark.parametrize("tp", [False, True])
def test_main_grad_gets_the_unrounded_float32_gradient(tp):
    hidden, weight, labels, loss_weights = make_inputs(torch.bfloat16, shape=(8, 16))
    events = with_main_grad(weight)
    _, grad_hidden, grad_weight = ours(hidden, weight, labels, loss_weights, tp=tp, chunk_tokens=24)
    assert grad_weight is None and events == [1]  # no .grad; the callback fired once
    _, ref_hidden, ref_weight = reference(hidden, weight, labels, loss_weights)
    main = weight.main_grad.clone()
    error = (main - ref_weight).norm()
    rounding = (ref_weight.bfloat16().float() - ref_weight).norm()
    assert error < 0.1 * rounding  # far closer than a bf16-rounded gradient would be
    torch.testing.assert_close(grad_hidden.float(), ref_hidden, atol=1e-2, rtol=1e-2)
    ours(hidden, weight, labels, loss_weights, tp=tp, chunk_tokens=24)  # accumulates
    assert events == [1, 1]
    torch.testing.assert_close(weight.main_grad, 2 * main)


def test_a_weight_without_main_grad_gets_its_gradient_in_its_dtype():
    hidden, weight, labels, _ = make_inputs(torch.bfloat16)
    _, _, grad_weight = ours(hidden, weight, labels)
    assert grad_weight.dtype == torch.bfloat16 and not hasattr(weight, MAIN_GRAD)


def test_only_the_gradients_autograd_needs():
    hidden, weight, labels, loss_weights = make_inputs()
    weight.requires_grad_(False)
    loss, grad_hidden, grad_weight = ours(hidden, weight, labels, loss_weights)
    expected = reference(hidden, weight, labels, loss_weights)
    assert grad_weight is None
    torch.testing.assert_close(grad_hidden, expected[1], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(
            linear_cross_entropy(hidden, weight, labels, loss_weights),
            expected[0],
            atol=1e-5,
            rtol=1e-5,
        )


@pytest.mark.parametrize("tp", [False, True])
def test_ignored_labels_carry_no_loss_and_no_gradient(tp):
    hidden, weight, labels, _ = make_inputs(ignore=False)
    labels[0] = IGNORE_INDEX
    loss, grad_hidden, _ = ours(hidden, weight, labels, tp=tp, chunk_tokens=3)
    expected = reference(hidden, weight, labels)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(grad_hidden[0], torch.zeros_like(grad_hidden[0]))
    labels.fill_(IGNORE_INDEX)
    loss, grad_hidden, grad_weight = ours(hidden, weight, labels, tp=tp)
    assert loss.item() == 0.0 and not grad_hidden.any() and not grad_weight.any()


def test_liger_stands_in_only_where_it_may():
    hidden, weight, labels, loss_weights = make_inputs()
    calls = []

    def fake(h, w, y):
        calls.append((h.shape, y.shape))
        return torch.tensor(7.0)

    absent = LigerKernels()
    torch.testing.assert_close(
        linear_cross_entropy(hidden, weight, labels, liger=absent),
        reference(hidden, weight, labels)[0],
        atol=1e-5,
        rtol=1e-5,
    )
    on_cuda_only = LigerKernels(linear_cross_entropy=fake)
    linear_cross_entropy(hidden, weight, labels, liger=on_cuda_only)
    assert calls == []  # CPU tensors take our kernel
    present = LigerKernels(linear_cross_entropy=fake, device_types=frozenset({"cpu"}))
    assert linear_cross_entropy(hidden, weight, labels, liger=present).item() == 7.0
    assert calls == [((35, H), (35,))]
    linear_cross_entropy(hidden, weight, labels, loss_weights, liger=present)  # weighted
    linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, liger=present)  # override
    with_main_grad(weight)
    linear_cross_entropy(hidden, weight, labels, liger=present)  # float32 main_grad
    assert len(calls) == 1


def emulate_accelerator_gemms(monkeypatch) -> None:
    """The accelerator path on CPU: GEMM operands stay in their low-precision dtype and the
    products come out in float32, as CUDA's float32-output GEMMs give them."""
    import megatron_het.model.loss as loss_mod

    monkeypatch.setattr(loss_mod, "gemm_operand_dtype", lambda dtype, device: dtype)
    monkeypatch.setattr(loss_mod, "mm_fp32_out", lambda a, b: a.float() @ b.float())
    monkeypatch.setattr(
        loss_mod, "addmm_fp32_out_", lambda acc, a, b: acc.addmm_(a.float(), b.float())
    )


def test_accelerator_precision_emulated(monkeypatch):
    """The accelerator path (bf16 operands, float32-output GEMMs) emulated on CPU: with the
    default mean loss its main_grad error is a fraction of a bf16 rounding of the gradient."""
    emulate_accelerator_gemms(monkeypatch)
    g = torch.Generator().manual_seed(0)
    vocab, width, tokens = 1024, 64, 512
    hidden = torch.randn(tokens, width, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, generator=g) * 0.1).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[:5] = IGNORE_INDEX
    with_main_grad(weight)
    linear_cross_entropy(hidden, weight, labels, chunk_tokens=100).backward()
    h, w = hidden.detach().float(), weight.detach().float().requires_grad_()
    F.cross_entropy(h @ w.t(), labels).backward()
    error = (weight.main_grad - w.grad).norm()
    assert error < 0.75 * (w.grad.bfloat16().float() - w.grad).norm()


def _median_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.float() - want) / want.abs().clamp_min(1e-30)).abs().median())


@pytest.mark.parametrize("tp", [False, True])
@pytest.mark.parametrize("loss_scale", [2.0**15, 2.0**24])
def test_fp16_hidden_gradient_keeps_fp16_precision_under_loss_scaling(tp, loss_scale):
    """A mean over 8192 tokens makes each token's unscaled hidden gradient ~1e-6, in fp16's
    subnormals: the loss scale must reach it before it is held in fp16, and a scale beyond
    fp16's range must not turn into inf."""
    g = torch.Generator().manual_seed(0)
    tokens, width, vocab = 64, 128, 256
    hidden = torch.randn(tokens, width, generator=g).half().requires_grad_()
    weight = (torch.randn(vocab, width, generator=g) * 0.02).half().requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    weights = torch.full((tokens,), 1 / 8192)
    got = ours(hidden, weight, labels, weights, scale=loss_scale, tp=tp)
    want = reference(hidden, weight, labels, weights, scale=loss_scale)
    assert torch.isfinite(got[1]).all()
    assert _median_relative_error(got[1], want[1]) < 1e-3  # fp16 rounding is 4.9e-4


def test_vocab_parallel_bf16_head_is_exact_near_large_top_logits(monkeypatch):
    """On accelerators the vocabulary-parallel head keeps every chunk's logits in bf16 until
    the global log-sum-exp is known; kept about each row's max they stay exact where the
    probability is, however large the logits (here ~30, where bf16's step is 0.125)."""
    emulate_accelerator_gemms(monkeypatch)
    g = torch.Generator().manual_seed(0)
    tokens, width, vocab = 128, 64, 512
    hidden = torch.randn(tokens, width, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, generator=g) * 0.5).bfloat16().requires_grad_()
    hidden.data[:, 0], weight.data[:, 0] = 6.0, 5.0  # every logit ~30 (softmax ignores it)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    got = ours(hidden, weight, labels, tp=True, scale=1.0)
    want = reference(hidden, weight, labels, scale=1.0)
    error = (got[1].float() - want[1]).norm() / want[1].norm()
    assert error < 1e-2
