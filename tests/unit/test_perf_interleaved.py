"""The predictor on interleaved pipelines: the analytic forms against the simulation, per-chunk
rows, per-device memory from the schedule, the DP sync of a device group."""

import dataclasses
import random

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.perf import (
    Profile,
    ProfileConditions,
    closed_form_interleaved,
    fits,
    lower_bound_interleaved,
    predict,
)
from megatron_het.perf.cost.comm_time import CommCost, broadcast_time, p2p_time
from megatron_het.perf.cost.memory import stage_parameters
from megatron_het.perf.cost.roofline import (
    LayerShape,
    head_activation_bytes,
    layer_activation_bytes,
)
from megatron_het.perf.measure.profile_format import CommEntry, EndEntry, LayerEntry
from megatron_het.perf.schedule.closed_forms import closed_form_1f1b, closed_form_interleaved_bubble
from megatron_het.perf.schedule.simulator import simulate
from megatron_het.pipeline.schedules import build_schedule, check_schedule
from megatron_het.training.plan_setup import local_cluster

SEQ, MB = 64, 2
TINY8 = model_preset("tiny").replace(num_layers=8)
LAYER_F, LAYER_B, LAYER_ACT = 0.004, 0.008, 1e6  # the profile's seconds and bytes per layer


def simulated(p, v, m, f, b, cf=None, cb=None):
    return simulate(
        build_schedule("1f1b", p, m, num_chunks=v), f, b, cf, cb, record_timeline=False
    ).makespan_s


