"""Ranks sharing a host CPU (EMULATION): sharing figures, the simulator with the shared cores'
rate model against its fixed-time form and by hand, the emulated ranks' communicator figures,
and predict() with the shared-host rate model."""

import dataclasses
import random

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.emulation.host_measure import (
    LAYER_TP_COLLECTIVES,
    measure_host_collective,
    measure_host_sharing,
)
from megatron_het.emulation.host_model import SharedHostModel
from megatron_het.emulation.host_sharing import HostCores, HostSharing
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import Profile, ProfileConditions, predict
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.perf.cost.tp_collectives import tp_collectives
from megatron_het.perf.measure.profile_format import CommEntry, LayerEntry
from megatron_het.perf.schedule.simulator import (
    Region,
    StageTiming,
    simulate_1f1b,
    simulate_pipelines,
)
from megatron_het.pipeline.schedules import build_schedule

CONDITIONS = ProfileConditions("test cpu", "2.x", 1, "2026-01-01", "fp32")
GB = 1e9
SHARED = SharedHostModel()


def host_stage(
    node,
    processes,
    slowdown,
    work_forward,
    work_backward,
    wait_forward_s=0.0,
    wait_backward_s=0.0,
    p2p_forward_s=0.0,
    p2p_backward_s=0.0,
):
    """A stage whose regions are padded to slowdown x their work, as the emulator pads them."""
    return StageTiming(
        Region(work_forward, wait_forward_s, slowdown * work_forward),
        Region(work_backward, wait_backward_s, slowdown * work_backward),
        p2p_forward_s,
        p2p_backward_s,
        node,
        processes,
    )


def simulate_shared_host(pipelines, micro_batches, sharing):
    schedules = [
        build_schedule("1f1b", len(stages), m) for stages, m in zip(pipelines, micro_batches)
    ]
    return simulate_pipelines(schedules, pipelines, HostCores(sharing))


def test_sharing_factor_interpolates_and_extrapolates_like_full_cores():
    sharing = HostSharing((1.0, 1.1, 1.6, 2.2))
    assert sharing.factor(1) == 1.0 and sharing.factor(3) == 1.6
    assert sharing.factor(2.5) == pytest.approx(1.35)
    assert sharing.factor(8) == pytest.approx(4.4)  # past the measured counts: n / 4 of 2.2
    assert sharing.rate(2) == pytest.approx(1 / 1.1)
    with pytest.raises(UserError):
        HostSharing(())


def test_finish_time_is_processor_sharing_by_hand():
    # One core's worth: two processes take twice as long each while both run.
    sharing = HostSharing((1.0, 2.0, 3.0))
    # works 1, 2, 4: all three at 1/3 until 1 is done (t=3), then two at 1/2 (t=5), then alone.
    assert sharing.finish_time([4.0, 1.0, 2.0]) == pytest.approx(3 + 2 + 2)
    assert sharing.finish_time([]) == 0.0


def test_without_sharing_the_host_simulation_is_the_pipeline_simulation():
    rng = random.Random(7)
    for _ in range(30):
        p, m = rng.randint(1, 4), rng.randint(1, 6)
        f = [rng.uniform(0.1, 1) for _ in range(p)]
        b = [rng.uniform(0.1, 2) for _ in range(p)]
        cf = [rng.uniform(0, 0.3) for _ in range(p - 1)]
        cb = [rng.uniform(0, 0.3) for _ in range(p - 1)]
        stages = [
            host_stage(0, 1, 1.0, f[s], b[s], 0.0, 0.0, (cf + [0])[s], (cb + [0])[s])
            for s in range(p)
        ]
        got = simulate_shared_host([stages], [m], {}).makespans_s[0]
        assert got == pytest.approx(simulate_1f1b(f, b, m, cf, cb).makespan_s, rel=1e-9)


