"""EMULATION set-up of a run: build_emulation per rank (region timer, wire hooks, profile device
times, log line) and the memory cap of emulated kinds checked before a run."""

from pathlib import Path

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.emulation import EmulatedWires, Emulator, build_emulation, check_memory_caps
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import predict
from megatron_het.perf.cost.memory import GIB
from megatron_het.perf.measure.profile_format import (
    EndEntry,
    LayerEntry,
    Profile,
    ProfileConditions,
)
from megatron_het.pipeline.executor import compute_region_key

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "scripts" / "clusters" / "cpu_emulated.yaml"
PLAN = ROOT / "scripts" / "plans" / "cpu_emulated_3stage.json"
MODEL = model_preset("tiny")
SEQ = 32


def host_profile(dtype: str = "fp32") -> Profile:
    """The tiny model at seq 32, micro-batch 2, TP 1 and 2: a layer takes (10, 20) ms, the
    embedding (1, 2) ms and the head (3, 4) ms, divided by TP."""
    h, v = MODEL.hidden_size, MODEL.vocab_size
    layers = tuple(
        LayerEntry(
            h,
            MODEL.ffn_hidden_size,
            MODEL.num_attention_heads,
            MODEL.num_query_groups,
            SEQ,
            2,
            tp,
            dtype,
            0.010 / tp,
            0.020 / tp,
            1e5,
        )
        for tp in (1, 2)
    )

    def ends(fwd: float, bwd: float) -> tuple:
        return tuple(EndEntry(h, v, SEQ, 2, tp, dtype, fwd / tp, bwd / tp) for tp in (1, 2))

    return Profile(
        "cpu",
        ProfileConditions("host", "2.x", 1, "2026-01-01"),
        layers=layers,
        embedding=ends(0.001, 0.002),
        head=ends(0.003, 0.004),
    )


def setup(rank: int, **kwargs):
    return build_emulation(
        ClusterSpec.load(CLUSTER), ParallelPlan.load(PLAN), rank, MODEL, SEQ, "fp32", **kwargs
    )


def cpu_cluster(world_size: int) -> ClusterSpec:
    return ClusterSpec.from_dict(
        {
            "name": "cpu",
            "node_groups": [
                {
                    "name": "cpu",
                    "accelerator": "cpu",
                    "nodes": 1,
                    "devices_per_node": world_size,
                    "nic_bandwidth_gbit_per_s": 10,
                }
            ],
        }
    )


def test_each_rank_gets_its_kind_timer_and_the_cluster_wires():
    slow = setup(2, threads=1)
    assert isinstance(slow.region_timer, Emulator) and slow.emulated
    assert (slow.region_timer.slowdown, slow.region_timer.basis) == (2.0, "cpu")
    assert slow.region_timer.name == "emu-slow (emulated)"
    assert slow.region_timer.fixed_reference_s == {}
    assert setup(0, threads=4).region_timer.basis == "wall"
    assert isinstance(slow.wire_hooks, EmulatedWires)
    assert slow.wire_hooks.wire_for(frozenset(("emu-fast", "emu-slow"))) is not None
    assert slow.wire_hooks.wire_for(frozenset(("emu-slow",))) is None
    assert slow.device_times == {}
    assert slow.description == (
        "> EMULATION: emulated ranks pad each compute region to slowdown x its CPU time: "
        "emu-fast (emulated) x1 on ranks [0, 1], emu-slow (emulated) x2 on ranks [2, 3]; "
        "emulated links: emu-fast <-> emu-slow 2 GB/s, 50 us"
    )
    assert setup(0).description == slow.description  # one line for the whole run
    assert slow.late_warning() is None


def test_a_kind_that_is_not_emulated_gets_no_hooks():
    plan = ParallelPlan.load(PLAN)
    emulation = build_emulation(cpu_cluster(4), plan, 1, MODEL, SEQ, "fp32")
    assert (emulation.region_timer, emulation.wire_hooks, emulation.description) == (None, None, "")
    assert not emulation.emulated and emulation.late_warning() is None


def test_a_profile_fixes_every_emulated_stage_time():
    profile = host_profile()
    emulation = setup(2, profile=profile, profile_source="cpu.json", threads=1)
    # Stage 0: tp=2, 1 layer + embedding; stage 1: 2 layers; stage 2: 1 layer + head.
    assert emulation.device_times == {
        0: (pytest.approx((0.0055, 0.011)),),
        1: (pytest.approx((0.0055, 0.011)),),
        2: (pytest.approx((0.020, 0.040)),),
        3: (pytest.approx((0.013, 0.024)),),
    }
    assert emulation.region_timer.fixed_reference_s == {
        compute_region_key("forward", False): pytest.approx(0.020),
        compute_region_key("forward", True): pytest.approx(0.020),
        compute_region_key("backward", False): pytest.approx(0.040),
    }
    assert emulation.description.startswith(
        "> EMULATION: stage compute of emulated ranks timed from profile cpu.json (slowdown x "
        "forward + backward per micro-batch): rank 0 1 x (5.5 + 11.0) ms; rank 1 1 x (5.5 + "
        "11.0) ms; rank 2 2 x (20.0 + 40.0) ms; rank 3 2 x (13.0 + 24.0) ms; emulated links: "
    )
    # The predictor's profile map works as well as the profile itself.
    assert setup(2, profile={"cpu": profile}, threads=1).device_times == emulation.device_times


