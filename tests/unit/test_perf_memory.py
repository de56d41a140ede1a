"""Memory terms: parameter counts per stage, Megatron's mixed-precision bytes, 1F1B in flight."""

import pytest

from megatron_het.config import model_preset
from megatron_het.model.rope import rope_table_dtype
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.perf.cost.memory import (
    MemoryBreakdown,
    device_memory,
    group_activations,
    in_flight_micro_batches,
    layer_parameters,
    stage_memory,
    stage_parameters,
)


def pipeline(model, splits, tp=1):
    stages = tuple(StagePlan("cpu", tp, layers, tuple(range(tp))) for layers in splits)
    return PipelinePlan(1, stages)


@pytest.mark.parametrize("name", ["tiny", "llama2-7b", "llama-140b"])
def test_stage_parameters_add_up_to_the_model(name):
    model = model_preset(name)
    L = model.num_layers
    one = pipeline(model, [(0, L)])
    assert stage_parameters(model, one.stages[0]) == model.num_parameters()
    split = pipeline(model, [(0, L // 4), (L // 4, L // 2), (L // 2, L)])
    assert sum(stage_parameters(model, s) for s in split.stages) == model.num_parameters()


def test_tied_embeddings_keep_a_copy_on_the_last_stage():
    model = model_preset("tiny-tied")
    assert stage_parameters(model, pipeline(model, [(0, 4)]).stages[0]) == model.num_parameters()
    split = pipeline(model, [(0, 2), (2, 4)])
    copy = model.vocab_size * model.hidden_size
    assert sum(stage_parameters(model, s) for s in split.stages) == model.num_parameters() + copy


def test_tp_shards_everything_but_the_norms():
    model = model_preset("llama2-7b")
    h = model.hidden_size
    assert 4 * layer_parameters(model, 4) == layer_parameters(model, 1) + 3 * 2 * h


def test_memory_terms_for_a_known_config():
    params = 1_000_000
    bf16 = stage_memory(params, "bf16", zero1_dp=1, activation_per_micro_batch=1000, in_flight=3)
    assert bf16 == MemoryBreakdown(2e6, 4e6, 12e6, 3000.0)
    assert bf16.total_bytes == 2e6 + 4e6 + 12e6 + 3000
    zero = stage_memory(
        params, "bf16", zero1_dp=4, activation_per_micro_batch=1000, in_flight=3, transient_bytes=7
    )
    assert zero.optimizer_bytes == 3e6 and zero.transient_bytes == 7
    fp32 = stage_memory(params, "fp32", 1, 0, 1)
    assert (fp32.weights_bytes, fp32.grads_bytes, fp32.optimizer_bytes) == (4e6, 4e6, 8e6)


def test_micro_batches_in_flight_under_1f1b():
    assert [in_flight_micro_batches(4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight_micro_batches(4, s, 2) for s in range(4)] == [2, 2, 2, 1]


@pytest.mark.parametrize("pp,m", [(1, 3), (3, 2), (4, 8)])
def test_in_flight_matches_the_schedule(pp, m):
    from megatron_het.pipeline.schedules import build_schedule, check_schedule

    report = check_schedule(build_schedule("1f1b", pp, m), m)
    assert list(report.peak_in_flight) == [in_flight_micro_batches(pp, s, m) for s in range(pp)]


@pytest.mark.parametrize(
    "p,v,m", [(2, 2, 2), (2, 2, 4), (3, 2, 6), (4, 3, 8), (2, 4, 6), (3, 1, 5)]
)
def test_group_activations_follow_the_schedule(p, v, m):
    from megatron_het.pipeline.schedules import build_schedule, check_schedule

    lists = build_schedule("1f1b", p, m, num_chunks=v)
    report = check_schedule(lists, m, p * v)
    for g, steps in enumerate(lists):
        peak, pairs = group_activations(steps, lambda s: 1.0 + s, g)
        assert pairs == report.peak_in_flight[g]
        if v == 1:
            assert pairs == in_flight_micro_batches(p, g, m)
        assert (1.0 + g) * pairs <= peak <= (1.0 + g + (v - 1) * p) * pairs
        assert group_activations(steps, lambda s: 3.0, g)[0] == 3.0 * pairs


def test_device_memory_holds_every_chunk():
    two = device_memory(3_000, "bf16", 1, 4000.0, 5.0)
    assert two == stage_memory(3_000, "bf16", 1, 1000.0, 4, 5.0)
    assert two.total_bytes == 3_000 * (2 + 4 + 12) + 4000 + 5


def test_capacity_is_the_memory_cap_of_an_emulated_kind():
    from megatron_het.cluster import AcceleratorRegistry
    from megatron_het.perf.cost.memory import GIB, device_capacity_bytes

    kinds = AcceleratorRegistry.builtin()
    assert device_capacity_bytes(kinds.get("H100")) == 80 * GIB
    capped = kinds.get("emu-slow").replace(memory_cap_gib=1.5)
    assert device_capacity_bytes(capped) == 1.5 * GIB


def _saved_bytes(run, exclude) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``run()`` executes,
    leaving out the storages in ``exclude`` (parameters, cached tables)."""
    import torch

    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(n for ptr, n in storages.items() if ptr not in exclude)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_terms_are_the_tensors_the_model_saves(dtype):
    """The memory model's per-micro-batch activations equal, byte for byte, what a decoder
    layer and the fused head hand to autograd (tensor accounting on CPU)."""
    import torch

    from megatron_het.model.llama import build_model
    from megatron_het.perf.cost.roofline import (
        LayerShape,
        head_activation_bytes,
        layer_activation_bytes,
    )

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    config = model_preset("tiny")
    model = build_model(config, seed=1).to(torch_dtype)
    if dtype == "bf16":  # as the optimizer leaves them: float32 main gradients
        for param in model.parameters():
            param.main_grad = torch.zeros(param.shape)
    batch, seq = 2, 64
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    x = model.embedding(tokens).detach().requires_grad_()
    cos, sin = model.rotary.cos_sin(seq, x.device, rope_table_dtype(x))  # as the model's
    exclude = {t.untyped_storage().data_ptr() for t in (*model.parameters(), cos, sin)}
    shape = LayerShape.of(config, seq=seq, micro_batch=batch, tp=1)
    layer = _saved_bytes(lambda: model.layers["0"](x, cos, sin), exclude)
    assert layer == layer_activation_bytes(shape, dtype)
    head = _saved_bytes(lambda: model.head(x, labels=tokens), exclude)
    assert head == head_activation_bytes(shape, config.vocab_size, dtype)