def test_an_emulated_wait_frees_the_core_by_hand():
    # A host that is one core: two computing processes each progress at half speed.
    host = {0: HostSharing((1.0, 2.0))}
    fast = [host_stage(0, 1, 1.0, 1.0, 0.0)]  # 2 micro-batches of 1 s forward
    slow = [host_stage(0, 1, 3.0, 1.0, 0.0)]  # 1 micro-batch, slowdown x3
    # 0-2 s: both compute at half speed; the slow rank's region lasts 3 x its 1 s of CPU work
    # (it waits 2-3 s without the core), and the fast rank's second micro-batch runs alone.
    result = simulate_shared_host([fast, slow], [2, 1], host)
    assert result.makespans_s == pytest.approx([3.0, 3.0])
    assert result.busy_s == (pytest.approx((3.0,)), pytest.approx((3.0,)))
    # With a core each, the slow rank's region is 1 s, padded to 3 s.
    assert simulate_shared_host([fast, slow], [2, 1], {}).makespans_s == pytest.approx([2.0, 3.0])
    # Sharing that costs more than the slowdown leaves nothing to wait: the region is late.
    crowded = {0: HostSharing((1.0, 4.0))}
    assert simulate_shared_host([fast, slow], [2, 1], crowded).makespans_s == pytest.approx(
        [5.0, 4.0]
    )


def test_waits_inside_the_region_count_toward_its_emulated_length():
    # TP=2 on a host of one core: 1 s of work at half speed + a 0.5 s all-reduce.
    stage = [host_stage(0, 2, 2.0, 1.0, 0.0, wait_forward_s=0.5)]
    result = simulate_shared_host([stage], [1], {0: HostSharing((1.0, 2.0))})
    assert result.makespans_s == pytest.approx([2.5])  # past the 2 x 1 s the kind would take
    stage = [host_stage(0, 2, 4.0, 1.0, 0.0, wait_forward_s=0.5)]
    result = simulate_shared_host([stage], [1], {0: HostSharing((1.0, 2.0))})
    assert result.makespans_s == pytest.approx([4.0])  # padded to 4 x 1 s of CPU work


def host_profile(sharing=(), comm=()):
    """A cpu profile for the tiny model at seq 64, micro-batch 2, tp 1."""
    model = model_preset("tiny")
    layer = LayerEntry(
        model.hidden_size,
        model.ffn_hidden_size,
        model.num_attention_heads,
        model.num_query_groups,
        64,
        2,
        1,
        "fp32",
        0.004,
        0.008,
        1e6,
    )
    return Profile(
        "cpu",
        CONDITIONS,
        layers=(layer,),
        optimizer_step_s_per_param=2e-9,
        comm=comm,
        host_sharing=tuple(sharing),
    )


def test_host_sharing_round_trips_and_is_checked():
    profile = host_profile((1.0, 1.5, 2.5))
    assert Profile.from_dict(profile.to_dict()) == profile
    bad = profile.to_dict()
    bad["host_sharing"] = [1.0, -2]
    with pytest.raises(UserError, match="host_sharing"):
        Profile.from_dict(bad)


def test_emulated_ranks_use_the_host_profile_communicator_figures():
    cluster = ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")
    gloo = (
        CommEntry("p2p", "intra_node", 1.5, 2e-4),
        CommEntry("collective", "intra_node", 0.5, 1e-4),
    )
    comm = CommCost(cluster, {"cpu": host_profile(comm=gloo)})
    inside = comm.path(0, 1, "p2p")  # two emu-fast ranks: the host's gloo as measured
    assert (inside.bandwidth, inside.latency_s) == (1.5 * GB, 2e-4)
    assert comm.path(2, 3, "collective").bandwidth == 0.5 * GB
    # The emulated bridge (2 GB/s, 50 us) relays through the host's gloo: the slower of both.
    bridge = comm.path(1, 2, "p2p")
    assert (bridge.bandwidth, bridge.latency_s) == (1.5 * GB, 2e-4)
    # No profile: the bridge's own figures, exact (an emulated wait has no efficiency loss).
    plain = CommCost(cluster).path(1, 2, "p2p")
    assert (plain.bandwidth, plain.latency_s) == (2 * GB, 50e-6)


