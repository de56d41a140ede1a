"""The device profiler: activation counting against independent counts, bf16 weights without
autocast, timing that follows the work (host clock on the CPU, device events elsewhere, with a
fake event class), a profile the predictor uses as measured, communicator figures, naming and
merging."""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest
import torch

from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import predict
from megatron_het.perf.measure.communicator_figures import measure_comm
from megatron_het.perf.measure.device_kind import accelerator_for_device
from megatron_het.perf.measure.profile_format import (
    LayerEntry,
    Profile,
    ProfileConditions,
    merge_profiles,
)
from megatron_het.perf.measure.profiler import Sweep, profile_device
from megatron_het.perf.measure.shard_cases import PROFILE_DTYPES, layer_case, rank_stage
from megatron_het.perf.measure.timed_cases import Case, activation_bytes, run_cases
from megatron_het.pipeline.timing import EventTimer, HostTimer, pass_timer

REPO = pathlib.Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
TINY = model_preset("tiny")  # h=64, ffn=176, 4 heads, 2 kv groups, 4 layers


def graph_saved_bytes(out: torch.Tensor, skip: set) -> int:
    """Distinct storages saved by the autograd graph of ``out``, found by walking its nodes'
    ``_saved_*`` attributes (and a custom Function's ``saved_tensors``), minus ``skip``."""
    storages, seen, stack = {}, set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        values = [getattr(node, a) for a in dir(node) if a.startswith("_saved_")]
        if hasattr(node, "saved_tensors"):
            values.append(node.saved_tensors)
        for value in values:
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return sum(n for ptr, n in storages.items() if ptr not in skip)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tp", [1, 2])
def test_layer_activations_match_a_walk_of_the_graph(tp, dtype):
    stage = rank_stage(TINY, tp, (0, 1), False, False, CPU, seed=3, dtype=dtype)
    layer = stage.layers["0"]
    x = torch.randn(2, 16, TINY.hidden_size, dtype=PROFILE_DTYPES[dtype], requires_grad=True)
    cos, sin = stage.rotary.cos_sin(16, CPU, PROFILE_DTYPES[dtype])
    measured = activation_bytes(
        lambda: layer(x, cos, sin), list(layer.parameters()), (cos, sin), CPU
    )
    skip = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), cos, sin)}
    assert measured == graph_saved_bytes(layer(x, cos, sin), skip)
    # The shard holds heads/tp, kv/tp and ffn/tp: its activations shrink with tp.
    assert layer.mlp.gate.weight.shape[0] == TINY.ffn_hidden_size // tp


@pytest.mark.parametrize("dtype, nbytes", [("fp32", 4), ("bf16", 2)])
def test_mlp_activations_match_a_count_by_hand(dtype, nbytes):
    mlp = rank_stage(TINY, 1, (0, 1), False, False, CPU, seed=3, dtype=dtype).layers["0"].mlp
    tokens, h, f = 2 * 16, TINY.hidden_size, TINY.ffn_hidden_size
    x = torch.randn(2, 16, h, dtype=PROFILE_DTYPES[dtype], requires_grad=True)
    # gate/up save x once; SwiGLU saves gate(x) and up(x) (silu is recomputed); down saves
    # the product: 3 tensors of f and 1 of h per token, in the parameters' dtype.
    expected = nbytes * tokens * (h + 3 * f)
    assert activation_bytes(lambda: mlp(x), list(mlp.parameters()), (), CPU) == expected


def test_bf16_cases_run_bf16_weights_without_autocast():
    stage = rank_stage(TINY, 2, (0, 1), False, False, CPU, seed=3, dtype="bf16")
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}
    seen = []
    stage.layers["0"].register_forward_pre_hook(
        lambda module, inputs: seen.append((torch.is_autocast_enabled("cpu"), inputs[0].dtype))
    )
    case = layer_case(stage, 16, 2, 2, "bf16", CPU)
    out = case.forward()
    assert seen == [(False, torch.bfloat16)] and out.dtype == torch.bfloat16
    case.backward(out)
    assert all(p.grad.dtype == torch.bfloat16 for p in stage.parameters())
    fp32_stage = rank_stage(TINY, 2, (0, 1), False, False, CPU, seed=3)
    with pytest.raises(ValueError, match="bf16 case needs torch.bfloat16 parameters"):
        layer_case(fp32_stage, 16, 2, 2, "bf16", CPU)


