"""The planner's parts against the predictor: affine stage costs, the split, bounds, results."""

from __future__ import annotations

import itertools
import pathlib
import random

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, model_preset
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_validation import validate
from megatron_het.perf import SimulationCache, fits, predict
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.planner import evaluate_plan, homogeneous_baseline, kind_subcluster, search_plan
from megatron_het.planner.bounds import (
    KindCosts,
    memory_feasible,
    sync_lower_bound,
    time_lower_bound,
)
from megatron_het.planner.space import KindBlock, Layout, Placement, build_plan
from megatron_het.planner.stage_model import balance_layers, layer_caps, probe_stage_model
from tests.unit.papers_mix import papers_baseline, papers_cluster, papers_model

REPO = pathlib.Path(__file__).resolve().parents[2]
SEQ = 1024
MODEL = ModelConfig(
    name="t-12l",
    num_layers=12,
    hidden_size=2048,
    ffn_hidden_size=5632,
    num_attention_heads=16,
    num_query_groups=4,
    vocab_size=32000,
)
CLUSTER = {
    "name": "mix",
    "node_groups": [
        {
            "name": "h",
            "accelerator": "H100",
            "nodes": 2,
            "devices_per_node": 2,
            "nic_bandwidth_gbit_per_s": 400,
        },
        {
            "name": "m",
            "accelerator": "MI250X",
            "nodes": 2,
            "devices_per_node": 4,
            "nic_bandwidth_gbit_per_s": 200,
        },
    ],
}


@pytest.fixture(scope="module")
def cluster() -> ClusterSpec:
    return ClusterSpec.from_dict(CLUSTER)


def _layout(
    dp: int, blocks: tuple[KindBlock, ...], gbs: int = 16, mbs: int = 1, zero1: bool = True
) -> Layout:
    return Layout(dp, blocks, mbs, gbs // (dp * mbs), zero1 and dp > 1)


LAYOUTS = [
    _layout(2, (KindBlock("H100", 1, 2), KindBlock("MI250X", 2, 2))),
    _layout(2, (KindBlock("MI250X", 4, 1, recompute=True), KindBlock("H100", 2, 1)), mbs=2),
    _layout(1, (KindBlock("H100", 2, 2), KindBlock("MI250X", 1, 8)), zero1=False),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_stage_model_reproduces_the_closed_form_prediction(cluster, layout) -> None:
    placement, cache = Placement(cluster), SimulationCache()
    sm = probe_stage_model(MODEL, layout, placement, cluster, SEQ, None, "bf16", cache)
    rng = random.Random(0)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, MODEL.num_layers), layout.num_stages - 1))
        split = [b - a for a, b in zip([0, *cuts], [*cuts, MODEL.num_layers])]
        plan = build_plan(layout, split, placement, "bf16")
        validate(plan, MODEL, cluster, 16)
        closed = predict(MODEL, plan, cluster, SEQ, pipeline_model="closed_form")
        assert sm.iteration_time(split) == pytest.approx(closed.iteration_time_s, rel=1e-9)
        simulated = predict(MODEL, plan, cluster, SEQ, cache=cache)
        assert sm.simulated_time(split, cache) == pytest.approx(
            simulated.iteration_time_s, rel=1e-9
        )
        for s, row in enumerate(closed.stages[: layout.num_stages]):
            assert sm.memory[s](split[s]) == pytest.approx(row.memory.total_bytes, rel=1e-9)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_balanced_split_is_the_best_split_of_the_layout(cluster, layout) -> None:
    placement = Placement(cluster)
    sm = probe_stage_model(MODEL, layout, placement, cluster, SEQ, None, "bf16", SimulationCache())
    split = balance_layers(sm, MODEL.num_layers)
    caps = layer_caps(sm, MODEL.num_layers)
    best = min(
        sm.iteration_time(c)
        for c in itertools.product(*(range(1, cap + 1) for cap in caps))
        if sum(c) == MODEL.num_layers
    )
    assert split is not None and sum(split) == MODEL.num_layers
    assert sm.iteration_time(split) <= best * 1.001


