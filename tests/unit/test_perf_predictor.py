"""The predictor end to end: identities, hand-checked stage terms, monotonicity, llama-140b."""

import json

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.perf import Profile, ProfileConditions, check_fits, fits, predict
from megatron_het.perf.cost.comm_time import CommCost, broadcast_time, p2p_time
from megatron_het.perf.cost.roofline import (
    LayerShape,
    embedding_forward_ops,
    layer_forward_ops,
    ops_time,
)
from megatron_het.perf.measure.profile_format import LayerEntry
from megatron_het.perf.schedule.closed_forms import closed_form_1f1b

TINY = model_preset("tiny")
SEQ = 64


@pytest.fixture(scope="module")
def emulated():
    return ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")


@pytest.fixture(scope="module")
def three_stage():
    return ParallelPlan.load("scripts/plans/cpu_emulated_3stage.json")


def two_pipelines(micro_batches=4, recompute=False):
    """dp=2: pipeline 0 on the emu-fast ranks 0-1, pipeline 1 on the emu-slow ranks 2-3."""

    def pipe(kind, ranks):
        return PipelinePlan(
            micro_batches,
            (
                StagePlan(kind, 1, (0, 2), (ranks[0],), recompute=recompute),
                StagePlan(kind, 1, (2, 4), (ranks[1],), recompute=recompute),
            ),
        )

    return ParallelPlan(2, (pipe("emu-fast", (0, 1)), pipe("emu-slow", (2, 3))))


def test_totals_follow_from_the_parts(emulated, three_stage):
    pred = predict(
        TINY, three_stage, emulated, SEQ, options=RunOptions.from_plan(three_stage, dtype="fp32")
    )
    assert len(pred.stages) == 3 and len(pred.pipelines) == 1
    assert pred.iteration_time_s == pytest.approx(
        pred.pipeline_time_s + pred.dp_sync_s + pred.optimizer_s
    )
    assert pred.dp_sync_s == 0.0  # dp = 1
    tokens = three_stage.global_batch_size * SEQ
    assert pred.tokens_per_s == pytest.approx(tokens / pred.iteration_time_s)
    flops_per_s = TINY.flops_per_token(SEQ) * tokens / pred.iteration_time_s
    assert pred.achieved_tflops_per_device == pytest.approx(flops_per_s / 4 / 1e12)
    peak = 2 * 0.5e12 + 2 * 0.25e12  # emu-fast 0.5 TFLOP/s, emu-slow 0.5 / 2
    assert pred.mfu == pytest.approx(flops_per_s / peak)
    json.dumps(pred.to_dict())
    assert len(pred.table().splitlines()) == 5
    pipe = pred.pipelines[0]
    assert pipe.lower_bound_s - 1e-12 <= pipe.time_s <= pipe.closed_form_s + 1e-12


def test_stage_terms_by_hand(emulated, three_stage):
    pred = predict(
        TINY, three_stage, emulated, SEQ, options=RunOptions.from_plan(three_stage, dtype="fp32")
    )
    fast, slow = emulated.accelerator_of(0), emulated.accelerator_of(2)
    mb = three_stage.micro_batch_size
    layer_tp1 = ops_time(layer_forward_ops(LayerShape.of(TINY, SEQ, mb, 1)), slow, "fp32")
    assert pred.stages[1].forward_s == pytest.approx(2 * layer_tp1[0])
    assert pred.stages[1].backward_s == pytest.approx(2 * layer_tp1[1])
    # stage 0: one tp=2 layer, the embedding, 2 + 1 TP all-reduces of [mb, seq, h] forward
    comm = CommCost(emulated)
    act = mb * SEQ * TINY.hidden_size * 4
    shape2 = LayerShape.of(TINY, SEQ, mb, 2)
    compute = (
        ops_time(layer_forward_ops(shape2), fast, "fp32")[0]
        + ops_time(embedding_forward_ops(shape2), fast, "fp32")[0]
    )
    all_reduce = comm.tp_all_reduce([0, 1], act)
    assert pred.stages[0].forward_s == pytest.approx(compute + 3 * all_reduce)
    assert pred.stages[0].tp_comm_s == pytest.approx((3 + 2) * all_reduce)
    # boundary 0: tp 2 -> 1, one transfer; the gradient is broadcast inside stage 0's pair
    one = p2p_time(act, comm.path(1, 2, "p2p"))
    assert pred.stages[0].p2p_forward_s == pytest.approx(one)
    assert pred.stages[0].p2p_backward_s == pytest.approx(
        one + broadcast_time(act, 2, comm.ring_path([0, 1]))
    )
    assert pred.stages[2].p2p_forward_s == 0.0


