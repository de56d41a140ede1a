"""The device profiler: activation counting against independent counts, timing that follows the
work, a profile the predictor uses as measured, communicator figures, naming and merging."""
from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

from megatron_het.cluster import ClusterSpec
from megatron_het.config import model_preset
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import predict
from megatron_het.perf.profile import LayerEntry, Profile, ProfileConditions, merge_profiles
from megatron_het.perf.profiler import (PROFILE_DTYPES, SavedActivations, Sweep,
                                        accelerator_for_device, activation_bytes, layer_case,
                                        measure_comm, profile_device, rank_stage, run_cases)

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


@pytest.mark.parametrize("tp", [1, 2])
def test_layer_activations_match_a_walk_of_the_graph(tp):
    stage = rank_stage(TINY, tp, (0, 1), False, False, CPU, seed=3)
    layer = stage.layers["0"]
    x = torch.randn(2, 16, TINY.hidden_size, requires_grad=True)
    cos, sin = stage.rotary.cos_sin(16, CPU, torch.float32)
    measured = activation_bytes(lambda: layer(x, cos, sin), list(layer.parameters()),
                                (cos, sin), CPU)
    skip = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), cos, sin)}
    assert measured == graph_saved_bytes(layer(x, cos, sin), skip)
    # The shard holds heads/tp, kv/tp and ffn/tp: its activations shrink with tp.
    assert layer.mlp.gate.weight.shape[0] == TINY.ffn_hidden_size // tp


def test_mlp_activations_match_a_count_by_hand():
    mlp = rank_stage(TINY, 1, (0, 1), False, False, CPU, seed=3).layers["0"].mlp
    tokens, h, f = 2 * 16, TINY.hidden_size, TINY.ffn_hidden_size
    x = torch.randn(2, 16, h, requires_grad=True)
    # gate/up save x once; silu saves gate(x); the product saves silu(.) and up(x); down saves
    # the product: 4 tensors of f and 1 of h per token, fp32.
    expected = 4 * tokens * (h + 4 * f)
    assert activation_bytes(lambda: mlp(x), list(mlp.parameters()), (), CPU) == expected


def test_autocast_weight_copies_are_not_activations():
    linear = nn.Linear(8, 16, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedActivations(linear.parameters()) as counter, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(x)
    assert counter.nbytes == 4 * 8 * 2  # the bf16 copy of the input
    assert counter.parameter_copy_bytes == 16 * 8 * 2  # the bf16 copy of the weight
    del out


@pytest.fixture
def one_thread():
    """One CPU thread: two OpenMP threads on a busy 2-core machine time erratically."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_forward_time_and_activations_grow_with_micro_batch(one_thread):
    stage = rank_stage(model_preset("small"), 1, (0, 1), False, False, CPU, seed=3)
    cases = [layer_case(stage, 32, mb, 1, "fp32", CPU) for mb in (1, 4, 16)]
    # The timed passes alternate between the cases, so load from elsewhere hits all of them.
    entries = run_cases(cases, CPU, warmup=1, iters=5)
    times = [e.forward_s for e in entries]
    assert times[0] < times[1] < times[2], times
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


def test_predict_uses_the_profile_as_measured(tiny_profile):
    cluster = ClusterSpec.load(REPO / "scripts/clusters/cpu_emulated.yaml")
    profiles = {"cpu": tiny_profile}
    plan = ParallelPlan.load(REPO / "scripts/plans/cpu_emulated_tp2_pp2.json")
    prediction = predict(TINY, plan, cluster, 32, profiles, dtype="fp32")
    for stage in prediction.stages:
        assert "layers: profile cpu: exact" in stage.source, stage.source
    assert "embedding: profile cpu embedding: exact" in prediction.stages[0].source
    assert "head: profile cpu head: exact" in prediction.stages[1].source
    # pp=4, tp=1: a middle emu-slow stage is one profiled layer times the slowdown of 2.
    plan = ParallelPlan.load(REPO / "scripts/plans/cpu_emulated_pp4.json")
    stage = predict(TINY, plan, cluster, 32, profiles, dtype="fp32").stages[2]
    layer = tiny_profile.layers[0]
    assert stage.forward_s == pytest.approx(2.0 * layer.forward_s)
    assert stage.backward_s == pytest.approx(2.0 * layer.backward_s)


def test_comm_figures_of_two_local_ranks():
    entries = measure_comm(sizes=(1024, 65536, 1 << 20), warmup=1, iters=3)
    assert [(e.op, e.link_kind) for e in entries] == [("p2p", "intra_node"),
                                                      ("collective", "intra_node")]
    assert all(e.bandwidth_gbps > 0 and e.latency_s >= 0 for e in entries)
    written = Profile("cpu", ProfileConditions("host", "2", 1, "d"), comm=entries).to_dict()
    profile = Profile.from_dict(written)
    assert profile.comm_figures("collective", "intra_node") == entries[1]


def test_comm_fit_recovers_latency_and_bandwidth():
    from megatron_het.perf.profiler import _fit_alpha_beta
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


@pytest.mark.parametrize("name, memory, kind", [
    ("NVIDIA H100 80GB HBM3", None, "H100"), ("NVIDIA H200", None, "H200"),
    ("NVIDIA A100-SXM4-40GB", None, "A100-40G"), ("NVIDIA A100 PCIe", 79.2, "A100-80G"),
    ("AMD Instinct MI250X", None, "MI250X"), ("AMD Instinct MI300X", 191.5, "MI300X"),
    ("Intel(R) Xeon(R) Processor", None, None), ("NVIDIA GeForce RTX 4090", 24.0, None)])
def test_accelerator_for_device_name(name, memory, kind):
    assert accelerator_for_device(name, memory) == kind


def test_merge_replaces_same_shapes_and_keeps_the_rest(tiny_profile):
    def entry(seq, fwd):
        return LayerEntry(64, 176, 4, 2, seq, 2, 1, "fp32", fwd, 2 * fwd, 100.0)
    old = Profile("cpu", tiny_profile.conditions, layers=(entry(32, 1.0), entry(64, 2.0)),
                  optimizer_step_s_per_param=5.0)
    new = Profile("cpu", tiny_profile.conditions, layers=(entry(32, 3.0), entry(128, 4.0)))
    merged = merge_profiles(old, new)
    assert sorted((e.seq, e.forward_s) for e in merged.layers) == [(32, 3.0), (64, 2.0),
                                                                   (128, 4.0)]
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_allocator_activations_agree_with_the_saved_tensor_count(dtype):
    device = torch.device("cuda", torch.cuda.current_device())
    stage = rank_stage(TINY, 2, (0, 1), False, False, device, seed=3)
    layer = stage.layers["0"]
    entry = run_cases([layer_case(stage, 64, 2, 2, dtype, device)], device, 1, 2)[0]
    x = torch.randn(2, 64, TINY.hidden_size, device=device, requires_grad=True)
    cos, sin = stage.rotary.cos_sin(64, device, PROFILE_DTYPES[dtype])
    with SavedActivations(layer.parameters(), (cos, sin)) as counter, \
            torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        out = layer(x, cos, sin)
    # The allocator also holds the output (in place of the saved input) and rounds blocks up.
    assert entry.activation_bytes == pytest.approx(counter.nbytes, rel=0.25)
    assert entry.forward_s > 0 and entry.backward_s > 0
    del out
