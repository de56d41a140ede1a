"""Heterogeneous data parallelism in the planner: replicas of one kind each, batch shared by
speed (megatron_het.planner.kind_replicas). The brute-force comparison is in
test_planner_bruteforce.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_validation import validate
from megatron_het.perf import SimulationCache, fits, predict
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.planner.batch_shares import allocate, exact_shares, shares_by_speed
from megatron_het.planner.kind_replicas import (
    ReplicaLayout,
    ReplicaSearch,
    _Option,
    _with_replica_buffers,
)
from megatron_het.planner.search import search_plan
from megatron_het.planner.space import KindBlock, Layout, Placement
from megatron_het.planner.stage_model import probe_stage_model

SEQ = 1024
MODEL = ModelConfig(
    name="kr-4l",
    num_layers=4,
    hidden_size=2048,
    ffn_hidden_size=5632,
    num_attention_heads=16,
    num_query_groups=4,
    vocab_size=32000,
)


def _cluster(fast: int = 4, slow: int = 3) -> ClusterSpec:
    """Device counts with no common divisor above 1: uniform replicas must mix the kinds."""

    def group(name: str, kind: str, n: int) -> dict:
        return {
            "name": name,
            "accelerator": kind,
            "nodes": 1,
            "devices_per_node": n,
            "nic_bandwidth_gbit_per_s": 3200,
        }

    return ClusterSpec.from_dict(
        {"name": "odd", "node_groups": [group("h", "H100", fast), group("m", "MI250X", slow)]}
    )


def _option(dp: int, fixed: float, per: float, sync: float = 0.0) -> _Option:
    layout = Layout(dp, (KindBlock("k", 1, 1),), 1, 1, False)
    return _Option(layout, (1,), fixed, per, sync)


def test_exact_shares_fill_the_batch_within_the_caps() -> None:
    assert exact_shares([2, 1], [5, 10], 12) == [5, 2]
    assert exact_shares([2, 3], [10, 10], 7) == [2, 1]
    assert exact_shares([2, 2], [10, 10], 7) is None  # odd total, even replicas
    assert exact_shares([1, 1], [3, 3], 7) is None  # over the caps
    for dps, caps, total in (([3, 2, 5], [4, 6, 2], 22), ([1, 4], [9, 2], 13)):
        shares = exact_shares(dps, caps, total)
        assert shares is not None
        assert sum(d * m for d, m in zip(dps, shares)) == total
        assert all(1 <= m <= c for m, c in zip(shares, caps))


def test_shares_by_speed_balance_the_replicas() -> None:
    # kind a: 1 replica at 1 s per micro-batch; kind b: 1 replica at 3 s: a takes 3 of 4
    picks = shares_by_speed([[_option(1, 0.0, 1.0)], [_option(1, 0.0, 3.0)]], 4)
    assert picks is not None and [m for _, m in picks] == [3, 1]
    # a faster layout of a kind wins: 2 replicas at 1 s beat 1 replica at 0.8 s
    fast = [_option(1, 0.0, 0.8), _option(2, 0.0, 1.0)]
    picks = shares_by_speed([fast, [_option(1, 0.0, 4.0)]], 9)
    assert picks is not None
    (a, ma), (_, mb) = picks
    assert a.layout.dp == 2 and 2 * ma + mb == 9 and max(ma * 1.0, mb * 4.0) <= 4.0


def test_allocate_trades_pipeline_time_for_sync() -> None:
    # the quicker pipeline syncs longer: 0.5 s more sync against 1 s less pipeline
    quick, lean = _option(1, 0.0, 1.0, sync=1.0), _option(1, 0.0, 1.5, sync=0.5)
    found = allocate([[quick, lean], [_option(1, 0.0, 2.0, sync=0.0)]], 3)
    assert found is not None
    picks, time = found
    assert picks[0][0] is quick and time == pytest.approx(2.0 + 1.0)  # 2 + 1 beats 3 + 0.5


def test_replica_buffers_are_the_memory_the_predictor_counts() -> None:
    """A kind's stage model (memory raised by the full-size replica buffers) holds at least
    what the prediction of the assembled heterogeneous plan holds on that kind's devices, and
    over-counts by no more than the buffers, one more set of activations (the predictor
    allocates the buffers after the last backward has freed the activations; the stage model
    keeps both, to stay affine in layers, and counts a full pipeline in flight) and, under
    ZeRO-1 across the replicas, the optimizer state the other replicas own (the stage model
    of a kind's part leaves it unsharded)."""
    cluster = _cluster()
    result = search_plan(MODEL, cluster, 12, SEQ)
    layout = result.candidates[0].layout
    assert isinstance(layout, ReplicaLayout)
    search = ReplicaSearch(
        MODEL,
        cluster,
        Placement(cluster),
        12,
        SEQ,
        None,
        "bf16",
        True,
        SimulationCache(),
        CommCost(cluster),
    )
    search._families(16)  # builds the kinds
    plan_dp, zero1 = result.plan.dp_size, bool(result.plan.use_distributed_optimizer)
    pipeline = 0
    for kind, part in zip(search._kinds, layout.parts):
        probe = replace(part.layout, micro_batches=part.layout.num_stages)
        sm = _with_replica_buffers(
            probe_stage_model(
                MODEL,
                probe,
                kind.placement,
                kind.cluster,
                SEQ,
                None,
                "bf16",
                SimulationCache(),
                kind.comm,
            ),
            MODEL,
        )
        rows = [r for r in result.prediction.stages if r.pipeline == pipeline]
        for s, n in enumerate(part.layers):
            held = rows[s].memory
            assert held.replica_sync_bytes > 0
            assert held.total_bytes <= sm.memory[s](n) * (1 + 1e-6)
            others = held.optimizer_bytes * (plan_dp - 1) if zero1 else 0.0
            assert sm.memory[s](n) <= (
                held.total_bytes + held.replica_sync_bytes + held.activation_bytes + others
            ) * (1 + 1e-6)
        pipeline += part.layout.dp


def test_planner_shares_the_batch_by_speed_when_no_divisor_is_common() -> None:
    cluster = _cluster()
    result = search_plan(MODEL, cluster, 12, SEQ)
    layout = result.candidates[0].layout
    assert isinstance(layout, ReplicaLayout), layout.describe()
    plan = ParallelPlan.from_dict(result.plan.to_dict())
    validate(plan, MODEL, cluster, 12)
    assert fits(result.prediction, cluster).ok
    # every replica is one kind, the faster kind runs more micro-batches per replica
    kinds = [{s.accelerator for s in p.stages} for p in plan.pipelines]
    assert all(len(k) == 1 for k in kinds)
    share = {k.pop(): p.micro_batches for k, p in zip(kinds, plan.pipelines)}
    assert share["H100"] > share["MI250X"]
    assert sum(p.micro_batches for p in plan.pipelines) * plan.micro_batch_size == 12
    # the prediction is the predictor's own, and better than any same-pipeline plan
    again = predict(MODEL, plan, cluster, SEQ)
    assert again.iteration_time_s == pytest.approx(result.prediction.iteration_time_s)
    uniform = search_plan(MODEL, cluster, 12, SEQ, heterogeneous_dp=False)
    assert not any(isinstance(c.layout, ReplicaLayout) for c in uniform.candidates)
    assert result.prediction.iteration_time_s < uniform.prediction.iteration_time_s


def test_one_kind_has_no_replica_family() -> None:
    cluster = ClusterSpec.from_dict(
        {
            "name": "one",
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
    search = ReplicaSearch(
        MODEL,
        cluster,
        Placement(cluster),
        8,
        SEQ,
        None,
        "bf16",
        True,
        SimulationCache(),
        CommCost(cluster),
    )
    assert search.candidates(16, 5) == [] and search.probes == 0