def test_one_stage_is_m_times_forward_plus_backward():
    cluster = ClusterSpec.from_dict(
        {
            "node_groups": [
                {
                    "name": "h",
                    "accelerator": "H100",
                    "nodes": 1,
                    "devices_per_node": 1,
                    "nic_bandwidth_gbps": 50,
                }
            ]
        }
    )
    plan = ParallelPlan(1, (PipelinePlan(6, (StagePlan("H100", 1, (0, 4), (0,)),)),))
    pred = predict(TINY, plan, cluster, SEQ)
    stage = pred.stages[0]
    assert pred.pipeline_time_s == pytest.approx(6 * (stage.forward_s + stage.backward_s))
    assert pred.bubble_fraction == pytest.approx(0.0, abs=1e-12)


def test_emulated_slowdown_and_the_slowest_pipeline(emulated):
    pred = predict(
        TINY,
        two_pipelines(),
        emulated,
        SEQ,
        options=RunOptions.from_plan(two_pipelines(), dtype="fp32"),
    )
    fast = [s for s in pred.stages if s.pipeline == 0]
    slow = [s for s in pred.stages if s.pipeline == 1]
    for f, s in zip(fast, slow):
        assert "emulated" in s.accelerator
        assert s.forward_s == pytest.approx(2 * f.forward_s)
        assert s.backward_s == pytest.approx(2 * f.backward_s)
    assert pred.pipelines[1].time_s > pred.pipelines[0].time_s
    assert pred.pipeline_time_s == pred.pipelines[1].time_s
    # the DP groups mix the two kinds: hierarchical sync over the bridge
    assert pred.dp_sync_s > 0 and "hierarchical" in pred.stages[0].dp_algorithm


def test_more_micro_batches_shrink_the_bubble(emulated, three_stage):
    fractions = []
    for m in (1, 2, 4, 8, 16):
        pipeline = PipelinePlan(m, three_stage.pipelines[0].stages)
        plan = ParallelPlan(three_stage.micro_batch_size, (pipeline,))
        fractions.append(
            predict(
                TINY, plan, emulated, SEQ, options=RunOptions.from_plan(plan, dtype="fp32")
            ).bubble_fraction
        )
    assert all(a > b for a, b in zip(fractions, fractions[1:]))


def test_recompute_trades_time_for_memory(emulated):
    plain = predict(
        TINY,
        two_pipelines(),
        emulated,
        SEQ,
        options=RunOptions.from_plan(two_pipelines(), dtype="fp32"),
    )
    again = predict(
        TINY,
        two_pipelines(),
        emulated,
        SEQ,
        options=RunOptions.from_plan(two_pipelines(), dtype="fp32"),
        recompute=True,
    )
    for a, b in zip(plain.stages, again.stages):
        assert b.forward_s == a.forward_s
        assert b.backward_s > a.backward_s
        assert b.memory.activation_bytes < a.memory.activation_bytes
    flagged = predict(
        TINY,
        two_pipelines(recompute=True),
        emulated,
        SEQ,
        options=RunOptions.from_plan(two_pipelines(recompute=True), dtype="fp32"),
    )
    assert flagged.iteration_time_s == again.iteration_time_s


