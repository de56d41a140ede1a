"""The planner's block recompute: a plan that fits only with recompute recomputes the fewest
layers per stage with which it still fits (Megatron's --recompute-method block)."""

from __future__ import annotations

import dataclasses

from megatron_het.cluster import ClusterSpec
from megatron_het.config import model_preset
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_builders import plan_from_megatron_flags
from megatron_het.parallel.plan_validation import validate
from megatron_het.perf import fits, predict
from megatron_het.planner import search_plan
from megatron_het.planner.recompute_polish import relax_recompute, with_block_recompute

# llama3-8b on 4 x A100-40G, TP 2 x PP 2, seq 4096: the weights and Adam state leave too
# little memory for every layer's activations, enough for some of them.
CLUSTER = ClusterSpec.from_dict(
    {
        "name": "a100x4",
        "node_groups": [
            {
                "name": "a",
                "accelerator": "A100-40G",
                "nodes": 1,
                "devices_per_node": 4,
                "nic_bandwidth_gbit_per_s": 200,
            }
        ],
    }
)
MODEL = model_preset("llama3-8b")
SEQ = 4096


def _plan(recompute: bool) -> ParallelPlan:
    plan = plan_from_megatron_flags(
        MODEL, 4, 2, 2, 1, 64, accelerator_of=CLUSTER, recompute=recompute
    )
    return dataclasses.replace(plan, dtype="bf16", use_distributed_optimizer=True)


def _predict(plan: ParallelPlan):
    return predict(MODEL, plan, CLUSTER, SEQ)


def _fits(prediction) -> bool:
    return fits(prediction, CLUSTER).ok


def test_the_fewest_recomputed_layers_that_fit_are_chosen() -> None:
    full = _plan(True)
    assert not _fits(_predict(_plan(False))) and _fits(_predict(full))
    plan, prediction = relax_recompute(full, _predict, _fits, _predict(full))
    counts = {stage.recompute_num_layers for stage in plan.pipelines[0].stages}
    assert len(counts) == 1
    n = counts.pop()
    assert 0 < n < 16 and all(stage.recompute for stage in plan.pipelines[0].stages)
    assert _fits(prediction) and prediction.iteration_time_s < _predict(full).iteration_time_s
    assert not _fits(_predict(with_block_recompute(full, "A100-40G", n - 1)))  # the fewest
    validate(plan, MODEL, CLUSTER, 64, SEQ)
    again = ParallelPlan.from_dict(plan.to_dict())
    assert [s.recomputed_layers for s in again.pipelines[0].stages] == [n, n]


def test_block_recompute_of_zero_layers_turns_recompute_off_and_others_are_kept() -> None:
    full = _plan(True)
    off = with_block_recompute(full, "A100-40G", 0)
    assert not any(stage.recompute for stage in off.pipelines[0].stages)
    assert off.pipelines[0].stages[0].recompute_num_layers is None
    assert with_block_recompute(full, "A100-40G", 99) == full  # more than a stage holds: all
    assert with_block_recompute(full, "H100", 3) == full  # another kind's stages only


def test_a_plan_that_fits_without_recompute_drops_it() -> None:
    roomy = ClusterSpec.from_dict(
        {
            "name": "a100x4",
            "node_groups": [
                {
                    "name": "a",
                    "accelerator": "A100-80G",
                    "nodes": 1,
                    "devices_per_node": 4,
                    "nic_bandwidth_gbit_per_s": 200,
                }
            ],
        }
    )
    full = plan_from_megatron_flags(MODEL, 4, 2, 2, 1, 64, accelerator_of=roomy, recompute=True)
    full = dataclasses.replace(full, dtype="bf16", use_distributed_optimizer=True)

    def predict_roomy(plan):
        return predict(MODEL, plan, roomy, SEQ)

    plan, _ = relax_recompute(full, predict_roomy, lambda p: fits(p, roomy).ok, predict_roomy(full))
    assert not any(stage.recompute for stage in plan.pipelines[0].stages)


def test_the_planner_recomputes_only_what_memory_needs() -> None:
    result = search_plan(MODEL, CLUSTER, 64, SEQ, top_k=2)
    stages = [stage for pipeline in result.plan.pipelines for stage in pipeline.stages]
    assert _fits(result.prediction)
    recomputing = [stage for stage in stages if stage.recompute]
    assert recomputing  # it does not fit without
    # some stage keeps activations of layers a full recompute would drop
    assert any(stage.recomputed_layers < stage.num_layers for stage in recomputing)
    full = dataclasses.replace(
        result.plan,
        pipelines=tuple(
            dataclasses.replace(
                p, stages=tuple(dataclasses.replace(s, recompute_num_layers=None) for s in p.stages)
            )
            for p in result.plan.pipelines
        ),
    )
    assert result.prediction.iteration_time_s < predict(MODEL, full, CLUSTER, SEQ).iteration_time_s
