"""Straggler detection: per-kind medians over expected compute, its lines and its figures."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import predict
from megatron_het.training.straggler import (
    LAYERS,
    MAX_LISTED_RANKS,
    PREDICTED,
    RankPlace,
    StragglerMonitor,
    compare_ranks,
    layer_compute,
    median,
    predicted_compute,
    rank_places,
    report_fields,
    report_scalars,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "scripts" / "clusters" / "cpu_emulated.yaml"
PLANS = ROOT / "scripts" / "plans"
FAST, SLOW = "emu-fast (emulated)", "emu-slow (emulated)"


def place(
    rank: int, kind: str, expected: float = 1.0, pipeline: int = 0, stages: tuple[int, ...] = (0,)
) -> RankPlace:
    return RankPlace(rank, pipeline, stages, kind, expected)


def test_median_of_odd_even_and_no_values() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0]) == 1.5  # two ranks: their mean
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median([7.0]) == 7.0
    with pytest.raises(ValueError):
        median([])


def test_a_rank_above_its_kinds_median_is_named_and_no_other() -> None:
    places = [
        place(0, FAST),
        place(1, FAST),
        place(2, FAST),
        place(3, SLOW),
        place(4, SLOW),
        place(5, SLOW),
    ]
    # The slow kind is 2x slower by design: compared only with itself, none of it straggles.
    ratios, stragglers, lone = compare_ranks([1.0, 1.05, 1.3, 2.0, 2.0, 2.1], places, 0.2)
    assert [(s.place.rank, s.ratio) for s in stragglers] == [(2, pytest.approx(1.3 / 1.05))]
    assert ratios[0] == pytest.approx(1.0 / 1.05) and ratios[4] == pytest.approx(1.0)
    assert lone == ()
    # Just under the threshold: not named.
    _, stragglers, _ = compare_ranks([1.0, 1.0, 1.19, 2, 2, 2], places, 0.2)
    assert stragglers == ()


def test_two_ranks_of_a_kind_need_the_slower_above_the_threshold_over_their_mean() -> None:
    places = [place(0, SLOW), place(1, SLOW)]
    # Median of two = their mean; 2x the other is 1.33 x the mean: named at 0.2.
    _, stragglers, _ = compare_ranks([1.0, 2.0], places, 0.2)
    assert [s.place.rank for s in stragglers] == [1]
    assert stragglers[0].ratio == pytest.approx(2.0 / 1.5)
    # (1 + t) / (1 - t) = 1.5 x the faster is the limit: 1.45 x is not named, 1.55 x is.
    assert compare_ranks([1.0, 1.45], places, 0.2)[1] == ()
    assert [s.place.rank for s in compare_ranks([1.0, 1.55], places, 0.2)[1]] == [1]
    # The faster one of two is never named.
    assert [s.place.rank for s in compare_ranks([5.0, 1.0], places, 0.2)[1]] == [0]


def test_a_kind_with_one_rank_is_never_compared_with_itself() -> None:
    places = [place(0, FAST), place(1, FAST), place(2, SLOW)]
    ratios, stragglers, lone = compare_ranks([1.0, 1.0, 50.0], places, 0.2)
    assert stragglers == () and lone == (SLOW,) and 2 not in ratios


def test_expected_compute_normalises_different_stages() -> None:
    # Rank 1 runs twice the work of rank 0 and takes twice as long: not a straggler.
    places = [place(0, FAST, 1.0), place(1, FAST, 2.0), place(2, FAST, 1.0)]
    assert compare_ranks([1.0, 2.0, 1.0], places, 0.2)[1] == ()
    # Without the normalisation it would be: equal expectations name rank 1.
    flat = [place(r, FAST) for r in range(3)]
    assert [s.place.rank for s in compare_ranks([1.0, 2.0, 1.0], flat, 0.2)[1]] == [1]
    # A rank with no expected compute is left out; a kind whose median is zero too.
    ratios, stragglers, _ = compare_ranks(
        [0.0, 0.0, 3.0], [place(0, FAST), place(1, FAST), place(2, FAST, 0.0)], 0.2
    )
    assert ratios == {} and stragglers == ()
    with pytest.raises(ValueError):
        compare_ranks([1.0], [place(0, FAST)], 0.0)


def test_stragglers_are_listed_slowest_first() -> None:
    places = [place(r, FAST) for r in range(5)]
    _, stragglers, _ = compare_ranks([1.0, 1.6, 1.0, 2.0, 1.0], places, 0.2)
    assert [s.place.rank for s in stragglers] == [3, 1]


def test_the_monitor_sums_an_interval_and_writes_its_lines() -> None:
    places = [
        place(0, FAST, pipeline=0, stages=(0,)),
        place(1, FAST, pipeline=1, stages=(0,)),
        place(2, SLOW, pipeline=0, stages=(1, 3)),
        place(3, SLOW, pipeline=1, stages=(1, 3)),
        place(4, "cpu"),
    ]
    monitor = StragglerMonitor(places, 0.2, PREDICTED)
    assert monitor.close() is None  # nothing added yet
    monitor.add(5, [0.1, 0.1, 0.2, 0.1, 1.0])  # one slow iteration of rank 2 ...
    monitor.add(6, [0.1, 0.1, 0.2, 0.2, 1.0])  # ... but rank 3 catches up over the interval
    report = monitor.close()
    assert (report.first, report.last) == (5, 6)
    assert report.compute_s == pytest.approx((0.2, 0.2, 0.4, 0.3, 2.0))
    assert [s.place.rank for s in report.stragglers] == []
    lines = monitor.lines(report)
    assert lines[0] == (
        " straggler check: cpu has a single rank, with no peer of its kind to "
        "be compared with; never named a straggler"
    )
    assert lines[1].startswith(
        "   compute s per rank over iterations 5-6 (x its kind's median "
        "per predicted compute): r0 0.200 x1.00 | r1 0.200 x1.00 | "
        "r2 0.400 x1.14 | r3 0.300 x0.86 | r4 2.000"
    )
    assert len(lines) == 2
    monitor.add(7, [0.1, 0.1, 0.1, 0.3, 1.0])
    report = monitor.close()
    lines = monitor.lines(report)
    assert lines[0] == (
        " straggler: rank 3 (pipeline 1 stages 1,3, emu-slow (emulated)) "
        "computed 1.50 x the median of its kind per predicted compute over "
        "iteration 7 (50% slower; threshold 20%)"
    )
    assert len(lines) == 2 and "single rank" not in "".join(lines)  # said once only


def test_report_figures_for_the_metrics_file_and_tensorboard() -> None:
    monitor = StragglerMonitor([place(0, FAST), place(1, FAST), place(2, SLOW)], 0.2, LAYERS)
    monitor.add(1, [1.0, 3.0, 4.0])
    report = monitor.close()
    fields = report_fields(report)
    assert json.loads(json.dumps(fields)) == {
        "first_iteration": 1,
        "rank_compute_s": [1.0, 3.0, 4.0],
        "ratio_to_kind_median": [0.5, 1.5, None],
        "stragglers": [1],
    }
    scalars = report_scalars(report)
    assert scalars["straggler/ratio/rank1"] == 1.5 and "straggler/ratio/rank2" not in scalars
    assert scalars["straggler/compute_s/rank2"] == 4.0 and scalars["straggler/count"] == 1.0
    assert "per layer" in monitor.lines(report)[0]


def test_a_large_world_gets_one_summary_per_kind() -> None:
    n = MAX_LISTED_RANKS + 2
    places = [place(r, FAST if r % 2 else SLOW) for r in range(n)]
    monitor = StragglerMonitor(places, 0.2)
    monitor.add(1, [3.0 if r == 5 else 1.0 for r in range(n)])
    lines = monitor.lines(monitor.close())
    assert lines[0].startswith(" straggler: rank 5 ")
    assert lines[1].endswith(
        f": {SLOW} {n // 2} ranks, median 1.000, slowest r0 x1.00 | "
        f"{FAST} {n // 2} ranks, median 1.000, slowest r5 x3.00"
    )


def test_expectations_from_the_prediction_and_from_layers() -> None:
    plan = ParallelPlan.load(PLANS / "cpu_emulated_3stage.json")  # tp=2 x 1 layer, 2, 1
    cluster = ClusterSpec.load(CLUSTER)
    assert layer_compute(plan) == {0: 4 * 1 / 2, 1: 4 * 1 / 2, 2: 4 * 2, 3: 4 * 1}
    prediction = predict(
        model_preset("tiny"),
        plan,
        cluster,
        32,
        options=RunOptions.from_plan(plan, dtype="fp32"),
        pipeline_model="closed_form",
    )
    expected = predicted_compute(prediction, plan)
    rows = {row.ranks: row for row in prediction.stages}
    assert expected[2] == pytest.approx(4 * (rows[(2,)].forward_s + rows[(2,)].backward_s))
    assert expected[0] == expected[1] and expected[2] > expected[3] > 0  # 2 layers vs 1 + head
    places = rank_places(plan, cluster, expected)
    assert [(p.rank, p.pipeline, p.stages, p.kind) for p in places] == [
        (0, 0, (0,), FAST),
        (1, 0, (0,), FAST),
        (2, 0, (1,), SLOW),
        (3, 0, (2,), SLOW),
    ]
    interleaved = ParallelPlan.load(PLANS / "cpu_emulated_interleaved.json")
    chunks = {p.rank: p.stages for p in rank_places(interleaved, cluster, {})}
    assert any(len(stages) > 1 for stages in chunks.values())


def test_the_module_does_not_import_torch() -> None:
    code = "import sys; import megatron_het.training.straggler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