def test_block_recompute_lies_between_none_and_all(emulated):
    import dataclasses

    from megatron_het.parallel.plan_builders import with_recompute
    from megatron_het.parallel.plan_validation import validate

    plain = predict(
        TINY,
        two_pipelines(),
        emulated,
        SEQ,
        options=RunOptions.from_plan(two_pipelines(), dtype="fp32"),
    )
    full = predict(
        TINY,
        two_pipelines(recompute=True),
        emulated,
        SEQ,
        options=RunOptions.from_plan(two_pipelines(recompute=True), dtype="fp32"),
    )
    block = with_recompute(two_pipelines(), 1)  # the first of each stage's 2 layers
    assert {st.recomputed_layers for p in block.pipelines for st in p.stages} == {1}
    half = predict(TINY, block, emulated, SEQ, options=RunOptions.from_plan(block, dtype="fp32"))
    for a, b, c in zip(plain.stages, half.stages, full.stages):
        assert a.forward_s == b.forward_s == c.forward_s
        assert b.backward_s == pytest.approx((a.backward_s + c.backward_s) / 2)
        assert c.memory.activation_bytes < b.memory.activation_bytes < a.memory.activation_bytes
    assert with_recompute(two_pipelines(), None) == two_pipelines(recompute=True)
    too_many = dataclasses.replace(
        block,
        pipelines=tuple(
            dataclasses.replace(
                p, stages=tuple(dataclasses.replace(st, recompute_num_layers=3) for st in p.stages)
            )
            for p in block.pipelines
        ),
    )
    with pytest.raises(
        UserError,
        match="stage 0 of pipeline 0 recomputes its first 3 layers "
        "but holds 2; use recompute_num_layers <= 2",
    ):
        validate(too_many, TINY)


def test_zero1_shards_the_optimizer_state(emulated):
    plain = predict(
        TINY,
        two_pipelines(),
        emulated,
        SEQ,
        options=RunOptions.from_plan(two_pipelines(), dtype="bf16"),
    )
    zero = predict(
        TINY,
        two_pipelines(),
        emulated,
        SEQ,
        options=RunOptions.from_plan(two_pipelines(), dtype="bf16", use_distributed_optimizer=True),
    )
    for a, b in zip(plain.stages, zero.stages):
        assert b.memory.optimizer_bytes == pytest.approx(a.memory.optimizer_bytes / 2)
        assert a.memory.optimizer_bytes == a.parameters * 12
    assert "reduce-scatter" in zero.stages[0].dp_algorithm


def test_host_profile_drives_emulated_kinds(emulated):
    shape = LayerShape.of(TINY, SEQ, 2, 1)
    entry = LayerEntry(
        shape.hidden, shape.ffn, shape.heads, shape.kv_groups, SEQ, 2, 1, "fp32", 0.5, 1.0, 1234.0
    )
    host = Profile(
        "cpu",
        ProfileConditions("host", "2.13", 2, "2026-11-30"),
        layers=(entry,),
        optimizer_step_s_per_param=1e-9,
    )
    pred = predict(
        TINY,
        two_pipelines(),
        emulated,
        SEQ,
        {"cpu": host},
        options=RunOptions.from_plan(two_pipelines(), dtype="fp32"),
    )
    fast, slow = pred.stages[1], pred.stages[3]  # 2 layers each, with the head
    assert fast.forward_s - 2 * 0.5 == pytest.approx(slow.forward_s / 2 - 2 * 0.5)
    assert "x2 (emulated slowdown)" in slow.source and "exact" in fast.source
    assert fast.optimizer_s == pytest.approx(fast.parameters * 1e-9)
    assert slow.optimizer_s == pytest.approx(2 * slow.parameters * 1e-9)


def test_fits_reports_the_tightest_device(emulated):
    small = predict(TINY, two_pipelines(), emulated, SEQ)
    assert fits(small, emulated).ok
    check_fits(small, emulated)
    big_model = model_preset("llama2-7b")
    stages = tuple(
        StagePlan("emu-fast" if r < 2 else "emu-slow", 1, (8 * r, 8 * r + 8), (r,))
        for r in range(4)
    )
    plan = ParallelPlan(1, (PipelinePlan(4, stages),))
    big = predict(big_model, plan, emulated, 512)
    result = fits(big, emulated)
    assert not result.ok and result.headroom_bytes < 0
    assert "stage 0 of pipeline 0" in result.message and "GiB" in result.message
    with pytest.raises(UserError, match="needs"):
        check_fits(big, emulated)


