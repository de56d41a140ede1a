"""Numerical parity with transformers' LlamaForCausalLM through the state-dict converters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from megatron_het.checkpoint.hf import (  # noqa: E402
    hf_config_to_model_config,
    hf_to_megatron_het_state,
    megatron_het_to_hf_state,
    model_config_to_hf_config,
)
from megatron_het.errors import UserError  # noqa: E402
from megatron_het.model.llama import LlamaModel  # noqa: E402

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


def make_hf(
    tied: bool, scaling: dict | None, kv_heads: int = 2, attn: str = "eager"
) -> transformers.LlamaForCausalLM:
    """A random tiny LlamaForCausalLM; every weight, norms included, is random."""
    config = transformers.LlamaConfig(
        vocab_size=67,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        rope_theta=1000.0,
        rope_scaling=scaling,
        tie_word_embeddings=tied,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(
                torch.randn(param.shape, generator=generator) * 0.1
                + (1.0 if param.dim() == 1 else 0.0)
            )
    return model.eval()


TOKENS = torch.randint(0, 67, (2, 24), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize(
    "tied,scaling,kv_heads,attn",
    [
        (False, None, 2, "eager"),
        (True, None, 2, "sdpa"),
        (False, LLAMA3_SCALING, 2, "sdpa"),
        (True, LLAMA3_SCALING, 8, "eager"),
    ],
)
def test_import_and_export_match_hf_logits(
    tied: bool, scaling: dict | None, kv_heads: int, attn: str
) -> None:
    hf = make_hf(tied, scaling, kv_heads, attn)
    cfg = hf_config_to_model_config(hf.config.to_dict())
    assert cfg.tie_embeddings is tied and (cfg.rope_scaling is None) is (scaling is None)
    ours = LlamaModel(cfg).eval()
    ours.load_state_dict(hf_to_megatron_het_state(hf.state_dict(), cfg), strict=True)
    with torch.no_grad():
        expected = hf(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), expected, atol=1e-4, rtol=1e-4)

    exported = megatron_het_to_hf_state(ours.state_dict(), cfg)
    hf_config = transformers.LlamaConfig.from_dict(
        model_config_to_hf_config(cfg), attn_implementation=attn
    )
    back = transformers.LlamaForCausalLM(hf_config).eval()
    result = back.load_state_dict(exported, strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if tied else [])
    for name, value in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, expected, atol=1e-4, rtol=1e-4)


def test_rope_scaling_changes_logits() -> None:
    """Guards the scaled-parity case above against a scaling that silently does nothing."""
    plain, scaled = make_hf(False, None), make_hf(False, LLAMA3_SCALING)
    with torch.no_grad():
        assert (plain(TOKENS).logits - scaled(TOKENS).logits).abs().max() > 1e-3


def test_gradients_match_hf() -> None:
    hf = make_hf(False, None, attn="sdpa").train()
    cfg = hf_config_to_model_config(hf.config.to_dict())
    ours = LlamaModel(cfg)
    ours.load_state_dict(hf_to_megatron_het_state(hf.state_dict(), cfg))
    labels = TOKENS.roll(-1, dims=1)
    F.cross_entropy(hf(TOKENS).logits.view(-1, 67), labels.view(-1)).backward()
    ours(TOKENS, labels).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    ours_as_hf = megatron_het_to_hf_state({n: p.grad for n, p in ours.named_parameters()}, cfg)
    for name, grad in ours_as_hf.items():
        torch.testing.assert_close(grad, hf_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_config_round_trip_and_legacy_keys() -> None:
    hf = make_hf(True, LLAMA3_SCALING)
    cfg = hf_config_to_model_config(hf.config.to_dict())
    exported = model_config_to_hf_config(cfg)
    assert exported["architectures"] == ["LlamaForCausalLM"]
    assert exported["rope_scaling"]["rope_type"] == "llama3"
    assert hf_config_to_model_config(exported) == cfg
    reparsed = transformers.LlamaConfig.from_dict(exported)
    assert hf_config_to_model_config(reparsed.to_dict()) == cfg
    legacy = {
        "model_type": "llama",
        "vocab_size": 67,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "rope_theta": 1000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "type": "llama3",
            **{k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"},
        },
    }
    assert (
        hf_config_to_model_config(legacy).replace(
            name=cfg.name, init_method_std=cfg.init_method_std
        )
        == cfg
    )


@pytest.mark.parametrize(
    "change,message",
    [
        ({"attention_bias": True}, "biases"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
        ({"head_dim": 16}, "head_dim"),
    ],
)
def test_unsupported_configs_are_user_errors(change: dict, message: str) -> None:
    config = {**make_hf(False, None).config.to_dict(), **change}
    config.pop("rope_parameters")
    with pytest.raises(UserError, match=message):
        hf_config_to_model_config(config)


def test_missing_or_extra_tensors_are_user_errors() -> None:
    hf = make_hf(False, None)
    cfg = hf_config_to_model_config(hf.config.to_dict())
    state = dict(hf.state_dict())
    state.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(UserError, match="lacks model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron_het_state(state, cfg)
    state = {**hf.state_dict(), "model.layers.2.mlp.up_proj.weight": torch.zeros(1)}
    with pytest.raises(UserError, match="unexpected tensor model.layers.2"):
        hf_to_megatron_het_state(state, cfg)
    state = {**hf.state_dict(), "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}
    with pytest.raises(UserError, match="unexpected tensor model.layers.0.self_attn.q_proj.bias"):
        hf_to_megatron_het_state(state, cfg)