def test_predict_on_a_shared_host():
    cluster = ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")
    plan = ParallelPlan.load("scripts/plans/cpu_emulated_pp4.json")
    model = model_preset("tiny")
    alone = predict(
        model,
        plan,
        cluster,
        64,
        {"cpu": host_profile()},
        options=RunOptions.from_plan(plan, dtype="fp32"),
    )
    free = predict(
        model,
        plan,
        cluster,
        64,
        {"cpu": host_profile((1.0,) * 4)},
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=SHARED,
    )
    # Cores for everyone and tp=1 (no waits in the regions): the same pipeline as alone.
    assert free.pipeline_time_s == pytest.approx(alone.pipeline_time_s, rel=1e-9)
    # The optimizer runs at host speed (the emulator slows only pipeline compute).
    per_rank = [s.optimizer_s / (2.0 if "slow" in s.accelerator else 1.0) for s in free.stages]
    assert free.optimizer_s == pytest.approx(max(per_rank))
    assert free.overhead_s > 0
    crowded = {"cpu": host_profile((1.0, 2.0, 3.0, 4.0))}
    shared = predict(
        model,
        plan,
        cluster,
        64,
        crowded,
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=SHARED,
    )
    assert shared.pipeline_time_s > 1.2 * free.pipeline_time_s
    # A profile without sharing figures keeps the one-device-per-rank model, and so does a
    # prediction without the rate model.
    for profile, rate_model in (({"cpu": host_profile()}, SHARED), (crowded, None)):
        assert dataclasses.replace(alone, stages=()) == dataclasses.replace(
            predict(
                model,
                plan,
                cluster,
                64,
                profile,
                options=RunOptions.from_plan(plan, dtype="fp32"),
                rate_model=rate_model,
            ),
            stages=(),
        )
    # The closed form never uses the rate model.
    closed = predict(
        model,
        plan,
        cluster,
        64,
        crowded,
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=SHARED,
        pipeline_model="closed_form",
    )
    assert closed.overhead_s == 0.0


def test_tp_collective_counts():
    stage = ParallelPlan.load("scripts/plans/cpu_emulated_tp2_pp2.json").pipelines[0].stages
    first = tp_collectives(
        stage[0].tp, stage[0].num_layers, stage[0].has_embedding, stage[0].has_head, 0
    )
    assert (first.forward_all, first.backward) == (2 * 2 + 1, 2 * 2)  # 2 layers + embedding
    last = tp_collectives(
        stage[1].tp,
        stage[1].num_layers,
        stage[1].has_embedding,
        stage[1].has_head,
        stage[1].num_layers,
    )
    assert (last.forward, last.cross_entropy, last.backward) == (2 * 2, 2, 2 * 2 * 2 + 1)
    assert last.forward_all == 2 * 2 + 2  # + the head's cross-entropy, recompute backward
    alone = tp_collectives(1, 8, True, True, 8)  # tp=1: no collectives
    # block recompute of the first of the 2 layers: 2 more backward collectives, not 4
    part = tp_collectives(
        stage[1].tp, stage[1].num_layers, stage[1].has_embedding, stage[1].has_head, 1
    )
    assert part.backward == 2 * 2 + 2 + 1
    with pytest.raises(TypeError, match="not a bool"):
        tp_collectives(2, 2, False, False, True)
    assert (alone.forward_all, alone.backward) == (0, 0)
    assert LAYER_TP_COLLECTIVES == 4  # what the host collective measurement divides by
    profile = dataclasses.replace(host_profile((1.0, 2.0)), host_collective_s=(2e-3, 1e-3))
    assert Profile.from_dict(profile.to_dict()) == profile
    bad = profile.to_dict()
    bad["host_collective_s"] = [1e-3]
    with pytest.raises(UserError, match="wall, CPU"):
        Profile.from_dict(bad)


def test_host_measurements_run_on_this_machine():
    model = model_preset("tiny")
    sharing = measure_host_sharing(model, 32, 1, max_processes=2, passes=2, warmup=1)
    assert len(sharing) == 2 and sharing[0] == 1.0 and sharing[1] > 0
    wall, cpu = measure_host_collective(model, 32, 1, passes=2)
    assert 0 < cpu <= wall


def test_dp_sync_on_a_shared_host_shares_the_cores():
    cluster = ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")
    plan = ParallelPlan.load("scripts/plans/cpu_emulated_dp2_fast_heavy.json")
    model = model_preset("tiny")
    shared = predict(
        model,
        plan,
        cluster,
        64,
        {"cpu": host_profile((1.0, 1.0, 1.5, 2.0))},
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=SHARED,
    )
    # All 4 ranks sync their stage's gradients at once: the link model's time x slowdown(4).
    assert shared.dp_sync_s == pytest.approx(2.0 * max(s.dp_sync_s for s in shared.stages))
    assert shared.iteration_time_s == pytest.approx(
        shared.pipeline_time_s + shared.dp_sync_s + shared.optimizer_s + shared.overhead_s
    )


