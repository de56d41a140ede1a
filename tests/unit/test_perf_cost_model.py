"""Cost model: per-layer FLOPs against ModelConfig.flops_per_token, roofline by hand, emulation."""

import pytest

from megatron_het.cluster import AcceleratorRegistry
from megatron_het.config import model_preset
from megatron_het.errors import UserError
from megatron_het.perf.cost.compute_time import ProfileChoice, stage_compute
from megatron_het.perf.cost.roofline import (
    Efficiency,
    LayerShape,
    Op,
    attention_ops,
    gemm,
    head_forward_flops,
    layer_activation_bytes,
    layer_forward_flops,
    layer_forward_ops,
    layer_input_bytes,
    op_time,
    ops_time,
)

KINDS = AcceleratorRegistry.builtin()
EXACT = Efficiency(gemm=1.0, attention=1.0, memory=1.0)


@pytest.mark.parametrize("name", ["tiny", "llama2-7b", "llama3-8b", "llama-140b"])
@pytest.mark.parametrize("seq,micro_batch", [(128, 1), (4096, 2)])
def test_layer_and_head_flops_add_up_to_flops_per_token(name, seq, micro_batch):
    model = model_preset(name)
    shape = LayerShape.of(model, seq, micro_batch, tp=1)
    forward = model.num_layers * layer_forward_flops(shape) + head_forward_flops(
        shape, model.vocab_size
    )
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
    assert op_time(big, h100, "bf16", EXACT) == pytest.approx(2 * 4096**3 / 989e12)
    assert op_time(big, h100, "bf16") == pytest.approx(2 * 4096**3 / (989e12 * 0.6))
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
    times = {
        name: ops_time(layer_forward_ops(shape), KINDS.get(name), "bf16")
        for name in ("H100", "A100-80G", "MI250X")
    }
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


# Unfused attention (Megatron-LM 2021): a shape small enough to count by hand.
# tiny: h=64, 4 heads of 16, 2 kv groups; micro-batch 2, seq 8: 2 * 4 * 8 * 8 = 512 scores.
UNFUSED_SHAPE = LayerShape.of(model_preset("tiny"), seq=8, micro_batch=2, tp=1)
SCORES = 512


def test_both_attention_kernels_do_the_same_model_flops():
    for name in ("tiny", "llama2-7b"):
        for tp in (1, 2):
            shape = LayerShape.of(model_preset(name), 256, 2, tp)
            flash = layer_forward_ops(shape)
            unfused = layer_forward_ops(shape, "unfused")
            assert sum(op.flops for op in unfused) == pytest.approx(
                sum(op.flops for op in flash), rel=1e-12
            )
            assert [op.name for op in attention_ops(shape)] == ["attention"]
            assert [op.name for op in attention_ops(shape, "unfused")] == [
                "scores",
                "softmax",
                "dropout",
                "context",
                "context_transpose",
            ]


def test_unfused_attention_traffic_by_hand():
    a100 = KINDS.get("A100-80G")
    bw, peak = 2039e9, 312e12
    ops = {op.name: op for op in attention_ops(UNFUSED_SHAPE, "unfused")}
    # Q K^T over the whole square: 2 * 512 scores * 16 = 16384 FLOPs; reads Q and K
    # (8 heads-by-batch of 8 x 16 each), writes the scores.
    assert ops["scores"].kind == ops["context"].kind == "gemm"
    assert ops["scores"].flops == ops["context"].flops == 2 * SCORES * 16
    assert ops["scores"].elements == ops["context"].elements == 8 * 2 * 8 * 16 + SCORES

    def times(name):
        op = ops[name]
        return (op_time(op, a100, "fp16", EXACT), op_time(op, a100, "fp16", EXACT, True))

    # Softmax: forward reads the causal half and writes all (1.5 per score), backward reads
    # gradients and probabilities over the half and writes all (2.0).
    assert times("softmax") == pytest.approx((1.5 * SCORES * 2 / bw, 2.0 * SCORES * 2 / bw))
    # Dropout: read, write, a byte of mask; backward reads gradient and mask, writes gradient.
    assert times("dropout") == pytest.approx((SCORES * 5 / bw, SCORES * 5 / bw))
    # The context's transpose to [s, b, hp] and back: 16 tokens x 64 values, read and write.
    assert times("context_transpose") == pytest.approx((2 * 16 * 64 * 2 / bw,) * 2)
    # GEMMs: the roofline of their FLOPs and bytes; backward twice both.
    scores = ops["scores"]
    forward = max(scores.flops / peak, scores.elements * 2 / bw)
    assert times("scores") == pytest.approx((forward, 2 * forward))