def test_profile_errors_are_one_line():
    with pytest.raises(
        UserError,
        match=r"--emulation-profile bf16.json: no fp32 figures for "
        r"the stage on ranks \[0, 1\] .*--threads 1 --dtype fp32 --seq-lengths \d+ "
        r"--micro-batch-sizes \d+ --tp \d+ ",
    ):
        setup(0, profile=host_profile("bf16"), profile_source="bf16.json", threads=1)
    with pytest.raises(UserError, match="and cluster cpu has none; drop the flag"):
        build_emulation(
            cpu_cluster(4),
            ParallelPlan.load(PLAN),
            0,
            MODEL,
            SEQ,
            "fp32",
            host_profile(),
            "cpu.json",
        )
    with pytest.raises(UserError, match=r"need one compute thread per rank \(OMP_NUM_THREADS=1\)"):
        setup(0, profile=host_profile(), threads=4)


def capped_cluster(cap_gib: float) -> ClusterSpec:
    d = ClusterSpec.load(CLUSTER).to_dict()
    d["accelerators"] = {"emu-slow": {"memory_cap_gib": cap_gib}}
    return ClusterSpec.from_dict(d)


def test_memory_caps_name_the_stage_that_does_not_fit():
    plan = ParallelPlan.load(PLAN)
    rows = predict(
        MODEL,
        plan,
        ClusterSpec.load(CLUSTER),
        SEQ,
        options=RunOptions.from_plan(plan, dtype="fp32"),
    ).stages
    need = rows[1].memory.total_bytes / GIB  # 2 emu-slow layers on rank 2
    assert need > rows[2].memory.total_bytes / GIB
    cap = 0.99 * need
    with pytest.raises(UserError) as info:
        check_memory_caps(
            MODEL,
            plan,
            capped_cluster(cap),
            SEQ,
            RunOptions.from_plan(plan, dtype="fp32", fused_elementwise=False),
        )
    assert str(info.value) == (
        f"pipeline 0 stage 1 (emu-slow (emulated), tp=1, ranks [2]) needs {need:.3g} GiB per "
        f"device but the emulated memory cap of emu-slow is {cap:g} GiB; give it fewer layers, "
        f"a larger tp, recompute or the distributed optimizer, or raise memory_cap_gib"
    )
    assert "\n" not in str(info.value)
    check_memory_caps(
        MODEL,
        plan,
        capped_cluster(1.01 * need),
        SEQ,
        RunOptions.from_plan(plan, dtype="fp32", fused_elementwise=False),
    )
    check_memory_caps(
        MODEL,
        plan,
        ClusterSpec.load(CLUSTER),
        SEQ,
        RunOptions.from_plan(plan, dtype="fp32", fused_elementwise=False),
    )  # no caps


def test_memory_caps_follow_the_memory_model():
    plan = ParallelPlan.load(PLAN)
    rows = predict(
        MODEL,
        plan,
        ClusterSpec.load(CLUSTER),
        SEQ,
        options=RunOptions.from_plan(plan, dtype="bf16"),
    ).stages
    bf16 = rows[1].memory.total_bytes / GIB
    # bf16 weights and activations need less than fp32: a cap between the two passes bf16 only.
    fp32 = predict(
        MODEL,
        plan,
        ClusterSpec.load(CLUSTER),
        SEQ,
        options=RunOptions.from_plan(plan, dtype="fp32"),
    ).stages[1]
    between = (bf16 + fp32.memory.total_bytes / GIB) / 2
    check_memory_caps(
        MODEL,
        plan,
        capped_cluster(between),
        SEQ,
        RunOptions.from_plan(plan, dtype="bf16", fused_elementwise=False),
    )
    with pytest.raises(UserError, match="pipeline 0 stage 1"):
        check_memory_caps(
            MODEL,
            plan,
            capped_cluster(between),
            SEQ,
            RunOptions.from_plan(plan, dtype="fp32", fused_elementwise=False),
        )


def test_the_host_profile_s_entries_of_the_run_s_mode_time_the_ranks():
    """A host profile with eager and compiled layers: a --compile run's emulated ranks take
    the compiled figures, an eager run's the eager ones."""
    import dataclasses

    eager = host_profile()
    compiled = tuple(
        dataclasses.replace(
            e, forward_s=e.forward_s / 2, backward_s=e.backward_s / 2, compiled=True
        )
        for e in eager.layers
    )
    both = dataclasses.replace(eager, layers=eager.layers + compiled)
    times = {
        fused: setup(
            2, threads=1, profile=both, profile_source="cpu.json", fused_elementwise=fused
        ).device_times
        for fused in (False, True)
    }
    assert (
        times[False] == setup(2, threads=1, profile=eager, profile_source="cpu.json").device_times
    )
    for rank, stages in times[True].items():
        for (fwd, bwd), (eager_fwd, eager_bwd) in zip(stages, times[False][rank]):
            assert fwd < eager_fwd and bwd < eager_bwd
