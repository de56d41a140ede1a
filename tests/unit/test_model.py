"""LlamaModel against a plain-torch reference, pipeline slicing, initialisation, fused loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_het.config import ModelConfig, RopeScaling, model_preset
from megatron_het.errors import UserError
from megatron_het.kernels.selection import KernelChoice
from megatron_het.model.init import init_weights, initial_value
from megatron_het.model.llama import LlamaModel, build_model
from megatron_het.model.loss import linear_cross_entropy
from megatron_het.model.rope import apply_rope, rope_inverse_frequencies, rope_table_dtype

TINY = ModelConfig(
    num_layers=3,
    hidden_size=48,
    ffn_hidden_size=80,
    num_attention_heads=6,
    num_query_groups=2,
    vocab_size=61,
    rope_theta=1000.0,
    norm_eps=1e-5,
)


def reference_logits(
    cfg: ModelConfig, state: dict[str, torch.Tensor], tokens: torch.Tensor
) -> torch.Tensor:
    """Llama written out head by head, with an explicit causal mask and angle-based RoPE."""
    nh, ng, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    r, S = nh // ng, tokens.shape[1]
    angles = (
        torch.arange(S, dtype=torch.float32)[:, None]
        * rope_inverse_frequencies(d, cfg.rope_theta, cfg.rope_scaling)[None, :]
    )  # [S, d/2]

    def rope(x: torch.Tensor) -> torch.Tensor:  # x [B, S, d]: pairs (j, j + d/2)
        a, b = x[..., : d // 2], x[..., d // 2 :]
        c, s = angles.cos(), angles.sin()
        return torch.cat((a * c - b * s, a * s + b * c), dim=-1)

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    mask = torch.full((S, S), float("-inf")).triu(1)
    x = state["embedding.weight"][tokens]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = norm(x, state[p + "input_norm.weight"])
        rows = (h @ state[p + "attention.qkv.weight"].t()).view(*h.shape[:2], ng, r + 2, d)
        heads = []
        for j in range(nh):
            group, slot = divmod(j, r)
            q = rope(rows[:, :, group, slot])
            k = rope(rows[:, :, group, r])
            v = rows[:, :, group, r + 1]
            scores = q @ k.transpose(1, 2) / math.sqrt(d) + mask
            heads.append(scores.softmax(-1) @ v)
        x = x + torch.cat(heads, dim=-1) @ state[p + "attention.proj.weight"].t()
        h = norm(x, state[p + "post_attention_norm.weight"])
        gate = h @ state[p + "mlp.gate.weight"].t()
        up = h @ state[p + "mlp.up.weight"].t()
        x = x + (gate * torch.sigmoid(gate) * up) @ state[p + "mlp.down.weight"].t()
    head = state["embedding.weight"] if cfg.tie_embeddings else state["output.weight"]
    return norm(x, state["final_norm.weight"]) @ head.t()


def random_state(model: LlamaModel, seed: int) -> None:
    """Random values everywhere, norms included, so every weight's role is exercised."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(
                torch.randn(param.shape, generator=generator) * 0.2
                + (1.0 if param.dim() == 1 else 0.0)
            )


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_matches_reference(tied: bool, scaled: bool) -> None:
    scaling = RopeScaling(factor=4.0, original_max_position_embeddings=8) if scaled else None
    cfg = TINY.replace(tie_embeddings=tied, rope_scaling=scaling)
    model = LlamaModel(cfg)
    random_state(model, 0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        expected = reference_logits(cfg, model.state_dict(), tokens)
    assert ours.shape == (2, 24, cfg.vocab_size)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_names_shapes_and_count(tied: bool) -> None:
    cfg = TINY.replace(tie_embeddings=tied)
    shapes = {n: tuple(p.shape) for n, p in LlamaModel(cfg).named_parameters()}
    H, F_, V, d = 48, 80, 61, 8
    assert shapes["embedding.weight"] == (V, H)
    assert shapes["layers.2.attention.qkv.weight"] == ((6 + 2 * 2) * d, H)
    assert shapes["layers.0.attention.proj.weight"] == (H, 6 * d)
    assert shapes["layers.1.mlp.gate.weight"] == (F_, H) == shapes["layers.1.mlp.up.weight"]
    assert shapes["layers.1.mlp.down.weight"] == (H, F_)
    assert shapes["final_norm.weight"] == (H,)
    assert ("output.weight" in shapes) is not tied
    assert sum(math.prod(s) for s in shapes.values()) == cfg.num_parameters()


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_match_full_model(tied: bool) -> None:
    cfg = TINY.replace(tie_embeddings=tied)
    full = build_model(cfg, seed=7)
    first = build_model(cfg, seed=7, layer_range=(0, 1), has_head=False)
    middle = build_model(cfg, seed=7, layer_range=(1, 2), has_embedding=False, has_head=False)
    last = build_model(cfg, seed=7, layer_range=(2, 3), has_embedding=False)
    assert list(last.layers.keys()) == ["2"]
    full_state = full.state_dict()
    for stage in (first, middle, last):
        for name, value in stage.state_dict().items():
            assert torch.equal(value, full_state[name]), name
    assert ("embedding.weight" in last.state_dict()) is tied
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        hidden = middle(first(tokens))
        assert hidden.shape == (2, 16, cfg.hidden_size)
        torch.testing.assert_close(last(hidden), full(tokens), atol=1e-6, rtol=1e-6)


def test_tied_single_stage_keeps_one_weight() -> None:
    model = LlamaModel(TINY.replace(tie_embeddings=True))
    assert model.output is None and model.output_weight() is model.embedding.weight


def test_init_is_seeded_by_name_and_scaled() -> None:
    cfg = model_preset("tiny")
    a, b, c = build_model(cfg, 3), build_model(cfg, 3), build_model(cfg, 4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert not torch.equal(sa["embedding.weight"], sc["embedding.weight"])
    assert not torch.equal(sa["layers.0.mlp.up.weight"], sa["layers.1.mlp.up.weight"])
    assert torch.equal(sa["layers.3.input_norm.weight"], torch.ones(cfg.hidden_size))
    std = cfg.init_method_std
    assert abs(sa["layers.0.mlp.gate.weight"].std().item() - std) < 0.1 * std
    down_std = sa["layers.0.mlp.down.weight"].std().item()
    assert abs(down_std - std / math.sqrt(2 * cfg.num_layers)) < 0.1 * down_std
    value = initial_value("layers.2.attention.qkv.weight", (128, 64), cfg, seed=3)
    assert torch.equal(value, sa["layers.2.attention.qkv.weight"])
    eager = LlamaModel(cfg)  # built with real tensors, unlike build_model's meta start
    init_weights(eager, 3)
    assert all(torch.equal(v, sa[n]) for n, v in eager.state_dict().items())


def test_bad_layer_range_is_a_user_error() -> None:
    with pytest.raises(UserError, match="layer range"):
        LlamaModel(TINY, layer_range=(2, 5))


def test_llama3_scaling_keeps_high_and_divides_low_frequencies() -> None:
    plain = rope_inverse_frequencies(64, 500000.0)
    scaled = rope_inverse_frequencies(64, 500000.0, RopeScaling(factor=8.0))
    wavelength = 2 * math.pi / plain
    high, low = wavelength < 8192 / 4, wavelength > 8192
    assert high.any() and low.any()
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8.0)
    band = ~high & ~low
    assert ((scaled[band] < plain[band]) & (scaled[band] > plain[band] / 8.0)).all()


def test_fused_loss_matches_cross_entropy_with_grads() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 7, 16, generator=g, requires_grad=True)
    weight = (torch.randn(37, 16, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, 37, (5, 7), generator=g)
    labels[0, :3] = -100
    loss_weights = torch.rand(5, 7, generator=g)
    results = []
    for fused in (False, True):
        hidden.grad = weight.grad = None
        if fused:
            loss = linear_cross_entropy(hidden, weight, labels, loss_weights, chunk_tokens=4)
        else:
            per_token = F.cross_entropy(
                (hidden @ weight.t()).view(-1, 37), labels.view(-1), reduction="none"
            )
            loss = (per_token * loss_weights.view(-1)).sum()
        (loss * 1.5).backward()
        results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
    for ours, expected in zip(results[1], results[0]):
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        mean_loss = linear_cross_entropy(hidden, weight, labels)
    expected = F.cross_entropy((hidden @ weight.t()).view(-1, 37), labels.view(-1))
    torch.testing.assert_close(mean_loss, expected.detach(), atol=1e-5, rtol=1e-5)


def test_model_loss_and_recompute_match_logits_path() -> None:
    cfg = TINY
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    labels = torch.randint(0, cfg.vocab_size, (2, 12))
    grads = []
    for mode in ("logits", "fused", "recompute"):
        model = build_model(cfg, seed=5, recompute=mode == "recompute")
        if mode == "logits":
            loss = F.cross_entropy(model(tokens).view(-1, cfg.vocab_size), labels.view(-1))
        else:
            loss = model(tokens, labels)
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in model.parameters()])
    for other in grads[1:]:
        for ours, expected in zip(other, grads[0]):
            torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)