def test_lower_bounds_hold(cluster) -> None:
    placement, cache = Placement(cluster), SimulationCache()
    costs = KindCosts(MODEL, cluster, placement, SEQ, None, "bf16", cache)
    for layout in LAYOUTS:
        sm = probe_stage_model(MODEL, layout, placement, cluster, SEQ, None, "bf16", cache)
        split = balance_layers(sm, MODEL.num_layers)
        assert memory_feasible(layout, costs, MODEL.num_layers)
        bound = time_lower_bound(layout, costs, MODEL.num_layers)
        assert bound <= sm.iteration_time(split)
        sync = sync_lower_bound(layout, costs, MODEL.num_layers, CommCost(cluster))
        assert (sync > 0) == (layout.dp > 1)
        assert bound + sync <= sm.iteration_time(split)
    tiny = ClusterSpec.from_dict(
        {**CLUSTER, "accelerators": {"H100": {"memory_gib": 0.5}, "MI250X": {"memory_gib": 0.5}}}
    )
    tiny_costs = KindCosts(MODEL, tiny, Placement(tiny), SEQ, None, "bf16", cache)
    assert not memory_feasible(LAYOUTS[0], tiny_costs, MODEL.num_layers)


def test_search_result_is_valid_node_local_and_balanced_by_speed(cluster) -> None:
    result = search_plan(MODEL, cluster, 16, SEQ, top_k=3)
    assert result.baseline is None and result.efficiency is None
    result = result.with_baseline(homogeneous_baseline(MODEL, cluster, 16, SEQ))
    plan = result.plan
    validate(plan, MODEL, cluster, 16)
    assert fits(result.prediction, cluster).ok
    assert ParallelPlan.from_dict(plan.to_dict()) == plan
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            assert len({cluster.rank_info(r).node for r in stage.ranks}) == 1
    times = [c.prediction.iteration_time_s for c in result.candidates]
    assert times == sorted(times) and result.prediction is result.candidates[0].prediction
    assert result.efficiency == pytest.approx(
        result.prediction.tokens_per_s / result.baseline.tokens_per_s
    )


def test_homogeneous_cluster_is_its_own_baseline() -> None:
    cluster = ClusterSpec.from_dict(
        {
            "name": "h",
            "node_groups": [
                {
                    "name": "h",
                    "accelerator": "H100",
                    "nodes": 2,
                    "devices_per_node": 4,
                    "nic_bandwidth_gbit_per_s": 400,
                }
            ],
        }
    )
    result = search_plan(MODEL, cluster, 32, SEQ)
    result = result.with_baseline(homogeneous_baseline(MODEL, cluster, 32, SEQ))
    assert result.efficiency == pytest.approx(1.0, rel=1e-9)


def test_kind_subcluster_keeps_one_kind_and_uncolocates() -> None:
    cluster = ClusterSpec.load(REPO / "scripts/clusters/cpu_emulated.yaml")
    slow = kind_subcluster(cluster, "emu-slow")
    assert slow.accelerator_counts() == {"emu-slow": 2} and slow.num_nodes == 1
    fast = kind_subcluster(cluster, "emu-fast")
    assert fast.accelerator_counts() == {"emu-fast": 2}