def test_dp_sync_slows_only_its_cpu_share_and_keeps_an_emulated_links_pace():
    cluster = ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")
    plan = ParallelPlan.load("scripts/plans/cpu_emulated_dp2_fast_heavy.json")
    model = model_preset("tiny")
    sharing = (1.0, 1.0, 1.5, 2.0)
    half_cpu = dataclasses.replace(host_profile(sharing), host_collective_s=(2e-3, 1e-3))
    shared = predict(
        model,
        plan,
        cluster,
        64,
        {"cpu": half_cpu},
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=SHARED,
    )
    # Half of a collective's time is CPU work (x2.0 with 4 ranks syncing), half a wait.
    link = max(s.dp_sync_s for s in shared.stages)
    assert shared.dp_sync_s == pytest.approx((0.5 * 2.0 + 0.5) * link)
    # DP over both kinds crosses the emulated bridge. With the host's own gloo far faster than
    # the bridge, the bridge's pace (a wait that frees the core) is what the sync takes,
    # however shared the cores are.
    across = ParallelPlan.from_dict(
        {
            "format": "megatron_het.plan/1",
            "micro_batch_size": 2,
            "pipelines": [
                {
                    "micro_batches": 1,
                    "stages": [{"accelerator": kind, "tp": 1, "layers": [0, 4], "ranks": [rank]}],
                }
                for rank, kind in enumerate(["emu-fast"] * 2 + ["emu-slow"] * 2)
            ],
        }
    )
    fast_gloo = tuple(CommEntry(op, "intra_node", 500.0, 1e-7) for op in ("p2p", "collective"))
    paced = predict(
        model,
        across,
        cluster,
        64,
        {"cpu": host_profile(sharing, fast_gloo)},
        options=RunOptions.from_plan(across, dtype="fp32"),
        rate_model=SHARED,
    )
    assert paced.dp_sync_s == pytest.approx(max(s.dp_sync_s for s in paced.stages))
    assert paced.dp_sync_s > 1e-4  # the bridge's 2 GB/s, not the host's 500


def test_tp_collectives_on_a_shared_host_are_cpu_work_and_a_wait():
    cluster = ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")
    plan = ParallelPlan.load("scripts/plans/cpu_emulated_tp2_pp2.json")
    model = model_preset("tiny")
    base = host_profile((1.0,) * 4)
    tp_layer = dataclasses.replace(base.layers[0], tp=2)
    base = dataclasses.replace(base, layers=base.layers + (tp_layer,))
    timed = dataclasses.replace(base, host_collective_s=(2e-3, 1e-3))
    plain = predict(
        model,
        plan,
        cluster,
        64,
        {"cpu": base},
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=SHARED,
    )
    measured = predict(
        model,
        plan,
        cluster,
        64,
        {"cpu": timed},
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=SHARED,
    )
    # Each collective costs 2 ms instead of the link model's much smaller all-reduce.
    assert measured.pipeline_time_s > plain.pipeline_time_s
    # Sharing figures of 1: CPU work and waits add up, so 2 ms per collective either way.
    half = dataclasses.replace(base, host_collective_s=(2e-3, 2e-3))
    assert predict(
        model,
        plan,
        cluster,
        64,
        {"cpu": half},
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=SHARED,
    ).pipeline_time_s == pytest.approx(measured.pipeline_time_s)


class Recording:
    """The shared-host rate model, keeping what it was given and what it returned."""

    def shared_iteration(self, inputs, rows):
        self.inputs, self.result = inputs, SHARED.shared_iteration(inputs, rows)
        return self.result