# ---- the analytic forms -------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_closed_form_and_lower_bound_are_exact_for_uniform_chunks(p, v, mult):
    m, n = mult * p, p * v
    f, b = [1.0 / v] * n, [2.5 / v] * n  # a group: 1 s forward, 2.5 s backward per micro-batch
    time = simulated(p, v, m, f, b)
    ideal = m * 3.5
    assert closed_form_interleaved(f, b, m, v) == pytest.approx(time, rel=1e-12)
    assert time == pytest.approx(ideal * (1 + closed_form_interleaved_bubble(p, v, m)), rel=1e-12)
    assert lower_bound_interleaved(f, b, m, v) == pytest.approx(time, rel=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("mult", [2, 3])
def test_closed_form_is_exact_with_uniform_p2p_from_two_rounds(p, v, mult):
    m, n = mult * p, p * v
    f, b, c = [1.0] * n, [2.0] * n, [0.05] * (n - 1)
    assert closed_form_interleaved(f, b, m, v, c, c) == pytest.approx(
        simulated(p, v, m, f, b, c, c), rel=1e-12
    )


def test_with_one_chunk_the_closed_form_is_1f1b_without_p2p():
    rng = random.Random(2)
    for _ in range(20):
        p, m = rng.randint(1, 5), rng.randint(1, 8)
        f = [rng.uniform(0.1, 2) for _ in range(p)]
        b = [rng.uniform(0.1, 4) for _ in range(p)]
        assert closed_form_interleaved(f, b, m, 1) == pytest.approx(closed_form_1f1b(f, b, m))


def test_the_simulation_never_beats_the_lower_bound():
    rng = random.Random(13)
    for _ in range(80):
        p, v = rng.randint(2, 5), rng.randint(2, 4)
        m, n = p * rng.randint(1, 4), p * v
        f = [rng.uniform(0.2, 3.0) for _ in range(n)]
        b = [x * rng.uniform(1.5, 3.0) for x in f]
        cf = [rng.uniform(0.0, 0.5) for _ in range(n - 1)]
        cb = [rng.uniform(0.0, 0.5) for _ in range(n - 1)]
        if rng.random() < 0.3:
            cf = cb = None
        time = simulated(p, v, m, f, b, cf, cb)
        assert time >= lower_bound_interleaved(f, b, m, v, cf, cb) - 1e-9


# ---- predict on a uniform layout ------------------------------------------------------------
def controlled_profile():
    """cpu: every tp=1 layer 4 ms forward, 8 ms backward, 1 MB kept; embedding and head free;
    p2p on the node next to instantaneous."""
    h = TINY8
    layer = LayerEntry(
        h.hidden_size,
        h.ffn_hidden_size,
        h.num_attention_heads,
        h.num_query_groups,
        SEQ,
        MB,
        1,
        "fp32",
        LAYER_F,
        LAYER_B,
        LAYER_ACT,
    )
    end = EndEntry(h.hidden_size, h.vocab_size, SEQ, MB, 1, "fp32", 0.0, 0.0)
    return {
        "cpu": Profile(
            "cpu",
            ProfileConditions("test", "2.x", 1, "2026-01-01", "fp32"),
            layers=(layer,),
            embedding=(end,),
            head=(end,),
            optimizer_step_s_per_param=1e-9,
            comm=(CommEntry("p2p", "intra_node", 1e12, 0.0),),
        )
    }


def two_groups(chunks, m=4):
    """8 layers on ranks 0 and 1, ``chunks`` per rank, round-robin."""
    per = 8 // (2 * chunks)
    stages = tuple(
        StagePlan("cpu", 1, (per * s, per * (s + 1)), (s % 2,)) for s in range(2 * chunks)
    )
    return ParallelPlan(MB, (PipelinePlan(m, stages),))


def test_each_device_holds_what_its_schedule_says_on_random_layouts():
    """Random groups, chunks, micro-batch counts and uneven layer splits: every row's
    ``in_flight`` is its device group's peak of (chunk, micro-batch) pairs in the schedule the
    runtime runs, and the group's activation bytes lie between that many pairs of its
    smallest and of its largest chunk (with the head's, on the group holding it)."""
    rng = random.Random(29)
    for _ in range(12):
        p, v = rng.randint(2, 4), rng.randint(2, 3)
        n = p * v
        m = rng.choice([k for k in range(p, 4 * p + 1) if k % p == 0])
        layers = [1] * n
        for _ in range(rng.randint(0, 6)):
            layers[rng.randrange(n)] += 1
        model = TINY8.replace(num_layers=sum(layers))
        bounds = [sum(layers[:i]) for i in range(n + 1)]
        stages = tuple(StagePlan("cpu", 1, (bounds[s], bounds[s + 1]), (s % p,)) for s in range(n))
        plan = ParallelPlan(MB, (PipelinePlan(m, stages),))
        rows = predict(
            model,
            plan,
            local_cluster(p),
            SEQ,
            controlled_profile(),
            options=RunOptions.from_plan(plan, dtype="fp32"),
        ).stages
        peaks = check_schedule(build_schedule("1f1b", p, m, num_chunks=v), m, n).peak_in_flight
        assert [r.in_flight for r in rows] == [peaks[s % p] for s in range(n)], (p, v, m)
        for g in range(p):  # a group's activations grow with the layers of its own chunks
            mine = [r for r in rows if r.ranks == (g,)]
            assert len({r.memory.activation_bytes for r in mine}) == 1
            head = (
                head_activation_bytes(LayerShape.of(model, SEQ, MB, 1), model.vocab_size, "fp32")
                if g == (n - 1) % p
                else 0.0
            )
            assert mine[0].memory.activation_bytes <= (
                peaks[g] * (max(layers[g::p]) * LAYER_ACT + head) + 1e-6
            )
            assert mine[0].memory.activation_bytes >= peaks[g] * min(layers[g::p]) * LAYER_ACT


def test_uniform_interleaving_predicts_the_interleaved_bubble():
    cluster, profiles = local_cluster(2), controlled_profile()
    plain = predict(
        TINY8,
        two_groups(1),
        cluster,
        SEQ,
        profiles,
        options=RunOptions.from_plan(two_groups(1), dtype="fp32"),
    )
    inter = predict(
        TINY8,
        two_groups(2),
        cluster,
        SEQ,
        profiles,
        options=RunOptions.from_plan(two_groups(2), dtype="fp32"),
    )
    group = 4 * (LAYER_F + LAYER_B)  # per micro-batch on either rank, both layouts
    p, m = 2, 4
    assert [s.forward_s + s.backward_s for s in inter.stages] == pytest.approx([group / 2] * 4)
    assert inter.pipeline_time_s == pytest.approx((m + (p - 1) / 2) * group, rel=1e-9)
    assert plain.pipeline_time_s == pytest.approx((m + p - 1) * group, rel=1e-9)
    assert inter.pipelines[0].closed_form_s == pytest.approx(inter.pipeline_time_s, rel=1e-9)
    assert inter.pipelines[0].lower_bound_s <= inter.pipeline_time_s * (1 + 1e-12)
    assert inter.bubble_fraction == pytest.approx(1 - m / (m + 0.5), rel=1e-9)
    assert inter.bubble_fraction < plain.bubble_fraction
    # Group 0 holds 5 (chunk, micro-batch) pairs of 2 layers at its peak against 2
    # micro-batches of 4 layers without interleaving, as its schedule says.
    report = check_schedule(build_schedule("1f1b", 2, m, num_chunks=2), m, 4)
    assert [s.in_flight for s in inter.stages] == [report.peak_in_flight[s % 2] for s in range(4)]
    rank0 = [s for s in inter.stages if s.ranks == (0,)]
    assert [s.in_flight for s in rank0] == [5, 5]
    assert all(s.memory.activation_bytes == 5 * 2 * LAYER_ACT for s in rank0)
    assert plain.stages[0].memory.activation_bytes == 2 * 4 * LAYER_ACT
    # The same parameters and the same step on each rank: the device's, on every chunk's row.
    assert rank0[0].memory.weights_bytes == plain.stages[0].memory.weights_bytes
    assert rank0[0].optimizer_s == pytest.approx(plain.stages[0].optimizer_s)
    assert rank0[0].parameters + rank0[1].parameters == plain.stages[0].parameters
    assert inter.peak_memory_bytes == max(s.memory.total_bytes for s in inter.stages)
    closed = predict(
        TINY8,
        two_groups(2),
        cluster,
        SEQ,
        profiles,
        options=RunOptions.from_plan(two_groups(2), dtype="fp32"),
        pipeline_model="closed_form",
    )
    assert closed.pipeline_time_s == closed.pipelines[0].closed_form_s


# ---- a non-uniform layout -------------------------------------------------------------------
def test_uneven_chunks_on_two_tp_degrees():
    model = model_preset("tiny").replace(num_layers=6)
    plan = ParallelPlan.load("scripts/plans/cpu_interleaved_tp2_tp1.json")
    cluster = local_cluster(3)
    pred = predict(model, plan, cluster, SEQ, options=RunOptions.from_plan(plan, dtype="fp32"))
    rows, stages = pred.stages, plan.pipelines[0].stages
    assert [r.stage for r in rows] == [0, 1, 2, 3]
    assert [r.ranks for r in rows] == [(0, 1), (2,), (0, 1), (2,)]
    # Per device: every chunk it runs.
    for _g, chunks in enumerate(((0, 2), (1, 3))):
        params = sum(stage_parameters(model, stages[s]) for s in chunks)
        for s in chunks:
            assert rows[s].parameters == stage_parameters(model, stages[s])
            assert rows[s].memory.weights_bytes == params * 4
            assert rows[s].memory.optimizer_bytes == params * 8  # fp32: Adam's two states
            assert rows[s].memory == rows[chunks[0]].memory
    # Activations at each group's peak (m = 4, p = v = 2): group 0 has forwarded micro-batches
    # 0, 1 of chunk 0, then 0, 1 of chunk 1, then 2 of chunk 0 when its first backward comes;
    # group 1 its first three forwards (0, 1 of chunk 0, 0 of chunk 1, the head's).
    tp2, tp1 = (layer_activation_bytes(LayerShape.of(model, SEQ, MB, tp), "fp32") for tp in (2, 1))
    head = head_activation_bytes(LayerShape.of(model, SEQ, MB, 1), model.vocab_size, "fp32")
    assert rows[0].memory.activation_bytes == pytest.approx(3 * 2 * tp2 + 2 * 2 * tp2)
    assert rows[1].memory.activation_bytes == pytest.approx(2 * tp1 + (tp1 + head))
    assert (rows[0].in_flight, rows[1].in_flight) == (5, 3)
    # p2p over every boundary, the one from rank 2 back to ranks 0-1 included; tp 2 <-> 1
    # sends once and broadcasts in the tp=2 group.
    comm = CommCost(cluster)
    act = MB * SEQ * model.hidden_size * 4
    one = p2p_time(act, comm.path(1, 2, "p2p"))
    back = p2p_time(act, comm.path(2, 0, "p2p"))
    bcast = broadcast_time(act, 2, comm.ring_path([0, 1]))
    assert (rows[0].p2p_forward_s, rows[0].p2p_backward_s) == pytest.approx((one, one + bcast))
    assert (rows[1].p2p_forward_s, rows[1].p2p_backward_s) == pytest.approx((back + bcast, back))
    assert (rows[3].p2p_forward_s, rows[3].p2p_backward_s) == (0.0, 0.0)
    pipe = pred.pipelines[0]
    assert pipe.lower_bound_s <= pipe.time_s
    work = max(sum(rows[s].forward_s + rows[s].backward_s for s in c) for c in ((0, 2), (1, 3)))
    assert pipe.bubble_fraction == pytest.approx(1 - 4 * work / pipe.time_s)
    assert fits(pred, cluster).ok


def test_dp_sync_and_zero1_cover_every_chunk_of_a_group():
    cluster = ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")

    def pipe(kind, ranks):
        return PipelinePlan(
            2, tuple(StagePlan(kind, 1, (2 * s, 2 * s + 2), (ranks[s % 2],)) for s in range(4))
        )

    plan = ParallelPlan(MB, (pipe("emu-fast", (0, 1)), pipe("emu-slow", (2, 3))))
    plain = predict(TINY8, plan, cluster, SEQ, options=RunOptions.from_plan(plan, dtype="bf16"))
    zero = predict(
        TINY8,
        plan,
        cluster,
        SEQ,
        options=RunOptions.from_plan(plan, dtype="bf16", use_distributed_optimizer=True),
    )
    stages = plan.pipelines[0].stages
    params = stage_parameters(TINY8, stages[0]) + stage_parameters(TINY8, stages[2])
    sync = CommCost(cluster).dp_sync([0, 2], params * 4).time_s
    assert plain.stages[0].dp_sync_s == plain.stages[2].dp_sync_s == pytest.approx(sync)
    alone = CommCost(cluster).dp_sync([0, 2], stage_parameters(TINY8, stages[0]) * 4).time_s
    assert sync > alone
    assert zero.stages[2].memory.optimizer_bytes == pytest.approx(params * 12 / 2)
    assert plain.stages[2].memory.optimizer_bytes == pytest.approx(params * 12)
    assert "reduce-scatter" in zero.stages[0].dp_algorithm
    assert plain.dp_sync_s == max(s.dp_sync_s for s in plain.stages)


def test_a_device_group_is_named_and_shown_once_with_all_its_chunks():
    from megatron_het.planner import evaluate_plan
    from megatron_het.planner.report import markdown_report, peak_memory_gib, text_summary

    cluster = ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")
    plan = ParallelPlan.load("scripts/plans/cpu_emulated_interleaved.json")
    result = evaluate_plan(TINY8, cluster, plan, SEQ, with_baseline=False)
    pred = result.prediction
    # A device's bytes are all its chunks': the message names its ranks and every chunk.
    tight = fits(pred, cluster, reserved_fraction=1.0 - 1e-9)
    assert not tight.ok and tight.worst.ranks in ((0, 1), (2, 3))
    group = [s for s in pred.stages if s.ranks == tight.worst.ranks]
    assert f"ranks {', '.join(map(str, tight.worst.ranks))}" in tight.message
    for s in group:
        assert f"[{s.layers[0]}, {s.layers[1]})" in tight.message
    # The report gives a device's memory once, on its first chunk's row.
    memory = [f"{s.memory.total_bytes / 2**30:.1f} / " for s in pred.stages]
    report = markdown_report(result, cluster)
    rows = [
        line
        for line in report.splitlines()
        if line.startswith("| 2 | ") or line.startswith("| 0 | ")
    ]
    assert memory[0] in rows[0] and "(stage 0)" in rows[1] and memory[2] not in rows[1]
    table = text_summary(result, cluster).split("\npredicted ")[0]  # the stage table
    assert "(stage 1)" in table.splitlines()[-1]
    assert peak_memory_gib(pred) == [pred.stages[g].memory.total_bytes / 2**30 for g in (0, 1)]


def test_overlap_p2p_comm_is_on_by_default_and_the_plan_or_keyword_turns_it_off():
    model = model_preset("tiny").replace(num_layers=6)
    plan = ParallelPlan.load("scripts/plans/cpu_interleaved_tp2_tp1.json")
    cluster = local_cluster(3)
    assert plan.overlap_p2p_comm is None
    on = predict(model, plan, cluster, SEQ, options=RunOptions.from_plan(plan, dtype="fp32"))
    off = predict(
        model,
        plan,
        cluster,
        SEQ,
        options=RunOptions.from_plan(plan, dtype="fp32", overlap_p2p_comm=False),
    )
    keyed = predict(
        model,
        dataclasses.replace(plan, overlap_p2p_comm=False),
        cluster,
        SEQ,
        options=RunOptions.from_plan(
            dataclasses.replace(plan, overlap_p2p_comm=False), dtype="fp32"
        ),
    )
    assert on.overlap_p2p_comm and not off.overlap_p2p_comm
    assert keyed.iteration_time_s == off.iteration_time_s
    assert on.pipeline_time_s < off.pipeline_time_s
    assert on.stages == off.stages  # per-stage figures are the same; only the timing differs
    assert on.to_dict()["overlap_p2p_comm"] is True
    # plain pipelines never overlap (as the runtime): the flag is reported off
    plain = predict(
        TINY8,
        two_groups(1),
        local_cluster(2),
        SEQ,
        controlled_profile(),
        options=RunOptions.from_plan(two_groups(1), dtype="fp32"),
    )
    assert not plain.overlap_p2p_comm