def test_options(emulated, three_stage):
    closed = predict(TINY, three_stage, emulated, SEQ, pipeline_model="closed_form")
    assert closed.pipeline_time_s == closed.pipelines[0].closed_form_s
    f = [s.forward_s for s in closed.stages]
    b = [s.backward_s for s in closed.stages]
    cf = [s.p2p_forward_s for s in closed.stages[:-1]]
    cb = [s.p2p_backward_s for s in closed.stages[:-1]]
    assert closed.pipeline_time_s == closed_form_1f1b(f, b, 4, cf, cb)
    fp32_plan = ParallelPlan(2, three_stage.pipelines, dtype="fp32")
    # Without options the plan's keys are the run's; options given are what is priced.
    assert predict(TINY, fp32_plan, emulated, SEQ).dtype == "fp32"
    bf16 = RunOptions.from_plan(fp32_plan, dtype="bf16")
    assert predict(TINY, fp32_plan, emulated, SEQ, options=bf16).dtype == "bf16"
    with pytest.raises(UserError):
        predict(TINY, three_stage, emulated, 0)


def hethub_plan() -> ParallelPlan:
    """dp=8 pipelines of 12 stages, one node (tp=8) each: 2 MI250X stages of 4 layers, then 10
    accelerator-a stages of 8 layers; recompute; micro-batch 1, 128 micro-batches each."""
    pipelines = []
    for d in range(8):
        stages, start = [], 0
        for s in range(12):
            amd = s < 2
            node = 2 * d + s if amd else 16 + 10 * d + (s - 2)
            count = 4 if amd else 8
            stages.append(
                StagePlan(
                    "MI250X" if amd else "accelerator-a",
                    8,
                    (start, start + count),
                    tuple(range(8 * node, 8 * node + 8)),
                    recompute=True,
                )
            )
            start += count
        pipelines.append(PipelinePlan(128, tuple(stages)))
    return ParallelPlan(1, tuple(pipelines))


def test_llama_140b_on_the_hethub_cluster_is_plausible():
    cluster = ClusterSpec.load("scripts/clusters/hethub_llama140b.yaml")
    model = model_preset("llama-140b")
    pred = predict(
        model,
        hethub_plan(),
        cluster,
        4096,
        options=RunOptions.from_plan(hethub_plan(), use_distributed_optimizer=True),
    )
    assert pred.num_devices == 768
    assert 20.0 < pred.iteration_time_s < 200.0
    assert 0.15 < pred.mfu < 0.6
    assert 0.0 < pred.bubble_fraction < 0.3
    assert fits(pred, cluster).ok
    assert 5 * 2**30 < pred.peak_memory_bytes < 60 * 2**30
    for p in pred.pipelines:
        assert p.lower_bound_s <= p.time_s <= p.closed_form_s


class FixedRates:
    """A rate model that gives every stage 1 s of forward and 2 s of backward work, and fixed
    sync, step and other times; None for plans of other shapes."""

    def __init__(self, sharing=None):
        self.sharing = sharing
        self.seen = []

    def shared_iteration(self, inputs, rows):
        from megatron_het.perf import Region, SharedIteration, StageTiming

        self.seen.append((inputs.plan, len(rows), inputs.act_bytes))
        if inputs.plan.dp_size != 1:
            return None
        stages = tuple(
            tuple(
                StageTiming(Region(1.0), Region(2.0), 0.0, 0.0, 0, st.tp) for st in pipeline.stages
            )
            for pipeline in inputs.plan.pipelines
        )
        return SharedIteration(stages, self.sharing or Cores(), 0.5, 0.25, 0.125)


class Cores:
    def rate(self, node, computing):
        return 1.0


def test_a_rate_model_replaces_the_iteration_where_it_applies(emulated, three_stage):
    model = FixedRates()
    shared = predict(TINY, three_stage, emulated, SEQ, rate_model=model)
    m = three_stage.pipelines[0].micro_batches
    assert shared.pipeline_time_s == pytest.approx((m + 3 - 1) * 3.0)  # uniform stages of 3 s
    assert (shared.dp_sync_s, shared.optimizer_s, shared.overhead_s) == (0.5, 0.25, 0.125)
    assert shared.iteration_time_s == pytest.approx(shared.pipeline_time_s + 0.875)
    plain = predict(TINY, three_stage, emulated, SEQ)
    assert shared.stages == plain.stages  # the per-stage table stays the device model's
    assert model.seen[0][1] == 3 and model.seen[0][2] == 2 * SEQ * TINY.hidden_size * 2
    # Where the model does not apply the prediction is the one-device-per-rank one.
    assert predict(TINY, two_pipelines(), emulated, SEQ, rate_model=model) == predict(
        TINY, two_pipelines(), emulated, SEQ
    )