class FakeDevice:
    """A device that runs what the host enqueues: fake cases advance its clock (ms), fake
    events read it when recorded. Counts synchronisations; an event read before the device
    was synchronised after its recording fails."""

    def __init__(self) -> None:
        self.now_ms, self.recorded, self.synced_upto, self.syncs = 0.0, 0, 0, 0

    def synchronize(self, device=None) -> None:
        self.syncs += 1
        self.synced_upto = self.recorded

    def case(self, forward_ms: list, backward_ms: list) -> Case:
        """A case whose passes take ``forward_ms[i]`` and ``backward_ms[i]`` in turn."""
        passes = iter(zip(forward_ms, backward_ms))
        current = {}

        def forward():
            current["f"], current["b"] = next(passes)
            self.now_ms += current["f"]
            return torch.zeros(())

        def backward(out):
            self.now_ms += current["b"]

        return Case(forward, backward, lambda f, b, saved: (f, b))


class FakeEvent:
    def __init__(self, device: FakeDevice, enable_timing: bool = False) -> None:
        assert enable_timing, "elapsed_time needs timing events"
        self.device, self.order, self.at_ms = device, None, None

    def record(self) -> None:
        self.device.recorded += 1
        self.order, self.at_ms = self.device.recorded, self.device.now_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        assert max(self.order, end.order) <= self.device.synced_upto, "read before a sync"
        return end.at_ms - self.at_ms

    def synchronize(self) -> None:
        """The host waits for this event: it and every event recorded before it are done."""
        self.device.syncs += 1
        self.device.synced_upto = max(self.device.synced_upto, self.order)


def test_accelerator_passes_are_timed_by_device_events(monkeypatch):
    device = FakeDevice()
    fake_cuda = SimpleNamespace(
        Event=lambda enable_timing=False: FakeEvent(device, enable_timing),
        synchronize=device.synchronize,
    )
    monkeypatch.setattr(torch, "cuda", fake_cuda)
    cases = [device.case([9, 3, 5, 4], [20, 8, 7, 6]), device.case([1, 2, 1, 3], [2, 4, 2, 6])]
    # One warm-up pass each (untimed), then the medians of three timed ones.
    entries = run_cases(cases, torch.device("cuda", 0), warmup=1, iters=3)
    assert entries[0] == (pytest.approx(4e-3), pytest.approx(7e-3))
    assert entries[1] == (pytest.approx(2e-3), pytest.approx(4e-3))
    assert device.syncs == 1  # once, after every timed pass was enqueued
    assert isinstance(pass_timer(torch.device("cuda", 0)), EventTimer)


def test_event_timer_refuses_a_read_before_the_sync():
    device = FakeDevice()
    timer = EventTimer(lambda: FakeEvent(device, True))
    start, end = timer.mark(), timer.mark()
    with pytest.raises(RuntimeError, match="before finish"):
        timer.elapsed_s(start, end)
    timer.finish()
    assert timer.elapsed_s(start, end) == 0.0


def test_cpu_passes_are_timed_by_the_host_clock():
    assert isinstance(pass_timer(CPU), HostTimer)
    device = FakeDevice()  # its clock stands in for the host's
    timer = HostTimer(clock=lambda: device.now_ms / 1e3)
    entries = run_cases([device.case([5, 1, 3], [2, 6, 4])], CPU, warmup=0, iters=3, timer=timer)
    assert entries == [(pytest.approx(3e-3), pytest.approx(4e-3))]
    assert device.syncs == 0