def test_predict_on_a_shared_host_with_interleaved_chunks():
    cluster = ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")
    plan = ParallelPlan.load("scripts/plans/cpu_emulated_interleaved.json")
    model = model_preset("small").replace(num_layers=8)
    layer = LayerEntry(
        model.hidden_size,
        model.ffn_hidden_size,
        model.num_attention_heads,
        model.num_query_groups,
        64,
        2,
        2,
        "fp32",
        0.004,
        0.008,
        1e6,
    )
    gloo = (CommEntry("p2p", "intra_node", 1.0, 1e-4),)

    def profile(sharing):
        return {
            "cpu": Profile(
                "cpu",
                CONDITIONS,
                layers=(layer,),
                comm=gloo,
                optimizer_step_s_per_param=2e-9,
                host_sharing=sharing,
            )
        }

    recorder = Recording()
    free = predict(
        model,
        plan,
        cluster,
        64,
        profile((1.0,) * 4),
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=recorder,
    )
    pipeline = plan.pipelines[0]
    timings = recorder.result.stages[0]
    assert len(timings) == 4  # one per chunk
    # Every chunk receives its micro-batches and sends them on, but for the first input and
    # the last output: each transfer is the host's gloo copy at both ends.
    transfer = 1e-4 + recorder.inputs.act_bytes / 1e9
    for s, transfers in enumerate((1, 2, 2, 1)):
        compute = recorder.inputs.compute(s, pipeline)
        slowdown = 2.0 if s % 2 else 1.0  # chunks 1 and 3 on the emu-slow pair
        assert timings[s].forward.work_s == pytest.approx(
            compute.forward_s / slowdown + transfers * transfer
        )
        assert timings[s].backward.work_s == pytest.approx(
            compute.backward_s / slowdown + transfers * transfer
        )
        assert timings[s].node == 0 and timings[s].processes == 2
    # Each rank steps once, over both its chunks, at host speed (4 steps sharing the host, not 8).
    assert free.optimizer_s == pytest.approx(
        max(s.optimizer_s / (2.0 if "slow" in s.accelerator else 1.0) for s in free.stages)
    )
    assert free.stages[0].optimizer_s == pytest.approx(
        2e-9 * (free.stages[0].parameters + free.stages[2].parameters)
    )
    crowded = predict(
        model,
        plan,
        cluster,
        64,
        profile((1.0, 2.0, 3.0, 4.0)),
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=SHARED,
    )
    assert crowded.pipeline_time_s > 1.2 * free.pipeline_time_s
    assert 0.0 < crowded.bubble_fraction < 1.0
    assert crowded.stages == free.stages  # the per-chunk table stays the device model's


def test_an_interleaved_group_syncs_once_on_a_shared_host():
    cluster = ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")

    def pipeline(kind, ranks):  # 8 layers, 2 per chunk, chunks round-robin on 2 ranks
        return {
            "micro_batches": 2,
            "stages": [
                {
                    "accelerator": kind,
                    "tp": 1,
                    "layers": [2 * s, 2 * s + 2],
                    "ranks": [ranks[s % 2]],
                }
                for s in range(4)
            ],
        }

    plan = ParallelPlan.from_dict(
        {
            "format": "megatron_het.plan/1",
            "micro_batch_size": 2,
            "pipelines": [pipeline("emu-fast", [0, 1]), pipeline("emu-slow", [2, 3])],
        }
    )
    model = model_preset("tiny").replace(num_layers=8)
    shared = predict(
        model,
        plan,
        cluster,
        64,
        {"cpu": host_profile((1.0, 1.0, 1.5, 2.0))},
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=SHARED,
    )
    # The 4 ranks sync both their chunks at once: the link model's time x slowdown(4), not (8).
    assert shared.dp_sync_s == pytest.approx(2.0 * max(s.dp_sync_s for s in shared.stages))
    assert shared.stages[0].dp_sync_s == shared.stages[2].dp_sync_s > 0


def test_a_hetero_dp_plan_on_a_shared_host_syncs_each_device_over_its_units():
    cluster = ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")
    plan = ParallelPlan.from_dict(
        {
            "format": "megatron_het.plan/1",
            "micro_batch_size": 2,
            "pipelines": [
                {
                    "micro_batches": 3,
                    "stages": [
                        {"accelerator": "emu-fast", "tp": 1, "layers": [0, 2], "ranks": [0]},
                        {"accelerator": "emu-fast", "tp": 1, "layers": [2, 4], "ranks": [1]},
                    ],
                },
                {
                    "micro_batches": 1,
                    "stages": [
                        {"accelerator": "emu-slow", "tp": 2, "layers": [0, 4], "ranks": [2, 3]}
                    ],
                },
            ],
        }
    )
    model = model_preset("tiny-tied")
    gloo = (
        CommEntry("p2p", "intra_node", 1.0, 1e-4),
        CommEntry("collective", "intra_node", 1.0, 1e-4),
    )
    profile = {"cpu": host_profile((1.0, 1.0, 1.5, 2.0), gloo)}
    alone = predict(
        model, plan, cluster, 64, profile, options=RunOptions.from_plan(plan, dtype="fp32")
    )
    shared = predict(
        model,
        plan,
        cluster,
        64,
        profile,
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=SHARED,
    )
    assert [s.pipeline for s in shared.stages] == [0, 0, 1]
    # Every rank syncs at once (slowdown 2.0 for 4 on the host) over the host's gloo: the
    # tp=2 device of pipeline 1 holds all four units, the most.
    host = CommCost(cluster, profile, paced_links=False)
    units = (
        ((0, 1, 2, 3), 512 * 64),
        ((0, 2, 3), 2 * 46208),
        ((1, 2, 3), 2 * 46208),
        ((1, 2, 3), 64),
    )
    slowest = sum(host.dp_sync(ranks, 4 * n).time_s for ranks, n in units)
    assert shared.dp_sync_s == pytest.approx(
        max(2.0 * slowest, max(s.dp_sync_s for s in alone.stages))
    )
    assert shared.stages == alone.stages