@pytest.mark.slow
def test_hethub_mix_is_efficient() -> None:
    result = search_plan(papers_model(), papers_cluster(), 1024, 4096, top_k=2)
    result = result.with_baseline(papers_baseline())
    # The baseline interleaves accelerator A alone over 10 device groups in micro-batch
    # groups (151 tokens/s per device, 6% above its best plain pipeline); the mix's plan
    # interleaves too, and the MI250X groups' coarse layer granularity costs it a few percent.
    assert result.efficiency >= 0.96
    assert result.prediction.bubble_fraction <= 0.05
    kinds = {s.accelerator for s in result.plan.pipelines[0].stages}
    assert kinds == {"MI250X", "accelerator-a"}
    # Layers follow speed: no stage's 1F1B work is far above the typical stage's.
    work = sorted(s.forward_s + s.backward_s for s in result.prediction.stages)
    assert work[-1] <= 1.05 * work[len(work) // 2]


def test_cluster_that_cannot_hold_the_model_says_the_shortfall() -> None:
    cluster = ClusterSpec.from_dict(
        {
            "name": "small",
            "node_groups": [
                {
                    "name": "a",
                    "accelerator": "A100-40G",
                    "nodes": 1,
                    "devices_per_node": 2,
                    "nic_bandwidth_gbit_per_s": 200,
                },
                {
                    "name": "m",
                    "accelerator": "MI250X",
                    "nodes": 1,
                    "devices_per_node": 2,
                    "nic_bandwidth_gbit_per_s": 200,
                },
            ],
        }
    )
    with pytest.raises(UserError) as info:
        search_plan(model_preset("llama2-70b"), cluster, 8, 4096)
    message = str(info.value)
    assert "\n" not in message and "cannot hold llama2-70b" in message
    assert "GiB per" in message and "add devices" in message and "recompute" in message


def test_evaluate_refuses_a_plan_for_another_cluster(cluster) -> None:
    other = ClusterSpec.from_dict(
        {
            "name": "h",
            "node_groups": [
                {
                    "name": "h",
                    "accelerator": "H100",
                    "nodes": 1,
                    "devices_per_node": 4,
                    "nic_bandwidth_gbit_per_s": 400,
                }
            ],
        }
    )
    plan = search_plan(MODEL, other, 8, SEQ).plan
    with pytest.raises(UserError, match="are on no stage"):
        evaluate_plan(MODEL, cluster, plan, SEQ)
    again = evaluate_plan(MODEL, other, plan, SEQ, with_baseline=False)
    assert again.prediction.iteration_time_s == pytest.approx(
        predict(MODEL, plan, other, SEQ).iteration_time_s
    )


def _uneven_nodes_cluster() -> ClusterSpec:
    return ClusterSpec.from_dict(
        {
            "name": "uneven",
            "node_groups": [
                {
                    "name": "a",
                    "accelerator": "H100",
                    "nodes": 2,
                    "devices_per_node": 8,
                    "nic_bandwidth_gbps": 50,
                },
                {
                    "name": "b",
                    "accelerator": "H100",
                    "nodes": 1,
                    "devices_per_node": 4,
                    "nic_bandwidth_gbps": 50,
                },
                {
                    "name": "c",
                    "accelerator": "A100-80G",
                    "nodes": 3,
                    "devices_per_node": 4,
                    "nic_bandwidth_gbps": 25,
                },
            ],
        }
    )


@pytest.mark.parametrize(
    "cluster", [_uneven_nodes_cluster(), papers_cluster()], ids=["uneven nodes", "hethub"]
)
def test_node_locality_matches_a_rank_by_rank_check(cluster) -> None:
    placement = Placement(cluster)
    node = placement.node_of
    for kind in placement.kinds:
        ranks = placement.ranks_of[kind]
        for dp in (d for d in range(1, 9) if len(ranks) % d == 0):
            share = len(ranks) // dp
            for parts in ([(t, share // t)] for t in (1, 2, 4, 8, 16) if share % t == 0):
                start, local = 0, True
                for _ in range(dp):
                    for tp, stages in parts:
                        for _ in range(stages):
                            local &= len({node[r] for r in ranks[start : start + tp]}) == 1
                            start += tp
                assert placement.split_local(kind, dp, parts) == local, (kind, dp, parts)


@pytest.mark.slow  # twelve predictions over 768 devices
def test_a_shared_communication_model_prices_plans_as_a_fresh_one() -> None:
    cluster = papers_cluster()
    model = papers_model()
    placement = Placement(cluster)
    shared = CommCost(cluster)
    layouts = [
        Layout(8, (KindBlock("MI250X", 8, 2), KindBlock("accelerator-a", 4, 20)), 1, 128, True),
        Layout(
            8,
            (KindBlock("accelerator-a", 8, 10), KindBlock("MI250X", 4, 4)),
            2,
            64,
            True,
            sequence_parallel=True,
        ),
        Layout(
            4,
            (KindBlock("MI250X", 8, 4), KindBlock("accelerator-a", 8, 20)),
            1,
            240,
            True,
            num_chunks=2,
        ),
    ]
    for layout in layouts:
        for layers in ([4] * layout.num_stages, [2] * layout.num_stages):
            plan = build_plan(layout, layers, placement, "bf16")
            fresh = predict(model, plan, cluster, 4096, validate=False)
            again = predict(model, plan, cluster, 4096, validate=False, comm=shared)
            assert again == fresh


def test_planned_plans_equal_the_same_plans_built_and_checked_from_their_files() -> None:
    cluster, placement = papers_cluster(), Placement(papers_cluster())
    for layout, layers in (
        (
            Layout(8, (KindBlock("MI250X", 8, 2), KindBlock("accelerator-a", 4, 20)), 1, 128, True),
            [4] * 22,
        ),
        (
            Layout(
                4,
                (KindBlock("MI250X", 8, 4), KindBlock("accelerator-a", 8, 20)),
                1,
                240,
                True,
                num_chunks=2,
                sequence_parallel=True,
            ),
            [4] * 20 + [2] * 4,
        ),
    ):
        plan = build_plan(layout, layers, placement, "bf16")
        again = ParallelPlan.from_dict(plan.to_dict())
        assert again == plan and hash(again) == hash(plan)
        assert [p.device_groups for p in again.pipelines] == [
            p.device_groups for p in plan.pipelines
        ]
        validate(plan, papers_model(), cluster, plan.global_batch_size)


def test_fill_and_cycles_bound_is_below_every_split_and_above_the_loose_bound() -> None:
    """The tight pipeline bound: at most the least closed form over integer splits (no fixed
    costs), at least the loose bound it replaces."""
    import itertools
    import random

    from megatron_het.planner.bounds import fill_and_cycles_bound

    rng = random.Random(0)
    for _ in range(300):
        p, m = rng.randint(1, 4), rng.randint(1, 12)
        layers = rng.randint(p, 9)
        work = [rng.uniform(0.2, 3.0) for _ in range(p)]
        best = min(
            sum(w * n for w, n in zip(work, split))
            + (m - 1) * max(w * n for w, n in zip(work, split))
            for split in itertools.product(range(1, layers + 1), repeat=p)
            if sum(split) == layers
        )
        bound = fill_and_cycles_bound(work, layers, m)
        loose = layers * min(work) + (m - 1) * layers / sum(1 / w for w in work)
        assert loose * (1 - 1e-9) <= bound <= best * (1 + 1e-9)


def test_capped_bottleneck_is_below_every_split_within_the_rooms() -> None:
    """The interleaved bound's busiest group under memory: at most the least busiest stage of
    any integer split that keeps each stage within its room, and at least the uncapped one."""
    import itertools
    import math
    import random

    from megatron_het.planner.bounds import capped_bottleneck

    rng = random.Random(1)
    for _ in range(300):
        p, layers = rng.randint(1, 4), rng.randint(4, 10)
        work = [rng.uniform(0.2, 3.0) for _ in range(p)]
        room = [rng.uniform(0.5, 6.0) for _ in range(p)]
        splits = [
            split
            for split in itertools.product(range(layers + 1), repeat=p)
            if sum(split) == layers and all(n <= r for n, r in zip(split, room))
        ]
        bound = capped_bottleneck(work, room, layers)
        if not splits:
            assert sum(room) < layers or bound < math.inf
            continue
        best = min(max(w * n for w, n in zip(work, split)) for split in splits)
        assert layers / sum(1 / w for w in work) * (1 - 1e-9) <= bound <= best * (1 + 1e-9)
    assert capped_bottleneck([1.0, 1.0], [1.0, 2.0], 4) == math.inf
    # room caps the cheap stage, so the dear one must take the rest
    assert capped_bottleneck([1.0, 4.0], [1.0, 9.0], 4) == pytest.approx(12.0, rel=1e-6)