@pytest.fixture
def one_thread():
    """One CPU thread: two OpenMP threads on a busy 2-core machine time erratically."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_layer_cases_time_both_passes_and_count_activations(one_thread):
    stage = rank_stage(model_preset("small"), 1, (0, 1), False, False, CPU, seed=3)
    cases = [layer_case(stage, 32, mb, 1, "fp32", CPU) for mb in (1, 4, 16)]
    entries = run_cases(cases, CPU, warmup=1, iters=3)
    # (how the medians are taken: the fake timers above; wall-clock order is not asserted)
    assert [(e.micro_batch, e.compiled) for e in entries] == [(1, False), (4, False), (16, False)]
    assert all(e.forward_s > 0 and e.backward_s > 0 for e in entries)
    assert entries[1].activation_bytes == 4 * entries[0].activation_bytes
    assert entries[2].activation_bytes == 16 * entries[0].activation_bytes


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory) -> Profile:
    sweep = Sweep(seq_lengths=(32,), micro_batch_sizes=(2,), tp_sizes=(1, 2), warmup=0, iters=1)
    profile = profile_device(TINY, sweep, "cpu", CPU)
    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded == profile
    return loaded


def test_profile_holds_every_shape_and_the_conditions(tiny_profile):
    p = tiny_profile
    assert [(e.tp, e.micro_batch, e.seq) for e in p.layers] == [(1, 2, 32), (2, 2, 32)]
    assert len(p.embedding) == len(p.head) == 2
    assert all(e.forward_s > 0 and e.backward_s > 0 for e in (*p.layers, *p.embedding, *p.head))
    assert p.layers[1].activation_bytes < p.layers[0].activation_bytes  # a tp=2 shard
    assert p.optimizer_step_s_per_param > 0
    assert p.conditions.dtype == "fp32" and p.conditions.host and p.conditions.threads >= 1


def test_a_bf16_profile_measures_bf16_weights(tiny_profile):
    sweep = Sweep(
        seq_lengths=(32,), micro_batch_sizes=(2,), tp_sizes=(1,), dtype="bf16", warmup=0, iters=1
    )
    p = profile_device(TINY, sweep, "cpu", CPU)
    assert p.conditions.dtype == "bf16"
    assert {e.dtype for e in (*p.layers, *p.embedding, *p.head)} == {"bf16"}
    assert all(e.forward_s > 0 and e.backward_s > 0 for e in (*p.layers, *p.embedding, *p.head))
    # The fp32 profile's first entry has the same shape: most saved tensors are now bf16 (the
    # norms still keep float32 copies of their input), none is a weight copy.
    fp32 = tiny_profile.layers[0].activation_bytes
    assert 0.45 * fp32 < p.layers[0].activation_bytes < 0.7 * fp32


def test_predict_uses_the_profile_as_measured(tiny_profile):
    cluster = ClusterSpec.load(REPO / "scripts/clusters/cpu_emulated.yaml")
    profiles = {"cpu": tiny_profile}
    plan = ParallelPlan.load(REPO / "scripts/plans/cpu_emulated_tp2_pp2.json")
    prediction = predict(
        TINY, plan, cluster, 32, profiles, options=RunOptions.from_plan(plan, dtype="fp32")
    )
    for stage in prediction.stages:
        assert "layers: profile cpu: eager exact" in stage.source, stage.source
    assert "embedding: profile cpu embedding: exact" in prediction.stages[0].source
    assert "head: profile cpu head: exact" in prediction.stages[1].source
    # pp=4, tp=1: a middle emu-slow stage is one profiled layer times the slowdown of 2.
    plan = ParallelPlan.load(REPO / "scripts/plans/cpu_emulated_pp4.json")
    stage = predict(
        TINY, plan, cluster, 32, profiles, options=RunOptions.from_plan(plan, dtype="fp32")
    ).stages[2]
    layer = tiny_profile.layers[0]
    assert stage.forward_s == pytest.approx(2.0 * layer.forward_s)
    assert stage.backward_s == pytest.approx(2.0 * layer.backward_s)


def test_comm_figures_of_two_local_ranks():
    entries = measure_comm(sizes=(1024, 65536, 1 << 20), warmup=1, iters=3)
    assert [(e.op, e.link_kind) for e in entries] == [
        ("p2p", "intra_node"),
        ("collective", "intra_node"),
    ]
    assert all(e.bandwidth_gbps > 0 and e.latency_s >= 0 for e in entries)
    written = Profile("cpu", ProfileConditions("host", "2", 1, "d"), comm=entries).to_dict()
    profile = Profile.from_dict(written)
    assert profile.comm_figures("collective", "intra_node") == entries[1]


def test_comm_fit_recovers_latency_and_bandwidth():
    from megatron_het.perf.measure.communicator_figures import _fit_alpha_beta

    sizes = (1024, 65536, 1 << 20)
    times = [50e-6 + n / 2e9 for n in sizes]
    times[1] *= 3  # a noisy middle point does not move the fit
    latency, per_byte = _fit_alpha_beta(sizes, times)
    assert latency == pytest.approx(50e-6) and 1 / per_byte == pytest.approx(2e9)


def test_conditions_without_dtype_and_host_still_load(tiny_profile):
    written = tiny_profile.to_dict()
    for key in ("dtype", "host"):
        del written["conditions"][key]
    assert Profile.from_dict(written).conditions.host == ""


@pytest.mark.parametrize(
    "name, memory, kind",
    [
        ("NVIDIA H100 80GB HBM3", None, "H100"),
        ("NVIDIA H200", None, "H200"),
        ("NVIDIA A100-SXM4-40GB", None, "A100-40G"),
        ("NVIDIA A100 PCIe", 79.2, "A100-80G"),
        ("AMD Instinct MI250X", None, "MI250X"),
        ("AMD Instinct MI300X", 191.5, "MI300X"),
        ("Intel(R) Xeon(R) Processor", None, None),
        ("NVIDIA GeForce RTX 4090", 24.0, None),
    ],
)
def test_accelerator_for_device_name(name, memory, kind):
    assert accelerator_for_device(name, memory) == kind


def test_merge_replaces_same_shapes_and_keeps_the_rest(tiny_profile):
    def entry(seq, fwd):
        return LayerEntry(64, 176, 4, 2, seq, 2, 1, "fp32", fwd, 2 * fwd, 100.0)

    old = Profile(
        "cpu",
        tiny_profile.conditions,
        layers=(entry(32, 1.0), entry(64, 2.0)),
        optimizer_step_s_per_param=5.0,
    )
    new = Profile("cpu", tiny_profile.conditions, layers=(entry(32, 3.0), entry(128, 4.0)))
    merged = merge_profiles(old, new)
    assert sorted((e.seq, e.forward_s) for e in merged.layers) == [(32, 3.0), (64, 2.0), (128, 4.0)]
    assert merged.optimizer_step_s_per_param == 5.0
    with pytest.raises(UserError, match="own file"):
        merge_profiles(old, Profile("H100", tiny_profile.conditions))


def test_sweep_rejects_what_cannot_be_measured():
    with pytest.raises(UserError, match="seq_lengths"):
        Sweep(seq_lengths=())
    with pytest.raises(UserError, match="dtype"):
        Sweep(dtype="fp8")
    with pytest.raises(UserError, match="tp=3"):
        Sweep(tp_sizes=(3,)).check_model(TINY)
    with pytest.raises(UserError, match="positions"):
        Sweep(seq_lengths=(4096,)).check_model(TINY)


@pytest.mark.slow  # inductor compiles the layer for two shards (about 20 s on 2 cores)
def test_a_compiled_profile_marks_its_layers(monkeypatch) -> None:
    from megatron_het.model.compile import compile_layers, is_compiled
    from megatron_het.perf.measure import profiler

    with pytest.raises(UserError, match="at least one warmup pass"):
        Sweep(compile=True, warmup=0)
    compiled = []

    def spy(stage, mode=None):
        compile_layers(stage, mode)
        compiled.append(all(is_compiled(layer) for layer in stage.layers.values()))

    monkeypatch.setattr(profiler, "compile_layers", spy)
    sweep = Sweep(
        seq_lengths=(32,), micro_batch_sizes=(2,), tp_sizes=(1, 2), warmup=1, iters=1, compile=True
    )
    p = profile_device(TINY, sweep, "cpu", CPU)
    assert compiled == [True, True]  # the layer shard of each TP size
    assert [(e.tp, e.compiled) for e in p.layers] == [(1, True), (2, True)]
    assert all(e.forward_s > 0 and e.backward_s > 0 and e.activation_bytes > 0 for e in p.layers)
