"""Calibrated efficiencies: which kinds get which, that the stage costs use them for
``efficiency=None``, that emulated kinds and cpu keep the defaults, and the fit's algebra."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from megatron_het.cluster import AcceleratorRegistry
from megatron_het.config import model_preset
from megatron_het.errors import UserError
from megatron_het.perf.cost.calibration import (
    A100_EFFICIENCY,
    FACTORS,
    H100_EFFICIENCY,
    MI250X_EFFICIENCY,
    MI300X_EFFICIENCY,
    STEP,
    RunSensitivity,
    carried_gemm,
    efficiency_for,
    least_squares,
    sensitivity,
)
from megatron_het.perf.cost.compute_time import ProfileChoice, optimizer_time, stage_compute
from megatron_het.perf.cost.roofline import (
    DEFAULT_EFFICIENCY,
    MEMORY_EFFICIENCY,
    Efficiency,
    LayerShape,
)

KINDS = AcceleratorRegistry.builtin()
MODEL = model_preset("llama2-7b")


@pytest.mark.parametrize(
    "name, expected",
    [
        ("A100-80G", A100_EFFICIENCY),
        ("A100-40G", A100_EFFICIENCY),
        ("H100", H100_EFFICIENCY),
        ("H200", H100_EFFICIENCY),
        ("MI250X", MI250X_EFFICIENCY),
        ("MI300X", MI300X_EFFICIENCY),
        ("Ascend910B", DEFAULT_EFFICIENCY),
        ("cpu", DEFAULT_EFFICIENCY),
        ("emu-fast", DEFAULT_EFFICIENCY),
        ("emu-slow", DEFAULT_EFFICIENCY),
    ],
)
def test_efficiency_per_kind(name: str, expected: Efficiency) -> None:
    assert efficiency_for(KINDS.get(name)) == expected


def test_amd_gemm_figures_carry_the_a100_share_of_the_best_matmul() -> None:
    # The published best matmul (TFLOP/s) over our spec's peak, times what the A100 fit
    # reaches of A100's: 0.627 / (267.9 / 312).
    share = A100_EFFICIENCY.gemm / (267.9 / 312)
    for kind, best, expected in (("MI250X", 147.0, 0.561), ("MI300X", 781.9, 0.437)):
        peak = KINDS.get(kind).peak_tflops("bf16")
        assert efficiency_for(KINDS.get(kind)).gemm == expected == round(share * best / peak, 3)
    # H100 has published training runs of its own: carried it would be 0.585, fitted it is
    # lower (test_stored_h100_gemm_is_the_refit_of_its_rows_without_a_pipeline).
    assert carried_gemm("H100") == 0.585 > H100_EFFICIENCY.gemm
    # Only the GEMM factor is theirs; attention and memory stay the defaults.
    for efficiency in (MI250X_EFFICIENCY, MI300X_EFFICIENCY):
        assert (efficiency.attention, efficiency.memory) == (
            DEFAULT_EFFICIENCY.attention,
            DEFAULT_EFFICIENCY.memory,
        )


def test_calibrated_figures_differ_from_the_defaults() -> None:
    assert A100_EFFICIENCY != DEFAULT_EFFICIENCY and H100_EFFICIENCY != DEFAULT_EFFICIENCY
    assert DEFAULT_EFFICIENCY == Efficiency(gemm=0.6, attention=0.4, memory=0.8)


def test_kind_names_match_any_case_and_emulated_kinds_never_calibrate() -> None:
    assert efficiency_for(KINDS.get("H100").replace(name="h100")) == H100_EFFICIENCY
    pretend = KINDS.get("emu-slow").replace(name="H100")  # an emulated kind named like one
    assert efficiency_for(pretend) == DEFAULT_EFFICIENCY


def _compute(name: str, efficiency=None):
    spec = KINDS.get(name)
    shape = LayerShape.of(MODEL, 1024, 1, 1)
    return stage_compute(
        MODEL, spec, shape, 2, True, True, 0, "bf16", ProfileChoice(None), efficiency
    )


@pytest.mark.parametrize("name", ["A100-80G", "H100"])
def test_stage_costs_use_the_kinds_calibration_by_default(name: str) -> None:
    calibrated = efficiency_for(KINDS.get(name))
    default = _compute(name)
    assert default == _compute(name, calibrated)
    assert default.forward_s != _compute(name, DEFAULT_EFFICIENCY).forward_s
    explicit = Efficiency(gemm=0.9, attention=0.9, memory=0.9)
    assert _compute(name, explicit).forward_s < default.forward_s  # an override wins
    spec = KINDS.get(name)
    choice = ProfileChoice(None)
    assert optimizer_time(spec, 1e9, "bf16", choice) == optimizer_time(
        spec, 1e9, "bf16", choice, calibrated
    )


@pytest.mark.parametrize("name", ["cpu", "emu-fast", "emu-slow"])
def test_emulated_kinds_and_cpu_keep_todays_figures(name: str) -> None:
    assert _compute(name) == _compute(name, DEFAULT_EFFICIENCY)
    spec, choice = KINDS.get(name), ProfileChoice(None)
    assert optimizer_time(spec, 1e7, "fp32", choice) == optimizer_time(
        spec, 1e7, "fp32", choice, DEFAULT_EFFICIENCY
    )


def test_a100_attention_is_flash_attention_2s_published_speed() -> None:
    # FlashAttention-2 (arXiv 2307.08691, Fig. 4(d)): 155 and 173 TFLOP/s of A100's 312.
    assert A100_EFFICIENCY.attention == pytest.approx((155 + 173) / 2 / 312, abs=5e-4)
    assert A100_EFFICIENCY.attention > 0.5  # a flash kernel, not the 2021 unfused effective
    for efficiency in (A100_EFFICIENCY, H100_EFFICIENCY, DEFAULT_EFFICIENCY):
        assert efficiency.attention_kernel == "flash"  # what our runtime runs


def _linear_run(name: str, constant: float, seconds: dict, truth: Efficiency) -> RunSensitivity:
    published = constant + sum(t / getattr(truth, f) for f, t in seconds.items())
    return RunSensitivity(name, constant, seconds, published)


def test_least_squares_recovers_the_factors_of_exact_runs() -> None:
    truth = Efficiency(gemm=0.7, attention=0.1, memory=0.65)
    runs = [
        _linear_run("a", 0.3, {"gemm": 1.4, "memory": 0.9}, truth),
        _linear_run("b", 3.0, {"gemm": 6.7, "memory": 1.5}, truth),
        _linear_run("c", 8.0, {"gemm": 62.0, "memory": 4.5}, truth),
    ]
    base = Efficiency(gemm=0.5, attention=0.3, memory=0.8, attention_kernel="unfused")
    fitted = least_squares(runs, base)
    assert fitted.gemm == pytest.approx(0.7, rel=1e-9)
    assert fitted.memory == pytest.approx(0.65, rel=1e-9)
    # What is not fitted is the base's.
    assert (fitted.attention, fitted.attention_kernel) == (0.3, "unfused")
    one = least_squares(
        [_linear_run(r.name, r.constant_s, {"gemm": r.seconds["gemm"]}, truth) for r in runs], base
    )
    assert one.gemm == pytest.approx(0.7, rel=1e-9) and one.memory == 0.8


def test_least_squares_of_three_factors() -> None:
    truth = Efficiency(gemm=0.7, attention=0.3, memory=0.6)
    mixes = [(1.0, 0.1, 0.5), (5.0, 0.2, 0.4), (2.0, 1.0, 0.1), (9.0, 0.5, 2.0)]
    runs = [
        _linear_run(str(i), 0.1 * i, dict(zip(FACTORS, mix)), truth) for i, mix in enumerate(mixes)
    ]
    fitted = least_squares(runs, DEFAULT_EFFICIENCY)
    for factor in FACTORS:
        assert getattr(fitted, factor) == pytest.approx(getattr(truth, factor), rel=1e-9)


def test_least_squares_refuses_runs_that_cannot_separate_the_factors() -> None:
    truth = Efficiency(gemm=0.7, attention=0.1)
    same_mix = [
        _linear_run("a", 0.0, {"gemm": 1.0, "attention": 0.1}, truth),
        _linear_run("b", 0.0, {"gemm": 2.0, "attention": 0.2}, truth),
    ]
    with pytest.raises(ValueError, match="cannot separate"):
        least_squares(same_mix, DEFAULT_EFFICIENCY)
    with pytest.raises(ValueError, match="at least 2"):
        least_squares(same_mix[:1], DEFAULT_EFFICIENCY)
    too_slow = [
        RunSensitivity("a", 5.0, {"gemm": 1.0}, 4.0),
        RunSensitivity("b", 6.0, {"gemm": 2.0}, 5.0),
    ]
    with pytest.raises(ValueError, match="fixed costs"):
        least_squares(too_slow, DEFAULT_EFFICIENCY)


def test_sensitivity_reads_the_linear_form_back_from_predictions() -> None:
    base = Efficiency(gemm=0.6, attention=0.4, memory=0.8)

    def predicted(e: Efficiency) -> float:
        return 2.0 + 5.0 / e.gemm + 0.3 / e.attention + 0.7 / e.memory

    raised = {
        f: predicted(dataclasses.replace(base, **{f: getattr(base, f) * STEP}))
        for f in ("gemm", "memory")
    }
    found = sensitivity("r", 12.0, base, predicted(base), raised)
    assert found.seconds == pytest.approx({"gemm": 5.0, "memory": 0.7})
    # The factor not measured stays in the constant, at its base value.
    assert found.constant_s == pytest.approx(2.0 + 0.3 / base.attention)
    assert found.predicted_s(base) == pytest.approx(predicted(base))
    faster = dataclasses.replace(base, gemm=0.9)
    assert found.predicted_s(faster) == pytest.approx(predicted(faster))


@pytest.mark.slow
def test_stored_a100_constants_are_the_refit_of_table_1() -> None:
    from bench.published_runs import fit_efficiency

    fit = fit_efficiency()
    assert fit.efficiency.gemm == pytest.approx(A100_EFFICIENCY.gemm, rel=0.01)
    # Only the GEMM factor is fitted: memory and attention are not Table 1's to set.
    assert fit.efficiency.memory == A100_EFFICIENCY.memory == MEMORY_EFFICIENCY
    assert fit.efficiency.attention == DEFAULT_EFFICIENCY.attention
    assert {tuple(r.seconds) for r in fit.runs} == {("gemm",)}
    errors = [abs(e) for e in fit.errors.values()]
    assert statistics.median(errors) <= 0.05 and max(errors) < 0.10


@pytest.mark.slow
def test_stored_h100_gemm_is_the_refit_of_its_rows_without_a_pipeline() -> None:
    from bench.published_runs import HELD_OUT_RUNS, fit_efficiency, predict_run

    fit = fit_efficiency(gpu="H100", base=H100_EFFICIENCY)
    assert fit.efficiency.gemm == pytest.approx(H100_EFFICIENCY.gemm, rel=0.01)
    assert {r.name.rsplit("-", 1)[1] for r in fit.runs} == {"1.7B", "7.1B", "16B", "32B"}
    assert (fit.efficiency.attention, fit.efficiency.memory) == (0.35, MEMORY_EFFICIENCY)
    # The rows with a pipeline, held out, within 10% each at the stored figure.
    held = [r for r in HELD_OUT_RUNS if r.gpu == "H100"]
    assert len(held) == 5
    for run in held:
        assert abs(predict_run(run).iteration_time_s / run.published_iteration_s - 1) < 0.10


# Iteration times measured on one H200 (torch 2.11+cu130) by scripts/gpu_check.sh's MFU check:
# TinyLlama-1.1B's shape, bf16, seq 2048, micro-batch 4 x 4 per iteration, median after the
# first two of 10 iterations (the mfu.eager.step and mfu.compile.step rows).
MEASURED_H200_ITERATION_S = {"eager": 0.803, "compile": 0.500}


@pytest.mark.parametrize("variant", sorted(MEASURED_H200_ITERATION_S))
def test_the_predictor_matches_the_measured_h200_runs(variant: str, tmp_path) -> None:
    from megatron_het.arguments import parse_run_config
    from megatron_het.training.run import predict_run
    from megatron_het.training.setup import prepare_run
    from tools.gpu_check import mfu

    extra = ["--compile"] if variant == "compile" else []
    flags = mfu.train_flags(4, 10, tmp_path / "metrics.jsonl", extra)
    predicted = predict_run(prepare_run(parse_run_config(flags), 1, "H200")).iteration_time_s
    assert predicted == pytest.approx(MEASURED_H200_ITERATION_S[variant], rel=0.15)


def test_eager_layers_move_more_elementwise_bytes_on_gpu_kinds_only() -> None:
    from megatron_het.perf.cost.calibration import layer_efficiency
    from megatron_het.perf.cost.roofline import (
        EAGER_ELEMENTWISE_TRAFFIC,
        LayerShape,
        layer_forward_ops,
        op_time,
    )

    spec = KINDS.get("H200")
    shape = LayerShape(2048, 5632, 16, 4, 2048, 4, 1)
    ops = {op.name: op for op in layer_forward_ops(shape)}
    eager = dataclasses.replace(H100_EFFICIENCY, elementwise_traffic=EAGER_ELEMENTWISE_TRAFFIC)
    for backward in (False, True):
        assert op_time(ops["elementwise"], spec, "bf16", eager, backward) == pytest.approx(
            EAGER_ELEMENTWISE_TRAFFIC
            * op_time(ops["elementwise"], spec, "bf16", H100_EFFICIENCY, backward)
        )
        assert op_time(ops["down"], spec, "bf16", eager, backward) == op_time(
            ops["down"], spec, "bf16", H100_EFFICIENCY, backward
        )
    with pytest.raises(UserError, match="at least 1"):
        Efficiency(elementwise_traffic=0.5)
    assert layer_efficiency(spec, "bf16", False) == eager
    for other in ("cpu", "emu-slow"):  # priced as before: host profiles, emulation
        assert layer_efficiency(KINDS.get(other), "bf16", False) is None
    # measured in bf16, whose dtype copies fp32 does not make
    assert layer_efficiency(spec, "fp32", False) is None
    assert layer_efficiency(spec, "bf16", True) is None
    # an explicit override that sets its own traffic keeps it
    own = Efficiency(elementwise_traffic=2.0)
    assert layer_efficiency(spec, "bf16", False, own) is own


def test_profiled_layers_of_the_other_mode_scale_by_the_roofline_ratio() -> None:
    from megatron_het.perf.cost.calibration import layer_efficiency
    from megatron_het.perf.cost.roofline import (
        LayerShape,
        layer_activation_bytes,
        layer_forward_ops,
        ops_time,
    )
    from megatron_het.perf.measure.profile_format import LayerEntry, Profile, ProfileConditions

    model = model_preset("llama2-7b")
    shape = LayerShape.of(model, 2048, 1, 1)
    conditions = ProfileConditions("dev", "2.11", 16, "2026-12-04", "bf16")

    def layer(fwd: float, bwd: float, compiled: bool) -> LayerEntry:
        return LayerEntry(
            shape.hidden,
            shape.ffn,
            shape.heads,
            shape.kv_groups,
            shape.seq,
            shape.micro_batch,
            1,
            "bf16",
            fwd,
            bwd,
            1e8,
            compiled,
        )

    def computed(kind: str, profile: Profile, fused: bool):
        return stage_compute(
            model,
            KINDS.get(kind),
            shape,
            1,
            False,
            False,
            0,
            "bf16",
            ProfileChoice(profile),
            fused_elementwise=fused,
        )

    def priced(kind: str, profile: Profile, fused: bool) -> tuple[float, float]:
        compute = computed(kind, profile, fused)
        return compute.forward_s, compute.backward_s

    spec = KINDS.get("H200")
    eager_only = Profile("H200", conditions, layers=(layer(0.02, 0.05, False),))
    assert priced("H200", eager_only, False) == (0.02, 0.05)  # as measured
    ops = layer_forward_ops(shape)
    fused_roof = ops_time(ops, spec, "bf16", efficiency_for(spec))
    eager_roof = ops_time(ops, spec, "bf16", layer_efficiency(spec, "bf16", False))
    forward, backward = priced("H200", eager_only, True)
    assert forward == pytest.approx(0.02 * fused_roof[0] / eager_roof[0])
    assert backward == pytest.approx(0.05 * fused_roof[1] / eager_roof[1])
    assert forward < 0.9 * 0.02 and backward < 0.9 * 0.05
    # compilation changes what a layer saves: the other mode's bytes are not taken
    assert computed("H200", eager_only, False).activation_bytes == 1e8
    assert computed("H200", eager_only, True).activation_bytes == layer_activation_bytes(
        shape, "bf16"
    )
    # the other mode's entry of this shape beats a compiled entry of another width
    wider = dataclasses.replace(layer(0.03, 0.08, True), hidden=2 * shape.hidden)
    mixed = Profile("H200", conditions, layers=(layer(0.02, 0.05, False), wider))
    assert priced("H200", mixed, True) == (forward, backward)
    assert "by the roofline's ratio" in computed("H200", mixed, True).source
    # with entries of both modes each mode reads its own
    both = Profile("H200", conditions, layers=(layer(0.02, 0.05, False), layer(0.012, 0.03, True)))
    assert priced("H200", both, True) == (0.012, 0.03)
    assert priced("H200", both, False) == (0.02, 0.05)
    compiled_only = Profile("H200", conditions, layers=(layer(0.012, 0.03, True),))
    assert priced("H200", compiled_only, False)[0] == pytest.approx(
        0.012 * eager_roof[0] / fused_roof[0]
    )
    # a kind priced alike in both modes (the host CPU) keeps its measured figures
    cpu = Profile("cpu", conditions, layers=(layer(0.02, 0.05, False),))
    assert priced("cpu", cpu, True) == priced("cpu", cpu, False) == (0.02, 0.05)
