"""Shard specs per global parameter name: round trips, layouts, errors (no processes)."""

from __future__ import annotations

import pytest
import torch

from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.model.llama import LlamaModel
from megatron_het.tensor_parallel.sharding import (
    ShardSpec,
    parameter_shape,
    shard_spec,
    shard_tensor,
    unshard,
    vocab_range,
)

GQA = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=8,
    num_query_groups=4,
    vocab_size=250,
)
TIED = GQA.replace(tie_embeddings=True, vocab_size=251)


def _names(config: ModelConfig) -> list[str]:
    with torch.device("meta"):
        model = LlamaModel(config)
    return [name for name, _ in model.named_parameters()]


@pytest.mark.parametrize("config", [GQA, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_every_parameter(config: ModelConfig, tp: int) -> None:
    with torch.device("meta"):
        model = LlamaModel(config)
    for name, param in model.named_parameters():
        assert parameter_shape(name, config) == tuple(param.shape)
        full = torch.randn(param.shape)
        spec = shard_spec(name, config, tp)
        shards = [shard_tensor(name, full, config, tp, r) for r in range(tp)]
        for r, shard in enumerate(shards):
            assert tuple(shard.shape) == spec.shard_shape(full.shape, r)
            assert shard.is_contiguous() and shard.data_ptr() != full.data_ptr()
            index = [slice(None)] * full.dim()
            if not spec.replicated:
                start, stop = spec.bounds(r)
                index[spec.dim] = slice(start, stop)
                offsets = spec.offsets(r, full.dim())
                assert offsets[spec.dim] == start and sum(offsets) == start
            assert torch.equal(shard, full[tuple(index)])
        assert torch.equal(unshard(name, shards, config, tp), full)


def test_split_dims_by_parameter() -> None:
    dims = {
        name.split(".", 2)[-1] if name.startswith("layers.") else name: shard_spec(name, GQA, 2).dim
        for name in _names(GQA)
    }
    assert dims == {
        "embedding.weight": 0,
        "output.weight": 0,
        "final_norm.weight": None,
        "input_norm.weight": None,
        "post_attention_norm.weight": None,
        "attention.qkv.weight": 0,
        "attention.proj.weight": 1,
        "mlp.gate.weight": 0,
        "mlp.up.weight": 0,
        "mlp.down.weight": 1,
    }


def test_qkv_shard_holds_whole_kv_groups() -> None:
    """Rank r's qkv rows are exactly kv groups [r*ng/tp, (r+1)*ng/tp) of the grouped layout."""
    nh, ng, d, tp = 8, 4, GQA.kv_channels, 2
    full = torch.randn(parameter_shape("layers.1.attention.qkv.weight", GQA))
    # Label every row with (group, slot): slots 0..r-1 query heads, r key, r+1 value.
    grouped = full.view(ng, nh // ng + 2, d, -1)
    for r in range(tp):
        shard = shard_tensor("layers.1.attention.qkv.weight", full, GQA, tp, r)
        groups = grouped[r * ng // tp : (r + 1) * ng // tp]
        assert torch.equal(shard, groups.reshape(-1, full.shape[1]))
    proj = torch.randn(parameter_shape("layers.0.attention.proj.weight", GQA))
    heads_per_rank = nh // tp
    shard = shard_tensor("layers.0.attention.proj.weight", proj, GQA, tp, 1)
    assert torch.equal(shard, proj[:, heads_per_rank * d : 2 * heads_per_rank * d])


def test_vocabulary_is_split_unevenly_without_padding() -> None:
    assert shard_spec("embedding.weight", TIED, 4) == ShardSpec(0, (63, 63, 63, 62))
    assert [vocab_range(251, 4, r) for r in range(4)] == [
        (0, 63),
        (63, 126),
        (126, 189),
        (189, 251),
    ]
    assert shard_spec("output.weight", GQA, 4).sizes == (63, 63, 62, 62)


def test_errors() -> None:
    with pytest.raises(UserError, match="tp=3 does not divide the model's 8 attention heads"):
        shard_spec("final_norm.weight", GQA, 3)
    with pytest.raises(UserError, match="4 query groups"):
        shard_spec("final_norm.weight", GQA, 8)
    with pytest.raises(ValueError, match="unknown parameter name"):
        shard_spec("layers.0.attention.q.weight", GQA, 2)
    with pytest.raises(ValueError, match="unknown parameter name"):
        parameter_shape("layers.final_norm.weight", GQA)
    full = torch.randn(parameter_shape("layers.0.mlp.down.weight", GQA))
    with pytest.raises(ValueError, match="expected"):
        shard_tensor("layers.0.mlp.up.weight", full, GQA, 2, 0)
    shards = [shard_tensor("layers.0.mlp.down.weight", full, GQA, 2, r) for r in range(2)]
    with pytest.raises(ValueError, match="got 2 shards for tp=4"):
        unshard("layers.0.mlp.down.weight", shards, GQA, 4)
    with pytest.raises(ValueError, match="shard 1 has shape"):
        unshard("layers.0.mlp.down.weight", [shards[0], shards[0].t()], GQA, 2)