def test_flash_attention_op_is_unchanged():
    shape = LayerShape.of(model_preset("llama2-7b"), 4096, 2, 2)
    (op,) = attention_ops(shape)
    q, kv = 32 * 128 // 2, 32 * 128 // 2
    assert (op.kind, op.flops, op.elements) == (
        "attention",
        4.0 * 2 * 4096**2 * q,
        2 * 4096 * (2 * q + 2 * kv),
    )
    assert layer_forward_ops(shape)[1] == op
    h100 = KINDS.get("H100")
    causal = 0.5 * op.flops / (989e12 * 0.4)
    assert op_time(op, h100, "bf16") == pytest.approx(causal)
    assert op_time(op, h100, "bf16", backward=True) == pytest.approx(2.5 * causal)


def test_unfused_attention_is_slower_and_its_activations_hold_the_scores():
    shape = LayerShape.of(model_preset("llama2-7b"), 2048, 1, 1)
    a100 = KINDS.get("A100-80G")
    flash = ops_time(layer_forward_ops(shape), a100, "fp16")
    unfused = ops_time(layer_forward_ops(shape, "unfused"), a100, "fp16")
    assert unfused[0] > flash[0] and unfused[1] > flash[1]
    tiny = UNFUSED_SHAPE
    # No log-sum-exp (16 tokens x 4 heads float32); probabilities and dropped probabilities
    # (fp16) and a mask byte per score.
    assert (
        layer_activation_bytes(tiny, "fp16", attention_kernel="unfused")
        - layer_activation_bytes(tiny, "fp16")
    ) == SCORES * (2 * 2 + 1) - 16 * 4 * 4


def test_stage_costs_follow_the_efficiencys_attention_kernel():
    model = model_preset("llama2-7b")
    spec = KINDS.get("A100-80G")
    shape = LayerShape.of(model, 2048, 1, 1)

    def compute(kernel, recompute):
        efficiency = Efficiency(attention_kernel=kernel)
        return stage_compute(
            model,
            spec,
            shape,
            2,
            False,
            False,
            2 if recompute else 0,
            "fp16",
            ProfileChoice(None),
            efficiency,
        )

    flash, unfused = compute("flash", False), compute("unfused", False)
    assert unfused.forward_s > flash.forward_s
    assert unfused.activation_bytes == 2 * layer_activation_bytes(
        shape, "fp16", attention_kernel="unfused"
    )
    # Under recompute a layer keeps its input only; the recomputed layer is the transient.
    kept = compute("unfused", True)
    assert kept.activation_bytes == compute("flash", True).activation_bytes
    assert kept.transient_bytes == unfused.activation_bytes / 2
    # Block recompute of the first of the two layers: one layer's input and one layer's
    # activations kept, one forward more in backward.
    half = stage_compute(
        model,
        spec,
        shape,
        2,
        False,
        False,
        1,
        "fp16",
        ProfileChoice(None),
        Efficiency(attention_kernel="unfused"),
    )
    assert half.activation_bytes == pytest.approx(
        (kept.activation_bytes + unfused.activation_bytes) / 2
    )
    assert half.transient_bytes == kept.transient_bytes
    assert half.backward_s == pytest.approx((kept.backward_s + unfused.backward_s) / 2)


def test_unknown_attention_kernel_is_a_user_error():
    with pytest.raises(UserError, match="unknown attention kernel 'xformers'"):
        Efficiency(attention_kernel="xformers")
    with pytest.raises(UserError, match="unknown attention kernel"):
        attention_ops(UNFUSED_SHAPE, "sdpa")


def test_ops_backward_is_twice_the_forward_unless_they_say():
    norm = Op("norm", "memory", 0.0, 1e9)
    h100 = KINDS.get("H100")
    assert norm.backward_factor == 2.0
    assert op_time(norm, h100, "bf16", EXACT, True) == 2 * op_time(norm, h100, "bf16", EXACT)
    once = Op("copy", "memory", 0.0, 1e9, backward_factor=1.0)
    assert op_time(once, h100, "bf16", EXACT, True) == op_time(once, h100, "bf16", EXACT)
