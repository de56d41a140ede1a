"""The planner prices the layers the run will compute: eager without ``--compile``.

On GPU kinds in bf16 the runtime's eager decoder layers move
:data:`~megatron_het.perf.cost.roofline.EAGER_ELEMENTWISE_TRAFFIC` times the fused elementwise
bytes; the search, its bounds, the heterogeneous-DP family, the homogeneous baseline, the
compute ceiling, ``tools/plan.py`` and ``--plan auto`` all follow ``fused_elementwise``.
"""

from __future__ import annotations

import pathlib

import pytest

from megatron_het.arguments import parse_run_config
from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.perf import predict
from megatron_het.planner import search_plan
from megatron_het.planner.baseline import homogeneous_baseline
from megatron_het.planner.ceiling import compute_ceiling
from megatron_het.training.setup import prepare_run
from tests.test_plan_cli import plan_json

REPO = pathlib.Path(__file__).resolve().parents[2]
GPU_CLUSTER = str(REPO / "scripts" / "clusters" / "h100_a100.yaml")
CPU_CLUSTER = str(REPO / "scripts" / "clusters" / "cpu_emulated.yaml")
MODEL = model_preset("llama2-7b")
SEQ, GBS = 2048, 64
EAGER = RunOptions(fused_elementwise=False)  # bf16, eager decoder layers (no --compile)


@pytest.fixture(scope="module")
def searched() -> dict[bool, object]:
    cluster = ClusterSpec.load(GPU_CLUSTER)
    return {
        fused: search_plan(
            MODEL,
            cluster,
            GBS,
            SEQ,
            options=None if fused else EAGER,
            top_k=2,
            heterogeneous_dp=False,
        )
        for fused in (True, False)
    }


def test_eager_search_prices_and_chooses_for_eager_layers(searched) -> None:
    cluster = ClusterSpec.load(GPU_CLUSTER)
    fused, eager = searched[True], searched[False]
    # each result is its plan's prediction under its own pricing
    for flag, result in searched.items():
        again = predict(
            MODEL,
            result.plan,
            cluster,
            SEQ,
            options=RunOptions.from_plan(result.plan, fused_elementwise=flag),
        )
        assert result.prediction.iteration_time_s == pytest.approx(again.iteration_time_s, rel=1e-9)
    assert eager.prediction.iteration_time_s > 1.3 * fused.prediction.iteration_time_s
    assert eager.plan.pipelines != fused.plan.pipelines
    # the plan searched for fused layers is worse for an eager run than the eager plan
    fused_plan_eager = predict(
        MODEL,
        fused.plan,
        cluster,
        SEQ,
        options=RunOptions.from_plan(fused.plan, fused_elementwise=False),
    )
    assert eager.prediction.iteration_time_s < 0.97 * fused_plan_eager.iteration_time_s


def test_every_stage_price_of_a_search_has_the_run_s_mode(monkeypatch) -> None:
    """A spy on every way the planner reaches ``stage_compute`` (the predictor, the shared
    simulation cache, the ceiling): each call of an eager search asks for eager layers."""
    from megatron_het.perf import stage_pricing
    from megatron_het.perf.cost import compute_time as stage_cost
    from megatron_het.perf.schedule import simulation_cache
    from megatron_het.planner import ceiling

    modes: list[bool] = []

    def spy(*args, **kwargs):
        fused = kwargs.get("fused_elementwise", args[13] if len(args) > 13 else True)
        modes.append(fused)
        return stage_cost.stage_compute(*args, **kwargs)

    for module in (stage_pricing, simulation_cache, ceiling):
        monkeypatch.setattr(module, "stage_compute", spy)
    # 4 H100 + 3 MI250X: no uniform replica, so the heterogeneous-DP family is searched
    cluster = ClusterSpec.from_dict(
        {
            "name": "odd",
            "node_groups": [
                {
                    "name": g,
                    "accelerator": kind,
                    "nodes": 1,
                    "devices_per_node": n,
                    "nic_bandwidth_gbit_per_s": 3200,
                }
                for g, kind, n in (("h", "H100", 4), ("m", "MI250X", 3))
            ],
        }
    )
    model = MODEL.replace(
        num_layers=4,
        hidden_size=2048,
        ffn_hidden_size=5632,
        num_attention_heads=16,
        num_query_groups=4,
        vocab_size=32000,
    )
    result = search_plan(model, cluster, 12, 1024, None, EAGER, max_virtual_stages=2)
    assert any(
        len({s.accelerator for s in p.stages}) == 1 for p in result.plan.pipelines
    )  # replicas of one kind each
    homogeneous_baseline(model, cluster, 12, 1024, None, EAGER, top_k=1)
    compute_ceiling(model, cluster, 12, 1024, None, EAGER)
    assert len(modes) > 50 and not any(modes)


