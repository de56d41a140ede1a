"""The compute ceiling: per kind by hand, its defaults against the predictor's and the
planner's, and no plan above it (nor the homogeneous baseline) on the shipped clusters."""

from __future__ import annotations

import inspect
import math
import pathlib

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, model_preset
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import predict
from megatron_het.perf.cost.compute_time import choose_profile, stage_compute
from megatron_het.perf.cost.roofline import LayerShape
from megatron_het.planner.baseline import homogeneous_baseline, why_above_baseline
from megatron_het.planner.ceiling import MAX_MICRO_BATCH_SIZE, Ceiling, KindCeiling, compute_ceiling
from megatron_het.planner.evaluate import evaluate_plan
from megatron_het.planner.search import search_plan
from megatron_het.planner.space import KindBlock, Layout, Placement, build_plan
from tests.unit.papers_mix import papers_baseline

REPO = pathlib.Path(__file__).resolve().parents[2]
CLUSTERS = sorted((REPO / "scripts/clusters").glob("*.yaml"))
# A ~1B Llama (TinyLlama's shape): small enough to plan on every shipped cluster quickly.
LLAMA_1B = ModelConfig(
    name="llama-1b",
    num_layers=16,
    hidden_size=2048,
    ffn_hidden_size=5632,
    num_attention_heads=16,
    num_query_groups=4,
    vocab_size=32000,
    max_position_embeddings=2048,
)
TWO_KINDS = {
    "name": "two",
    "node_groups": [
        {
            "name": "h",
            "accelerator": "H100",
            "nodes": 1,
            "devices_per_node": 4,
            "nic_bandwidth_gbit_per_s": 400,
        },
        {
            "name": "m",
            "accelerator": "MI250X",
            "nodes": 1,
            "devices_per_node": 2,
            "nic_bandwidth_gbit_per_s": 400,
        },
    ],
}


def by_hand_seconds_per_token(model: ModelConfig, kind: str, seq: int, sizes: list[int]) -> float:
    """The layers, the embedding and the head computed apart and summed, per token, at the
    best of ``sizes``."""
    spec = ClusterSpec.from_dict(TWO_KINDS).group("h" if kind == "H100" else "m").accelerator
    choice = choose_profile(spec, None)
    best = []
    for mbs in sizes:
        shape = LayerShape.of(model, seq, mbs, 1)
        parts = [
            stage_compute(model, spec, shape, layers, emb, head, 0, "bf16", choice)
            for layers, emb, head in ((1, False, False), (0, True, False), (0, False, True))
        ]
        fb = [p.forward_s + p.backward_s for p in parts]
        best.append((model.num_layers * fb[0] + fb[1] + fb[2]) / (mbs * seq))
    return min(best)


def test_ceiling_per_kind_by_hand() -> None:
    cluster = ClusterSpec.from_dict(TWO_KINDS)
    model, seq = LLAMA_1B, 512
    ceiling = compute_ceiling(model, cluster, 12, seq)  # micro-batches 1, 2, 3, 4, 6, 12
    h100, mi250x = ceiling.kind("H100"), ceiling.kind("MI250X")
    for term, devices in ((h100, 4), (mi250x, 2)):
        expected = by_hand_seconds_per_token(model, term.kind, seq, [1, 2, 3, 4, 6, 12])
        assert term.devices == devices
        assert term.seconds_per_token == pytest.approx(expected, rel=1e-9)
        assert term.tokens_per_s == pytest.approx(devices / expected, rel=1e-9)
        assert term.micro_batch_size in (1, 2, 3, 4, 6, 12)
        assert "roofline" in term.source
    assert ceiling.tokens_per_s == pytest.approx(h100.tokens_per_s + mi250x.tokens_per_s)
    assert h100.tokens_per_s_per_device > mi250x.tokens_per_s_per_device
    d = ceiling.to_dict()
    assert d["memory"] == "ignored" and [k["kind"] for k in d["kinds"]] == ["H100", "MI250X"]


