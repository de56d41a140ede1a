"""The planner's interleaved layouts: their per-group stage model against the predictor, the
bounds, and searched interleaved plans (group counts that divide the micro-batches or not)."""

from __future__ import annotations

import random

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.parallel.plan_validation import validate
from megatron_het.perf import SimulationCache, fits, predict
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.planner.bounds import (
    KindCosts,
    memory_feasible,
    sync_lower_bound,
    time_lower_bound,
)
from megatron_het.planner.search import search_plan
from megatron_het.planner.space import KindBlock, Layout, Placement, build_plan
from megatron_het.planner.stage_model import balance_layers, probe_stage_model
from tests.unit.test_planner_search import CLUSTER, MODEL, SEQ


@pytest.fixture(scope="module")
def cluster() -> ClusterSpec:
    return ClusterSpec.from_dict(CLUSTER)


LAYOUTS = [  # dp=2: 2 H100 and 4 MI250X per pipeline, 16 sequences of 1 -> m = 8
    Layout(2, (KindBlock("H100", 1, 2), KindBlock("MI250X", 2, 2)), 1, 8, True, 2),
    Layout(
        2,
        (KindBlock("MI250X", 2, 1), KindBlock("MI250X", 1, 2), KindBlock("H100", 2, 1)),
        1,
        8,
        True,
        2,
        sequence_parallel=True,
    ),
    Layout(1, (KindBlock("H100", 2, 2), KindBlock("MI250X", 4, 2)), 2, 8, False, 3),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_group_model_reproduces_the_interleaved_closed_form(cluster, layout) -> None:
    placement, cache = Placement(cluster), SimulationCache()
    sm = probe_stage_model(MODEL, layout, placement, cluster, SEQ, None, "bf16", cache)
    v, p = layout.num_chunks, layout.num_stages
    rng = random.Random(1)
    for _trial in range(6):
        split = [v] * p
        for _ in range(MODEL.num_layers - v * p):
            split[rng.randrange(p)] += 1
        plan = build_plan(layout, split, placement, "bf16")
        assert plan.pipelines[0].num_chunks == v
        validate(plan, MODEL, cluster, 16, seq_length=SEQ)
        closed = predict(MODEL, plan, cluster, SEQ, pipeline_model="closed_form")
        assert sm.iteration_time(split) == pytest.approx(closed.iteration_time_s, rel=1e-9)
        if all(n % v == 0 for n in split):  # uniform chunks: the memory line is exact
            for g in range(p):
                assert sm.memory[g](split[g]) == pytest.approx(
                    closed.stages[g].memory.total_bytes, rel=1e-9
                )


def test_interleaved_bounds_hold(cluster) -> None:
    placement, cache = Placement(cluster), SimulationCache()
    costs = KindCosts(MODEL, cluster, placement, SEQ, None, "bf16", cache)
    for layout in LAYOUTS:
        sm = probe_stage_model(MODEL, layout, placement, cluster, SEQ, None, "bf16", cache)
        split = balance_layers(sm, MODEL.num_layers)
        assert split is not None and min(split) >= layout.num_chunks
        assert memory_feasible(layout, costs, MODEL.num_layers)
        bound = time_lower_bound(layout, costs, MODEL.num_layers)
        sync = sync_lower_bound(layout, costs, MODEL.num_layers, CommCost(cluster))
        assert 0 < bound + sync <= sm.iteration_time(split)


def test_search_tries_interleaving_and_its_plans_run(cluster) -> None:
    # A model whose compute outweighs the transfers, so interleaved layouts are competitive
    big = ModelConfig(
        name="t-16l",
        num_layers=16,
        hidden_size=4096,
        ffn_hidden_size=11008,
        num_attention_heads=32,
        num_query_groups=8,
        vocab_size=32000,
    )
    plain = search_plan(big, cluster, 16, 4096, top_k=3, max_virtual_stages=1)
    assert all(c.layout.num_chunks == 1 for c in plain.candidates)
    found = search_plan(big, cluster, 16, 4096, top_k=8, max_virtual_stages=3)
    assert found.prediction.iteration_time_s <= plain.prediction.iteration_time_s * (1 + 1e-9)
    interleaved = [c for c in found.candidates if c.layout.num_chunks > 1]
    assert interleaved
    for candidate in found.candidates:
        validate(candidate.plan, big, cluster, 16, seq_length=4096)
        assert fits(candidate.prediction, cluster).ok
        pipeline = candidate.plan.pipelines[0]
        assert pipeline.num_chunks == candidate.layout.num_chunks
        assert pipeline.micro_batches >= pipeline.pp_size or pipeline.num_chunks == 1
    # group counts that do not divide the micro-batches (micro-batch groups) are searched too
    assert any(c.plan.pipelines[0].micro_batches % c.plan.pipelines[0].pp_size for c in interleaved)


def test_finalists_move_layers_between_chunks() -> None:
    """2 H100 + 2 A100 and 4 sequences: the best plan interleaves 2 chunks per tp=2 group, and
    the chunk beside the head holds less than an even deal would give it."""
    small = ClusterSpec.from_dict(
        {
            "name": "chunks",
            "node_groups": [
                {
                    "name": "h",
                    "accelerator": "H100",
                    "nodes": 1,
                    "devices_per_node": 2,
                    "nic_bandwidth_gbit_per_s": 400,
                },
                {
                    "name": "a",
                    "accelerator": "A100-80G",
                    "nodes": 1,
                    "devices_per_node": 2,
                    "nic_bandwidth_gbit_per_s": 400,
                },
            ],
        }
    )
    model = MODEL.replace(num_layers=6)
    found = search_plan(model, small, 4, SEQ)
    pipeline = found.plan.pipelines[0]
    assert pipeline.num_chunks == 2
    sizes = [st.num_layers for st in pipeline.stages]
    assert sizes == [1, 3, 1, 1]
    even = build_plan(found.candidates[0].layout, [2, 4], Placement(small), "bf16")
    assert [st.num_layers for st in even.pipelines[0].stages] == [1, 2, 1, 2]
    assert found.prediction.iteration_time_s < predict(model, even, small, SEQ).iteration_time_s
    assert found.candidates[0].layers == (2, 4)  # per device group
