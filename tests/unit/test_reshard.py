"""Pure resharding functions: boxes, covering pieces, slice assembly, what each rank of a plan
holds and writes (checked against the models the plan builds and against shard_tensor)."""

from __future__ import annotations

import pytest
import torch

from megatron_het.checkpoint.reshard import (
    SavedPiece,
    assemble_slice,
    covering_pieces,
    intersect,
    rank_writes,
    stage_parameter_names,
    take_slice,
    target_slice,
    written_names,
)
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.model.llama import LlamaModel
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.tensor_parallel.sharding import parameter_shape, shard_tensor

CONFIG = ModelConfig(
    num_layers=4,
    hidden_size=16,
    ffn_hidden_size=32,
    num_attention_heads=8,
    num_query_groups=4,
    vocab_size=23,
    name="reshard-unit",
)
TIED = CONFIG.replace(tie_embeddings=True)


def plan(*pipelines: list[tuple[int, tuple[int, int], list[int]]]) -> ParallelPlan:
    """A plan from pipelines given as [(tp, layers, ranks), ...]."""
    return ParallelPlan.from_dict(
        {
            "format": "megatron_het.plan/1",
            "micro_batch_size": 1,
            "pipelines": [
                {
                    "micro_batches": 2,
                    "stages": [
                        {"accelerator": "cpu", "tp": tp, "layers": list(layers), "ranks": ranks}
                        for tp, layers, ranks in stages
                    ],
                }
                for stages in pipelines
            ],
        }
    )


PLANS = {
    "tp2xpp2": plan([(2, (0, 2), [0, 1]), (2, (2, 4), [2, 3])]),
    "pp3_tp211": plan([(2, (0, 1), [0, 1]), (1, (1, 3), [2]), (1, (3, 4), [3])]),
    "dp2xpp2": plan([(1, (0, 2), [0]), (1, (2, 4), [1])], [(1, (0, 2), [2]), (1, (2, 4), [3])]),
    "single": plan([(1, (0, 4), [0])]),
    "tp4": plan([(4, (0, 4), [0, 1, 2, 3])]),
}


def full_tensor(name: str, config: ModelConfig) -> torch.Tensor:
    shape = parameter_shape(name, config)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + len(name)


def test_intersect_and_covering() -> None:
    assert intersect(((0, 0), (4, 4)), ((2, 3), (4, 4))) == ((2, 3), (2, 1))
    assert intersect(((0,), (3,)), ((3,), (2,))) is None
    pieces = [
        SavedPiece((0, 0), (3, 8), "a"),
        SavedPiece((3, 0), (5, 8), "b"),
        SavedPiece((0, 0), (8, 8), "full"),
    ]
    assert [p.source for p in covering_pieces(pieces, (4, 0), (2, 8))] == ["b", "full"]
    assert [p.source for p in covering_pieces(pieces, (2, 0), (2, 8))] == ["a", "b", "full"]


def test_assemble_slice_across_uneven_pieces() -> None:
    full = torch.randn(23, 6)
    # saved by tp=3 over the vocabulary (8, 8, 7 rows); wanted: tp=2 slices (12, 11 rows).
    pieces = [
        (full[0:8].clone(), (0, 0)),
        (full[8:16].clone(), (8, 0)),
        (full[16:].clone(), (16, 0)),
    ]
    for offsets, shape in (((0, 0), (12, 6)), ((12, 0), (11, 6)), ((5, 2), (10, 3))):
        got = assemble_slice("w", (23, 6), offsets, shape, pieces)
        assert torch.equal(got, take_slice(full, offsets, shape))
        assert got.is_contiguous()
    # column pieces (row-parallel weights) and duplicated replicas
    cols = [(full[:, :3].clone(), (0, 0)), (full[:, 3:].clone(), (0, 3)), (full.clone(), (0, 0))]
    assert torch.equal(assemble_slice("w", (23, 6), (0, 0), (23, 6), cols), full)


def test_assemble_slice_rejects_gaps_and_outside_pieces() -> None:
    full = torch.randn(10, 4)
    with pytest.raises(UserError, match="only partly covered"):
        assemble_slice("w", (10, 4), (0, 0), (10, 4), [(full[:6], (0, 0))])
    with pytest.raises(UserError, match="only partly covered"):
        assemble_slice("w", (10, 4), (6, 0), (4, 4), [(full[:6], (0, 0))])
    with pytest.raises(UserError, match="lies outside"):
        assemble_slice("w", (10, 4), (0, 0), (10, 4), [(full, (1, 0))])


@pytest.mark.parametrize("config", [CONFIG, TIED], ids=["untied", "tied"])
def test_target_slice_matches_shard_tensor(config: ModelConfig) -> None:
    for name in stage_parameter_names(config, PLANS["single"].pipelines[0].stages[0]):
        full = full_tensor(name, config)
        for tp in (1, 2, 4):
            for tp_rank in range(tp):
                offsets, shape = target_slice(name, config, tp, tp_rank)
                assert torch.equal(
                    take_slice(full, offsets, shape), shard_tensor(name, full, config, tp, tp_rank)
                )


@pytest.mark.parametrize("config", [CONFIG, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_stage_names_match_the_built_stage(config: ModelConfig, plan_name: str) -> None:
    for pipeline in PLANS[plan_name].pipelines:
        for stage in pipeline.stages:
            with torch.device("meta"):
                model = LlamaModel(
                    config, stage.layers, has_embedding=stage.has_embedding, has_head=stage.has_head
                )
            assert sorted(stage_parameter_names(config, stage)) == sorted(
                n for n, _ in model.named_parameters()
            )


@pytest.mark.parametrize("config", [CONFIG, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_rank_writes_tile_every_parameter_exactly_once(config: ModelConfig, plan_name: str) -> None:
    chosen = PLANS[plan_name]
    all_names = stage_parameter_names(config, PLANS["single"].pipelines[0].stages[0])
    counts = {n: torch.zeros(parameter_shape(n, config), dtype=torch.int32) for n in all_names}
    for rank in range(chosen.world_size):
        for name, (offsets, shape) in rank_writes(config, chosen, rank).items():
            counts[name][tuple(slice(o, o + s) for o, s in zip(offsets, shape))] += 1
    for name, count in counts.items():
        assert bool((count == 1).all()), f"{plan_name}: {name} written {count.unique()} times"


def test_written_names_skip_replicas() -> None:
    last = PLANS["tp2xpp2"].pipelines[0].stages[1]
    assert "embedding.weight" in stage_parameter_names(TIED, last)
    assert "embedding.weight" not in written_names(TIED, last, 0)
    assert "final_norm.weight" in written_names(TIED, last, 0)
    assert "final_norm.weight" not in written_names(TIED, last, 1)
    assert "layers.2.mlp.up.weight" in written_names(TIED, last, 1)