def test_rope_cache_from_inference_mode_still_trains() -> None:
    model = build_model(TINY, seed=1)
    tokens = torch.randint(0, TINY.vocab_size, (1, 8))
    with torch.inference_mode():
        model(tokens)
    model(tokens).sum().backward()
    assert model.embedding.weight.grad is not None


@pytest.mark.parametrize("precision", ["autocast", "bf16_weights"])
def test_fused_loss_in_bfloat16_matches_float32(precision: str) -> None:
    cfg = TINY
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    labels = tokens.roll(-1, dims=1)
    reference = build_model(cfg, seed=5)
    reference(tokens, labels).backward()
    model = build_model(cfg, seed=5)
    if precision == "bf16_weights":
        model = model.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        loss = model(tokens, labels)
    loss.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference(tokens, labels).detach(), atol=2e-2, rtol=2e-2)
    for ours, expected in zip(model.parameters(), reference.parameters()):
        assert ours.grad.dtype == ours.dtype
        scale = expected.grad.abs().max()
        assert (ours.grad.float() - expected.grad).abs().max() <= 0.05 * scale


def test_rope_matches_rotate_half_formula_and_gradcheck() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, generator=g)
    angles = torch.rand(5, 1, 4, dtype=torch.float64, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    rotated = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    expected = x * torch.cat((cos, cos), -1) + rotated * torch.cat((sin, sin), -1)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected)
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous, as in attention
    torch.testing.assert_close(apply_rope(strided, cos, sin), expected)
    assert torch.autograd.gradcheck(
        lambda t: apply_rope(t.transpose(1, 2), cos, sin),
        (x.transpose(1, 2).contiguous().requires_grad_(),),
    )


