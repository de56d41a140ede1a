"""Stage bounds inside a layer (``x.5``: between its attention block and its MLP block): the
plan's form and checks, the model's pieces, checkpoint names, replica units, and the cost
model's blocks adding up to whole layers."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_het.checkpoint.reshard import stage_parameter_names
from megatron_het.cluster.accelerators import AcceleratorRegistry
from megatron_het.config import model_preset
from megatron_het.errors import UserError
from megatron_het.model.llama import LlamaModel, build_model
from megatron_het.model.rope import rope_table_dtype
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_builders import interleave_plan
from megatron_het.parallel.plan_validation import validate
from megatron_het.parallel.replicas import ReplicaUnit, replica_units
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan, block_of
from megatron_het.perf.cost.compute_time import LayerBlocks, ProfileChoice, stage_compute
from megatron_het.perf.cost.dp_sync import unit_parameters
from megatron_het.perf.cost.memory import layer_parameters, stage_parameters
from megatron_het.perf.cost.roofline import (
    LayerShape,
    block_forward_ops,
    layer_activation_bytes,
    layer_forward_ops,
    ops_time,
)

TINY = model_preset("tiny")  # 4 layers
KINDS = AcceleratorRegistry.builtin()


def _plan(bounds, micro_batches=4, **extra):
    stages = [
        {"accelerator": "cpu", "tp": 1, "layers": [a, b], "ranks": [i], **extra}
        for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]
    return ParallelPlan.from_dict(
        {
            "format": "megatron_het.plan/1",
            "micro_batch_size": 1,
            "pipelines": [{"micro_batches": micro_batches, "stages": stages}],
        }
    )


def test_half_layer_bounds_parse_validate_and_round_trip():
    plan = _plan([0, 1.5, 2.5, 4])
    validate(plan, TINY)
    first, middle, last = plan.pipelines[0].stages
    assert first.layers == (0, 1.5) and isinstance(first.layers[0], int)
    assert (first.block_counts, middle.block_counts, last.block_counts) == ((2, 1), (1, 1), (1, 2))
    assert list(middle.layer_indices) == [1, 2]
    assert middle.layer_parts(1) == ("mlp",) and middle.layer_parts(2) == ("attention",)
    assert first.splits_layers and middle.num_layers == 1
    assert "layers [1.5, 2.5)" in plan.describe()
    assert ParallelPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    # A whole number written as a float is a whole-layer bound.
    assert _plan([0, 2.0, 4]).pipelines[0].stages[0].layers == (0, 2)


@pytest.mark.parametrize(
    "ranges, message",
    [
        ([(0, 1.25), (1.25, 4)], "numbers ending in .5"),
        ([(0, 2), (1.5, 4)], "layers \\[1.5, 2\\) are on both stage 0 and stage 1"),
        ([(0, 1.5), (2, 4)], "layers \\[1.5, 2\\) are on no stage"),
        ([(0, 1.5), (1.5, 1.5), (1.5, 4)], "empty layer range \\[1.5, 1.5\\)"),
    ],
)
def test_bad_half_layer_bounds_get_one_line(ranges, message):
    stages = [
        {"accelerator": "cpu", "tp": 1, "layers": list(r), "ranks": [i]}
        for i, r in enumerate(ranges)
    ]
    with pytest.raises(UserError, match=message):
        validate(
            ParallelPlan.from_dict(
                {
                    "format": "megatron_het.plan/1",
                    "micro_batch_size": 1,
                    "pipelines": [{"micro_batches": 1, "stages": stages}],
                }
            ),
            TINY,
        )


def test_block_recompute_counts_and_interleaving_refuse_split_stages():
    plan = _plan([0, 1.5, 4], recompute=True)
    validate(plan, TINY)  # recompute of everything is fine
    counted = _plan([0, 1.5, 4], recompute=True, recompute_num_layers=1)
    with pytest.raises(UserError, match="half-layer bounds \\[0, 1.5\\) and recompute_num_layers"):
        validate(counted, TINY)
    with pytest.raises(UserError, match="half-layer bounds \\[0, 1.5\\); interleave a plan"):
        interleave_plan(plan, 2)


def test_stages_split_inside_layers_compute_the_whole_model():
    torch.manual_seed(0)
    whole = build_model(TINY, seed=5)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    bounds = [0, 0.5, 2.5, 4]
    stages = [
        build_model(TINY, 5, (a, b), has_embedding=a == 0, has_head=b == 4)
        for a, b in zip(bounds, bounds[1:])
    ]
    assert [dict(stages[0].layers["0"].named_children()).keys()] == [{"input_norm", "attention"}]
    names = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in whole.named_parameters())
    hidden = tokens
    for stage in stages:
        hidden = stage(hidden)
    torch.testing.assert_close(hidden, whole(tokens), rtol=0, atol=1e-6)
    # Recompute checkpoints each piece on its own and gives the same gradients.
    recomputed = LlamaModel(TINY, chunks=[(0.5, 2.5, True)], has_embedding=False, has_head=False)
    recomputed.load_state_dict(stages[1].state_dict())
    x = whole.embedding(tokens).detach()
    for model in (stages[1], recomputed):
        model.zero_grad()
        model(x).square().sum().backward()
    for (name, a), (_, b) in zip(stages[1].named_parameters(), recomputed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5, msg=name)


def test_one_model_cannot_hold_a_layer_split_over_two_of_its_chunks():
    with pytest.raises(UserError, match="two chunks of one model share layer 1"):
        LlamaModel(TINY, chunks=[(0, 1.5, False), (1.5, 4, False)])


def test_checkpoint_names_and_replica_units_follow_the_blocks():
    plan = _plan([0, 1.5, 2.5, 4])
    names = [stage_parameter_names(TINY, st) for st in plan.pipelines[0].stages]
    assert "layers.1.input_norm.weight" in names[0] and "layers.1.mlp.up.weight" in names[1]
    assert not {n for n in names[0] if n.startswith("layers.1.mlp")}
    assert sum(len(n) for n in names) == len({n for group in names for n in group})
    assert block_of("layers.2.post_attention_norm.weight") == 5

    # Pipeline 0 splits at 1.5, pipeline 1 at 2.5: the units change holders at each bound.
    def pipeline(bound, first):
        return PipelinePlan(
            1,
            (
                StagePlan("cpu", 1, (0, bound), (first,)),
                StagePlan("cpu", 1, (bound, 4), (first + 1,)),
            ),
        )

    hetero = ParallelPlan(1, (pipeline(1.5, 0), pipeline(2.5, 2)))
    layers = [
        (unit.layers, holders)
        for unit, holders in replica_units(hetero, 4, False)
        if unit.part == "layers"
    ]
    assert layers == [((0, 1.5), (0, 2)), ((1.5, 2.5), (1, 2)), ((2.5, 4), (1, 3))]
    unit = ReplicaUnit("layers", (1.5, 2.5))
    assert unit.holds("layers.1.mlp.down.weight") and unit.holds("layers.2.attention.qkv.weight")
    assert not unit.holds("layers.2.mlp.gate.weight")
    whole = unit_parameters(TINY, ReplicaUnit("layers", (0, 4)))
    assert sum(unit_parameters(TINY, ReplicaUnit("layers", r)) for r, _ in layers) == whole


def test_memory_and_compute_of_blocks_add_up_to_whole_layers():
    stages = _plan([0, 1.5, 2.5, 4]).pipelines[0].stages
    inner = [StagePlan("cpu", 1, st.layers, st.ranks) for st in stages]  # no embedding, head
    assert sum(stage_parameters(TINY, st) for st in inner) == 4 * layer_parameters(TINY, 1)
    shape = LayerShape.of(TINY, 64, 2, 1)
    spec = KINDS.get("H100")
    attention, mlp = block_forward_ops(shape)
    for a, m, w in zip(
        ops_time(attention, spec, "bf16"),
        ops_time(mlp, spec, "bf16"),
        ops_time(layer_forward_ops(shape), spec, "bf16"),
    ):
        assert a + m == pytest.approx(w, rel=1e-12) and 0 < a < m
    # Also with sequence parallelism (norms and residual adds on 1/tp of the positions).
    tp2 = LayerShape.of(TINY, 64, 2, 2)
    blocks = block_forward_ops(tp2, sequence_parallel=True)
    whole_sp = ops_time(layer_forward_ops(tp2, sequence_parallel=True), spec, "bf16")
    for a, m, w in zip(*(ops_time(ops, spec, "bf16") for ops in blocks), whole_sp):
        assert a + m == pytest.approx(w, rel=1e-12)
    assert whole_sp[0] < ops_time(layer_forward_ops(tp2), spec, "bf16")[0]
    assert layer_activation_bytes(shape, "bf16", part="attention") + layer_activation_bytes(
        shape, "bf16", part="mlp"
    ) == layer_activation_bytes(shape, "bf16")

    def compute(st, recompute=0):
        return stage_compute(
            TINY,
            spec,
            shape,
            st.num_layers,
            False,
            False,
            recompute,
            "bf16",
            ProfileChoice(None),
            blocks=LayerBlocks.of(st),
        )

    whole = compute(StagePlan("cpu", 1, (0, 4), (0,)))
    parts = [compute(st) for st in inner]
    for field in ("forward_s", "backward_s", "activation_bytes"):
        assert sum(getattr(p, field) for p in parts) == pytest.approx(getattr(whole, field))
    # The attention-heavy middle stage ([1.5, 2.5): an MLP block and an attention block)
    # costs one layer; the first ([0, 1.5)) less than 1.5 layers, since its extra is attention.
    assert parts[1].forward_s == pytest.approx(whole.forward_s / 4)
    assert parts[0].forward_s < 1.5 * whole.forward_s / 4 < parts[2].forward_s
    recomputed = compute(inner[0], inner[0].num_layers)
    assert recomputed.backward_s == pytest.approx(parts[0].backward_s + parts[0].forward_s)
    assert recomputed.activation_bytes < parts[0].activation_bytes


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("part, layers", [("attention", (0, 0.5)), ("mlp", (0.5, 1))])
def test_block_activations_are_the_tensors_the_block_saves(dtype, part, layers):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = build_model(TINY, 1, layers, has_embedding=False, has_head=False).to(torch_dtype)
    batch, seq = 2, 64
    x = torch.randn(batch, seq, TINY.hidden_size, dtype=torch_dtype, requires_grad=True)
    cos, sin = model.rotary.cos_sin(seq, x.device, rope_table_dtype(x))  # as the model's
    exclude = {t.untyped_storage().data_ptr() for t in (*model.parameters(), cos, sin)}
    storages: dict[int, int] = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.layers["0"](x, cos, sin)
    saved = sum(n for ptr, n in storages.items() if ptr not in exclude)
    shape = LayerShape.of(TINY, seq=seq, micro_batch=batch, tp=1)
    assert saved == layer_activation_bytes(shape, dtype, part=part)
