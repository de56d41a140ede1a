"""Cost model: per-layer FLOPs against ModelConfig.flops_per_token, roofline by hand, emulation."""
import pytest

from megatron_het.cluster import AcceleratorRegistry
from megatron_het.config import model_preset
from megatron_het.perf.cost_model import (Efficiency, LayerShape, Op, gemm, head_forward_flops,
                                          layer_activation_bytes, layer_forward_flops,
                                          layer_forward_ops, layer_input_bytes, op_time,
                                          ops_time)

KINDS = AcceleratorRegistry.builtin()
EXACT = Efficiency(gemm=1.0, attention=1.0, memory=1.0)


@pytest.mark.parametrize("name", ["tiny", "llama2-7b", "llama3-8b", "llama-140b"])
@pytest.mark.parametrize("seq,micro_batch", [(128, 1), (4096, 2)])
def test_layer_and_head_flops_add_up_to_flops_per_token(name, seq, micro_batch):
    model = model_preset(name)
    shape = LayerShape.of(model, seq, micro_batch, tp=1)
    forward = model.num_layers * layer_forward_flops(shape) + head_forward_flops(
        shape, model.vocab_size)
    expected = model.flops_per_token(seq) * seq * micro_batch
    assert 3 * forward == pytest.approx(expected, rel=1e-12)


def test_tp_ranks_split_the_layer_flops_exactly():
    model = model_preset("llama2-70b")
    whole = layer_forward_flops(LayerShape.of(model, 1024, 1, 1))
    for tp in (2, 4, 8):
        assert tp * layer_forward_flops(LayerShape.of(model, 1024, 1, tp)) == pytest.approx(whole)


def test_gemm_roofline_by_hand():
    h100 = KINDS.get("H100")
    big = gemm("big", 4096, 4096, 4096)  # 2 * 4096^3 FLOPs: compute-bound
    assert op_time(big, h100, "bf16", EXACT) == pytest.approx(2 * 4096 ** 3 / 989e12)
    assert op_time(big, h100, "bf16") == pytest.approx(2 * 4096 ** 3 / (989e12 * 0.6))
    thin = gemm("thin", 1, 4096, 4096)  # a matrix-vector product: memory-bound
    nbytes = (4096 + 4096 * 4096 + 4096) * 2
    assert op_time(thin, h100, "bf16", EXACT) == pytest.approx(nbytes / 3350e9)
    assert op_time(thin, h100, "bf16", EXACT, backward=True) == pytest.approx(2 * nbytes / 3350e9)
    norm = Op("norm", "memory", 0.0, 1e9)
    assert op_time(norm, h100, "fp32", EXACT) == pytest.approx(4e9 / 3350e9)


def test_emulated_kind_is_host_estimate_times_slowdown():
    model = model_preset("small")
    shape = LayerShape.of(model, 256, 2, 1)
    ops = layer_forward_ops(shape)
    cpu, fast, slow = KINDS.get("cpu"), KINDS.get("emu-fast"), KINDS.get("emu-slow")
    host = ops_time(ops, cpu, "fp32")
    assert ops_time(ops, fast, "fp32") == pytest.approx(host)
    assert ops_time(ops, slow, "fp32") == pytest.approx(tuple(2 * t for t in host))


def test_slower_accelerator_takes_longer():
    shape = LayerShape.of(model_preset("llama2-7b"), 4096, 1, 1)
    times = {name: ops_time(layer_forward_ops(shape), KINDS.get(name), "bf16")
             for name in ("H100", "A100-80G", "MI250X")}
    assert times["H100"] < times["A100-80G"] < times["MI250X"]
    fwd, bwd = ops_time(layer_forward_ops(shape), KINDS.get("H100"), "bf16")
    assert 2.0 <= bwd / fwd <= 2.5


def test_activation_bytes_by_hand():
    # tiny: h=64, ffn=176, 4 heads of 16, 2 kv groups; 16 tokens; bf16
    shape = LayerShape.of(model_preset("tiny"), seq=8, micro_batch=2, tp=1)
    per_token = 4 * 64 + 64 + 2 * 32 + 64 + 3 * 176  # norms, q k v, attention out, mlp
    # float32: the softmax log-sum-exp per head and each norm's 1/rms
    assert layer_activation_bytes(shape, "bf16") == 16 * per_token * 2 + 16 * (4 + 2) * 4
    assert layer_input_bytes(shape, "bf16") == 16 * 64 * 2
    half = LayerShape.of(model_preset("tiny"), seq=8, micro_batch=2, tp=2)
    assert layer_activation_bytes(half, "bf16") < layer_activation_bytes(shape, "bf16")