def _tp2_pp2_on_a_shared_host(collective_cpu_s: float, **keys: object):
    """The emulated tp2 x pp2 plan with ``keys`` predicted on a host whose p2p transfers take
    0.1 ms + 1 ns per byte and whose TP collective takes 2 ms (``collective_cpu_s`` of it on
    the CPU): the rate model's inputs and pipeline 0's stage timings."""
    cluster = ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")
    plan = dataclasses.replace(ParallelPlan.load("scripts/plans/cpu_emulated_tp2_pp2.json"), **keys)
    base = host_profile((1.0,) * 4, (CommEntry("p2p", "intra_node", 1.0, 1e-4),))
    tp_layer = dataclasses.replace(base.layers[0], tp=2)
    base = dataclasses.replace(
        base, layers=base.layers + (tp_layer,), host_collective_s=(2e-3, collective_cpu_s)
    )
    recorder = Recording()
    predict(
        model_preset("tiny"),
        plan,
        cluster,
        64,
        {"cpu": base},
        options=RunOptions.from_plan(plan, dtype="fp32"),
        rate_model=recorder,
    )
    return plan, recorder.inputs, recorder.result.stages[0]


def test_sequence_parallel_transfers_move_a_ranks_share_on_a_shared_host():
    plan, inputs, timings = _tp2_pp2_on_a_shared_host(1e-3, sequence_parallel=True)
    half = 1e-4 + inputs.act_bytes / 2 / 1e9  # each rank sends and receives its half
    for s, _stage in enumerate(plan.pipelines[0].stages):
        counts = inputs.tp_collectives(s, plan.pipelines[0])
        assert counts.forward_gathers > 0 and counts.forward == 0
        compute = inputs.compute(s, plan.pipelines[0])
        slowdown = 2.0 if s else 1.0
        # One transfer each way per micro-batch, a measured collective's CPU time per
        # all-reduce's worth of gathers (and per norm-gradient all-reduce in backward).
        assert timings[s].forward.work_s == pytest.approx(
            compute.forward_s / slowdown + half + counts.forward_all * 1e-3
        )
        assert timings[s].backward.work_s == pytest.approx(
            compute.backward_s / slowdown + half + counts.backward_all * 1e-3
        )


def test_tp_comm_overlap_rings_on_a_shared_host_by_hand():
    plan, inputs, timings = _tp2_pp2_on_a_shared_host(
        1.5e-3, sequence_parallel=True, tp_comm_overlap=True
    )
    assert inputs.tp_comm_overlap
    half = 1e-4 + inputs.act_bytes / 2 / 1e9  # a boundary transfer: a rank's half
    step = 2 * (1e-4 + inputs.act_bytes / 2 / 1e9)  # a ring step: a block sent, one received
    for s, stage in enumerate(plan.pipelines[0].stages):
        counts = inputs.tp_collectives(s, plan.pipelines[0])
        layers = stage.num_layers
        compute = inputs.compute(s, plan.pipelines[0])
        slowdown = 2.0 if s else 1.0
        # 4 rings a layer forward, 6 backward, one step each at tp 2; the embedding's, the
        # head's and the norm gradients' collectives stay measured collectives.
        rest_forward = counts.forward_all - 2 * layers
        rest_backward = counts.backward_all - 2 * layers
        assert timings[s].forward.work_s == pytest.approx(
            compute.forward_s / slowdown + half + 4 * layers * step + rest_forward * 1.5e-3
        )
        assert timings[s].backward.work_s == pytest.approx(
            compute.backward_s / slowdown + half + 6 * layers * step + rest_backward * 1.5e-3
        )
        # Waits: half a collective's per ring step, a whole one's per remaining collective.
        assert timings[s].forward.wait_s == pytest.approx(
            0.25e-3 * 4 * layers + rest_forward * 0.5e-3
        )
        assert timings[s].backward.wait_s == pytest.approx(
            0.25e-3 * 6 * layers + rest_backward * 0.5e-3
        )