def test_ceiling_tries_only_the_planners_micro_batch_sizes() -> None:
    cluster = ClusterSpec.from_dict(TWO_KINDS)
    odd = compute_ceiling(LLAMA_1B, cluster, 7, 512)  # 7 sequences: micro-batch 1 or 7
    assert {k.micro_batch_size for k in odd.kinds} <= {1, 7}
    capped = compute_ceiling(LLAMA_1B, cluster, 64, 512, max_micro_batch_size=2)
    assert {k.micro_batch_size for k in capped.kinds} <= {1, 2}
    one = compute_ceiling(LLAMA_1B, cluster, 64, 512, max_micro_batch_size=1)
    assert one.tokens_per_s <= capped.tokens_per_s


def test_ceiling_defaults_are_the_predictors_and_the_planners() -> None:
    ours = inspect.signature(compute_ceiling).parameters
    assert ours["efficiency"].default == inspect.signature(predict).parameters["efficiency"].default
    assert (
        MAX_MICRO_BATCH_SIZE
        == inspect.signature(search_plan).parameters["max_micro_batch_size"].default
    )


def test_kind_terms_add_up_and_scale_with_devices() -> None:
    term = KindCeiling("X", 3, 2e-6, 1, "roofline X")
    assert term.tokens_per_s == pytest.approx(1.5e6)
    assert Ceiling((term, KindCeiling("Y", 1, 1e-6, 2, "r"))).tokens_per_s == pytest.approx(2.5e6)
    cluster = ClusterSpec.from_dict(TWO_KINDS)
    alone = ClusterSpec.from_dict({**TWO_KINDS, "node_groups": TWO_KINDS["node_groups"][:1]})
    assert compute_ceiling(LLAMA_1B, cluster, 8, 512).kind("H100") == compute_ceiling(
        LLAMA_1B, alone, 8, 512
    ).kind("H100")


def _plan_against_both(model: ModelConfig, cluster: ClusterSpec, gbs: int, seq: int):
    result = search_plan(model, cluster, gbs, seq, top_k=1, refine=2)
    baseline = homogeneous_baseline(model, cluster, gbs, seq, top_k=1, refine=2)
    return result.with_baseline(baseline).with_ceiling(compute_ceiling(model, cluster, gbs, seq))


def _check_below_ceiling(result) -> None:
    ceiling, baseline = result.ceiling, result.baseline
    assert 0 < result.ceiling_efficiency < 1
    assert ceiling.tokens_per_s >= baseline.tokens_per_s
    for k in baseline.kinds:  # each kind's best plan alone stays under its own ceiling term
        assert k.tokens_per_s <= ceiling.kind(k.kind).tokens_per_s
    # The two efficiencies agree with the two references.
    assert result.ceiling_efficiency == pytest.approx(
        result.efficiency * baseline.tokens_per_s / ceiling.tokens_per_s, rel=1e-12
    )


def _cluster_case(path: pathlib.Path):
    """(path, model, batch, sequence) per shipped cluster; the 768-device mix is slow."""
    if path.stem == "cpu_emulated":  # emulated kinds hold only a small model
        return pytest.param(path, model_preset("small"), 16, 256, id=path.stem)
    if path.stem == "hethub_llama140b":
        return pytest.param(path, LLAMA_1B, 64, 1024, id=path.stem, marks=pytest.mark.slow)
    return pytest.param(path, LLAMA_1B, 32, 1024, id=path.stem)


# Clusters of more devices than this get a hand-built plan instead of a search (searching
# 16,384 devices and each kind alone takes minutes).
SEARCHED_DEVICES = 1024
SIZES = {p: ClusterSpec.load(p).world_size for p in CLUSTERS}


@pytest.mark.slow  # a search per cluster, about 1.3 s each
@pytest.mark.parametrize(
    "path, model, gbs, seq", [_cluster_case(p) for p in CLUSTERS if SIZES[p] <= SEARCHED_DEVICES]
)
def test_planned_plan_is_below_the_ceiling_on_every_cluster(
    path: pathlib.Path, model: ModelConfig, gbs: int, seq: int
) -> None:
    _check_below_ceiling(_plan_against_both(model, ClusterSpec.load(path), gbs, seq))