def test_bf16_parameters_keep_bf16_activations_and_a_float32_loss() -> None:
    """Megatron-style bf16: bf16 parameters, no autocast. Norms return bf16, attention runs in
    bf16, the loss is float32; RoPE's tables are bf16 for the torch reference (as Hugging
    Face's) and float32 for the compiled kernel, which rotates in float32."""
    model = build_model(TINY, seed=5).to(torch.bfloat16)
    seen: dict[str, torch.dtype] = {}

    def record(name: str):
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            seen[name] = out.dtype

        return hook

    for name, module in model.named_modules():
        if name.endswith(("norm", "attention")):
            module.register_forward_hook(record(name))
    tokens = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    loss = model(tokens, tokens.roll(-1, dims=1))
    assert loss.dtype == torch.float32
    assert seen and set(seen.values()) == {torch.bfloat16}
    hidden = model.embedding(tokens)
    references = KernelChoice.references()
    assert rope_table_dtype(hidden, references) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert rope_table_dtype(hidden.float(), references) == torch.bfloat16
    assert rope_table_dtype(hidden.float(), references) == torch.float32
    assert rope_table_dtype(hidden) == torch.float32  # the compiled kernel's (CPU: always built)


def test_block_recompute_checkpoints_the_first_layers_only(monkeypatch) -> None:
    """Megatron's block method: a chunk recomputing its first k layers checkpoints exactly
    those, and loss and gradients equal the run without recompute."""
    from megatron_het.model import llama

    cfg = TINY
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    labels = torch.randint(0, cfg.vocab_size, (2, 12))
    checkpointed = []
    real = llama.checkpoint

    def spy(layer, *args, **kwargs):
        checkpointed.append(layer)
        return real(layer, *args, **kwargs)

    monkeypatch.setattr(llama, "checkpoint", spy)
    results = []
    for recompute, count in ((False, 0), (1, 1), (True, cfg.num_layers)):
        model = LlamaModel(cfg, chunks=[(0, cfg.num_layers, recompute)])
        init_weights(model, 5)
        checkpointed.clear()
        loss = model(tokens, labels)
        loss.backward()
        assert [id(m) for m in checkpointed] == [id(model.layers[str(i)]) for i in range(count)]
        assert model.recompute == bool(recompute)
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    for other in results[1:]:
        for ours, expected in zip(other, results[0]):
            torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # no recompute outside training with gradients
        checkpointed.clear()
        model(tokens)
        assert not checkpointed
