"""The package's fused ops with our compiled kernels against the same ops on their torch
references (``KernelChoice.references()``), forward and backward, through the public functions
the model calls: RMSNorm (alone and with the residual add), RoPE of q and k, SwiGLU, the chunked
head's cross-entropy (one rank and vocabulary-parallel), and a whole model.

The raw ops against float64 formulas are in test_csrc_ops.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_het.config import ModelConfig
from megatron_het.kernels.extension import EXTENSION
from megatron_het.kernels.norms import add_rms_norm, rms_norm
from megatron_het.kernels.selection import ALL_FUSED, FAMILIES, KernelChoice, implementation
from megatron_het.kernels.swiglu import swiglu
from megatron_het.model.llama import LlamaModel, use_kernels
from megatron_het.model.loss import linear_cross_entropy
from megatron_het.model.rope import RotaryEmbedding, apply_rope_qk
from megatron_het.tensor_parallel.cross_entropy import vocab_parallel_linear_cross_entropy

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
REFERENCE = KernelChoice.references()


@pytest.fixture(autouse=True, scope="module")
def cpu_kernels_built() -> None:
    for family in FAMILIES:
        impl = implementation(family, "cpu")
        assert impl.compiled, (
            f"{family} has no compiled CPU kernel ({impl.why}); build them with `make setup` "
            "(or `python setup.py build_ext --inplace`)"
        )


def both(fn, *tensors):
    """``fn(choice, *leaves)`` under the kernels and under the references, each on its own
    copies of ``tensors`` (leaves requiring grad); returns ((out, grads), (out, grads))."""
    results = []
    for choice in (ALL_FUSED, REFERENCE):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
        out = fn(choice, *leaves)
        outs = out if isinstance(out, tuple) else (out,)
        torch.manual_seed(1)
        loss = sum((o.float() * torch.randn(o.shape)).sum() for o in outs)
        loss.backward()
        results.append((outs, [leaf.grad for leaf in leaves if leaf.requires_grad]))
    return results


def close(got, want, dtype, scale=1.0):
    tol = {FP32: 2e-6, BF16: 1.6e-2, FP16: 2e-3}[dtype] * scale
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize("hidden", [7, 64, 1031])
def test_rms_norm_matches_reference(dtype, hidden):
    torch.manual_seed(0)
    x = torch.randn(3, 5, hidden).to(dtype)
    w = (torch.rand(hidden) + 0.5).to(dtype)
    (got, got_grads), (want, want_grads) = both(
        lambda c, a, b: rms_norm(a, b, 1e-5, choice=c), x, w
    )
    close(got[0], want[0], dtype)
    close(got_grads[0], want_grads[0], dtype)
    close(got_grads[1], want_grads[1], dtype, scale=4)  # a sum over 15 rows


def test_rms_norm_with_float32_weight_on_bf16():
    torch.manual_seed(0)
    x, w = torch.randn(4, 96).to(BF16), torch.rand(96) + 0.5
    (got, got_grads), (want, want_grads) = both(
        lambda c, a, b: rms_norm(a, b, 1e-6, choice=c), x, w
    )
    assert got[0].dtype == BF16 and got_grads[1].dtype == FP32
    close(got[0], want[0], BF16)
    close(got_grads[0], want_grads[0], BF16)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_add_rms_norm_matches_add_then_norm(dtype):
    torch.manual_seed(0)
    x, r = torch.randn(2, 6, 130).to(dtype), torch.randn(2, 6, 130).to(dtype)
    w = (torch.rand(130) + 0.5).to(dtype)
    (got, got_grads), (want, want_grads) = both(
        lambda c, a, b, g: add_rms_norm(a, b, g, 1e-5, choice=c), x, r, w
    )
    for g, h in zip(got, want):
        close(g, h, dtype)
    for g, h in zip(got_grads, want_grads):
        close(g, h, dtype, scale=4)


def test_add_rms_norm_promotes_like_the_add():
    x, r, w = torch.randn(3, 8).to(BF16), torch.randn(3, 8), torch.ones(8)
    normed, total = add_rms_norm(x, r, w, 1e-5)
    assert normed.dtype == total.dtype == FP32
    torch.testing.assert_close(total, x.float() + r)


def shape(**overrides) -> ModelConfig:
    """A 2-layer model with 4 query heads of dimension 16 in 2 groups."""
    fields = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=301,
    )
    return ModelConfig(**{**fields, **overrides})


def qkv_views(dtype, groups=2, per_group=3, seq=9, dim=16):
    qkv = torch.randn(2, seq, groups, per_group + 2, dim).to(dtype)
    q, k, _ = qkv.split((per_group, 1, 1), dim=3)
    return q, k


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("scaled", [False, True])
def test_rope_matches_reference(dtype, scaled):
    from megatron_het.config import RopeScaling

    torch.manual_seed(0)
    scaling = RopeScaling(8.0, 1.0, 4.0, 16) if scaled else None
    config = shape(rope_scaling=scaling)
    cos, sin = RotaryEmbedding(config).cos_sin(9, torch.device("cpu"), FP32)
    q, k = qkv_views(dtype)
    assert not q.is_contiguous()
    (got, got_grads), (want, want_grads) = both(
        lambda c, a, b: apply_rope_qk(a, b, cos, sin, choice=c), q, k
    )
    for g, h in zip(got + tuple(got_grads), want + tuple(want_grads)):
        assert g.is_contiguous()
        close(g, h, dtype)


def test_rope_shard_rotates_by_its_own_positions():
    torch.manual_seed(0)
    config = shape()
    cos, sin = RotaryEmbedding(config).cos_sin(12, torch.device("cpu"), FP32)
    q, k = torch.randn(1, 12, 4, 1, 16), torch.randn(1, 12, 1, 1, 16)
    full_q, full_k = apply_rope_qk(q, k, cos, sin)
    for offset in (0, 4, 8):
        part = slice(offset, offset + 4)
        shard_q, shard_k = apply_rope_qk(q[:, part], k[:, part], cos, sin, offset=offset)
        torch.testing.assert_close(shard_q, full_q[:, part], rtol=0, atol=0)
        torch.testing.assert_close(shard_k, full_k[:, part], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-halves"])
def test_swiglu_matches_reference(dtype, fused):
    torch.manual_seed(0)
    if fused:  # gate and up as the halves of one [B, S, 2F] projection
        inputs = ((torch.randn(2, 7, 2 * 45) * 3).to(dtype),)
        (got, got_grads), (want, want_grads) = both(
            lambda c, x: swiglu(*x.chunk(2, dim=-1), choice=c), *inputs
        )
    else:
        inputs = ((torch.randn(2, 7, 45) * 3).to(dtype), torch.randn(2, 7, 45).to(dtype))
        (got, got_grads), (want, want_grads) = both(lambda c, g, u: swiglu(g, u, choice=c), *inputs)
    close(got[0], want[0], dtype)
    for g, h in zip(got_grads, want_grads):
        close(g, h, dtype, scale=2)  # the reference rounds silu, then the products


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_head_cross_entropy_matches_reference(dtype):
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 37, 48).to(dtype), (torch.randn(1003, 48) * 0.2).to(dtype)
    labels = torch.randint(0, 1003, (3, 37))
    labels[0, :5] = -100
    mask = torch.rand(3, 37)
    for weights in (None, mask):
        (got, got_grads), (want, want_grads) = both(
            lambda c, h, w: linear_cross_entropy(h, w, labels, weights, chunk_tokens=16, choice=c),
            hidden,
            weight,
        )
        close(got[0], want[0], FP32, scale=2)
        for g, h in zip(got_grads, want_grads):
            close(g, h, dtype, scale=2)


class OneRank:
    """A tensor-parallel group of one rank (its collectives change nothing)."""

    size, rank, ranks = 1, 0, (0,)

    def all_reduce(self, tensor, op="sum"):
        return None


def test_vocab_parallel_head_matches_reference():
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 21, 32), torch.randn(500, 32) * 0.3
    labels = torch.randint(0, 500, (2, 21))
    labels[1, 3] = -100
    (got, got_grads), (want, want_grads) = both(
        lambda c, h, w: vocab_parallel_linear_cross_entropy(
            h, w, labels, OneRank(), 0, chunk_tokens=8, copy_input=False, choice=c
        ),
        hidden,
        weight,
    )
    close(got[0], want[0], FP32)
    for g, h in zip(got_grads, want_grads):
        close(g, h, FP32)


def tiny_model(choice: KernelChoice) -> LlamaModel:
    torch.manual_seed(3)
    model = LlamaModel(shape())
    use_kernels(model, choice)
    return model


def test_model_with_kernels_matches_references():
    tokens = torch.randint(0, 301, (2, 17))
    labels = torch.randint(0, 301, (2, 17))
    results = []
    for choice in (ALL_FUSED, REFERENCE):
        model = tiny_model(choice)
        assert {m.kernels for m in model.modules() if hasattr(type(m), "kernels")} == {choice}
        loss = model(tokens, labels=labels)
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "call,message",
    [
        (
            lambda: rms_norm(torch.ones(2, 4, dtype=torch.int64), torch.ones(4), 1e-5),
            "rms_norm: x must be float32, bfloat16 or float16, got torch.int64",
        ),
        (
            lambda: rms_norm(torch.ones(2, 4), torch.ones(5), 1e-5),
            "rms_norm: weight must be [H] for x [..., H], got (5,) for (2, 4)",
        ),
        (
            lambda: add_rms_norm(torch.ones(2, 4), torch.ones(3, 4), torch.ones(4), 1e-5),
            "add_rms_norm: x and residual must have one shape",
        ),
        (
            lambda: apply_rope_qk(
                torch.ones(1, 2, 1, 1, 5),
                torch.ones(1, 2, 1, 1, 5),
                torch.ones(2, 2),
                torch.ones(2, 2),
            ),
            "rope: the head dimension must be even, got 5",
        ),
        (
            lambda: apply_rope_qk(
                torch.ones(1, 4, 1, 1, 4),
                torch.ones(1, 4, 1, 1, 4),
                torch.ones(3, 2),
                torch.ones(3, 2),
            ),
            "rope: positions [0, 4) must lie in the tables' 3",
        ),
        (
            lambda: apply_rope_qk(
                torch.ones(1, 4, 4), torch.ones(1, 4, 4), torch.ones(4, 2), torch.ones(4, 2)
            ),
            "rope: q and k must be [B, S, G, R, D]",
        ),
        (
            lambda: swiglu(torch.ones(2, 4, dtype=torch.int32), torch.ones(2, 4)),
            "swiglu: gate must be float32, bfloat16 or float16, got torch.int32",
        ),
        (
            lambda: swiglu(torch.ones(2, 4), torch.ones(2, 5)),
            "swiglu: gate and up must have one shape [..., F], got (2, 4) and (2, 5)",
        ),
        (
            lambda: swiglu(torch.ones(2, 4), torch.ones(2, 4, device="meta")),
            "swiglu: gate and up must be on one device, got cpu and meta",
        ),
    ],
)
def test_bad_arguments_get_one_line_naming_the_op(call, message):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_extension_is_loaded_for_these_tests():
    assert EXTENSION.loaded, EXTENSION.why