def _hand_built_plan(model: ModelConfig, cluster: ClusterSpec, gbs: int) -> ParallelPlan:
    """Every kind at the TP of a node, the most DP replicas that keep a stage per kind."""
    tp = min(g.devices_per_node for g in cluster.node_groups)
    counts = cluster.accelerator_counts()
    shared = math.gcd(*counts.values()) // tp
    dp = max(
        d
        for d in range(1, shared + 1)
        if shared % d == 0
        and gbs % d == 0
        and sum(n // (d * tp) for n in counts.values()) <= model.num_layers
    )
    blocks = tuple(KindBlock(k, tp, n // (dp * tp)) for k, n in counts.items())
    stages = sum(b.stages for b in blocks)
    layers = [model.num_layers // stages + (s < model.num_layers % stages) for s in range(stages)]
    return build_plan(Layout(dp, blocks, 1, gbs // dp, dp > 1), layers, Placement(cluster), "bf16")


@pytest.mark.parametrize(
    "path", [p for p in CLUSTERS if SIZES[p] > SEARCHED_DEVICES], ids=lambda p: p.stem
)
def test_a_plan_is_below_the_ceiling_on_every_large_cluster(path: pathlib.Path) -> None:
    cluster, model = ClusterSpec.load(path), model_preset("llama3-70b")
    plan = _hand_built_plan(model, cluster, 2048)
    result = evaluate_plan(model, cluster, plan, 4096, with_baseline=False)
    ceiling = compute_ceiling(model, cluster, 2048, 4096)
    assert sum(k.devices for k in ceiling.kinds) == plan.world_size == cluster.world_size
    assert 0 < result.with_ceiling(ceiling).ceiling_efficiency < 1


def test_planned_plan_is_below_the_ceiling_on_a_small_gpu_mix() -> None:
    cluster = ClusterSpec.from_dict(TWO_KINDS)
    _check_below_ceiling(_plan_against_both(LLAMA_1B, cluster, 8, 512))
    # So is every runner-up: other TP degrees, stage counts and micro-batch sizes.
    ceiling = compute_ceiling(LLAMA_1B, cluster, 8, 512)
    candidates = search_plan(LLAMA_1B, cluster, 8, 512, top_k=8).candidates
    assert len({c.layout for c in candidates}) > 1
    assert all(c.prediction.tokens_per_s < ceiling.tokens_per_s for c in candidates)


def _papers_mix():
    """The HETHUB mix, Llama-140B and its shipped plan (the planner's choice), predicted."""
    cluster = ClusterSpec.load(REPO / "scripts/clusters/hethub_llama140b.yaml")
    model = model_preset("llama-140b")
    plan = ParallelPlan.load(REPO / "scripts/hethub_llama140b/plan_140b.json")
    result = evaluate_plan(model, cluster, plan, 4096, with_baseline=False)
    return cluster, model, result.with_ceiling(compute_ceiling(model, cluster, 1024, 4096))


def test_papers_plan_is_below_its_ceiling() -> None:
    _, _, result = _papers_mix()
    ceiling = result.ceiling
    assert {k.kind: k.devices for k in ceiling.kinds} == {"MI250X": 128, "accelerator-a": 640}
    # accelerator-a's datasheet peak is above an MI250X GCD's, and so is its rate.
    assert (
        ceiling.kind("accelerator-a").tokens_per_s_per_device
        > ceiling.kind("MI250X").tokens_per_s_per_device
    )
    assert 0.5 < result.ceiling_efficiency < 1


@pytest.mark.slow  # the per-kind baseline searches of 768 devices: tens of seconds
def test_papers_mix_is_below_its_ceiling_and_explains_its_efficiency() -> None:
    cluster, model, result = _papers_mix()
    result = result.with_baseline(papers_baseline())
    _check_below_ceiling(result)
    reason = why_above_baseline(result)  # the baseline may or may not be passed here
    assert (reason is not None) == (result.efficiency > 1)
    assert reason is None or reason.startswith(f"above 1 ({result.efficiency:.4f}): ")