def test_ceiling_and_baseline_follow_the_pricing() -> None:
    cluster = ClusterSpec.load(GPU_CLUSTER)
    fused, eager = (
        compute_ceiling(MODEL, cluster, GBS, SEQ, None, RunOptions(fused_elementwise=f))
        for f in (True, False)
    )
    for a, b in zip(fused.kinds, eager.kinds):
        assert a.kind == b.kind and b.seconds_per_token > 1.3 * a.seconds_per_token
    base_fused, base_eager = (
        homogeneous_baseline(
            MODEL,
            cluster,
            GBS,
            SEQ,
            top_k=1,
            heterogeneous_dp=False,
            options=RunOptions(fused_elementwise=f),
            max_virtual_stages=1,
        )
        for f in (True, False)
    )
    for a, b in zip(base_fused.kinds, base_eager.kinds):
        assert b.tokens_per_s_per_device < a.tokens_per_s_per_device / 1.3
    # CPU and emulated kinds are priced from host figures, the same either way
    cpu = ClusterSpec.load(CPU_CLUSTER)
    small = model_preset("small")
    assert compute_ceiling(
        small, cpu, 8, 256, None, RunOptions(dtype="bf16", fused_elementwise=False)
    ) == compute_ceiling(small, cpu, 8, 256, None, RunOptions(dtype="bf16", fused_elementwise=True))


def test_plan_cli_prices_eager_unless_compile(capsys) -> None:
    common = [
        "--cluster",
        GPU_CLUSTER,
        "--model",
        "llama2-7b",
        "--seq-length",
        str(SEQ),
        "--global-batch-size",
        str(GBS),
        "--no-baseline",
        "--no-heterogeneous-dp",
        "--top",
        "2",
    ]
    lines = {bool(extra): plan_json(capsys, *common, *extra) for extra in ([], ["--compile"])}
    assert lines[False]["iteration_time_s"] > 1.3 * lines[True]["iteration_time_s"]
    assert lines[False]["ceiling_tokens_per_s"] < lines[True]["ceiling_tokens_per_s"] / 1.3


@pytest.mark.slow  # a whole search per case (about 13 s)
@pytest.mark.parametrize("compiled", [False, True])
def test_auto_plan_follows_compile(compiled: bool) -> None:
    flags = [
        "--model",
        "llama2-7b",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--seq-length",
        str(SEQ),
        "--cluster",
        GPU_CLUSTER,
        "--plan",
        "auto",
        "--global-batch-size",
        str(GBS),
        "--train-iters",
        "1",
        "--vocab-size",
        "31999",
        "--bf16",
    ]
    setup = prepare_run(parse_run_config(flags + (["--compile"] if compiled else [])), 64)
    cluster = ClusterSpec.load(GPU_CLUSTER)
    expected = search_plan(
        MODEL, cluster, GBS, SEQ, None, RunOptions(dtype="bf16", fused_elementwise=compiled)
    ).plan
    assert setup.plan.pipelines == expected.pipelines
