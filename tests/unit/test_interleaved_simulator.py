"""The event simulator running interleaved 1F1B: per-stage times, per-group results, the
(p - 1) / (v m) bubble."""

import random

import pytest

from megatron_het.perf.schedule.closed_forms import closed_form_interleaved_bubble
from megatron_het.perf.schedule.simulation_cache import SimulationCache
from megatron_het.perf.schedule.simulator import (
    Region,
    StageTiming,
    simulate,
    simulate_1f1b,
    simulate_pipelines,
)
from megatron_het.pipeline.schedules import ScheduleError, build_schedule


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("mult", [1, 1.5, 2, 2.75, 4])
def test_uniform_stages_have_the_closed_form_bubble(p, v, mult):
    m = int(mult * p)  # also counts that are not a multiple of p (micro-batch groups)
    group_f, group_b = 3.0, 6.0  # a group's total per micro-batch
    f, b = [group_f / v] * (v * p), [group_b / v] * (v * p)
    result = simulate(build_schedule("1f1b", p, m, num_chunks=v), f, b, record_timeline=False)
    ideal = m * (group_f + group_b)
    assert result.makespan_s == pytest.approx(
        ideal * (1 + closed_form_interleaved_bubble(p, v, m)), rel=1e-12
    )
    assert result.makespan_s == pytest.approx(ideal + (p - 1) * (group_f + group_b) / v, rel=1e-12)
    assert result.busy_s == pytest.approx((ideal,) * p, rel=1e-12)


def test_more_chunks_shrink_the_bubble():
    p, m = 4, 8
    spans = [
        simulate_1f1b(
            [12.0 / v] * (v * p), [24.0 / v] * (v * p), m, num_chunks=v, record_timeline=False
        ).makespan_s
        for v in (1, 2, 3, 4)
    ]
    assert all(a > b for a, b in zip(spans, spans[1:]))
    assert closed_form_interleaved_bubble(4, 1, 8) == pytest.approx(3 / 8)


def test_random_non_uniform_stages_finish_with_each_group_busy_for_its_chunks():
    rng = random.Random(11)
    for _ in range(60):
        p, v = rng.randint(2, 5), rng.randint(2, 4)
        m, n = rng.randint(p, 3 * p), p * v
        f = [rng.uniform(0.2, 3.0) for _ in range(n)]
        b = [x * rng.uniform(1.5, 3.0) for x in f]
        cf = [rng.uniform(0.0, 0.4) for _ in range(n - 1)] if rng.random() < 0.5 else None
        cb = [rng.uniform(0.0, 0.4) for _ in range(n - 1)] if cf else None
        result = simulate(
            build_schedule("1f1b", p, m, num_chunks=v), f, b, cf, cb, record_timeline=False
        )
        busy = [m * sum(f[s] + b[s] for s in range(g, n, p)) for g in range(p)]
        assert result.busy_s == pytest.approx(busy, rel=1e-12)
        assert result.makespan_s == max(result.stage_end_s) >= max(busy) - 1e-9
        # The first micro-batch crosses every stage forward and back.
        chain = sum(f) + sum(b) + sum(cf or []) + sum(cb or [])
        assert result.makespan_s >= chain - 1e-9


def test_timeline_names_global_stages_and_respects_dependencies():
    p, v, m = 3, 2, 6
    n = p * v
    f = [1.0 + 0.1 * s for s in range(n)]
    b = [2.0 + 0.3 * s for s in range(n)]
    c = [0.05 * (s + 1) for s in range(n - 1)]
    result = simulate(build_schedule("1f1b", p, m, num_chunks=v), f, b, c, c)
    compute = {}
    for g, line in enumerate(result.timeline):
        assert {e.stage % p for e in line} == {g}
        for e in line:
            if e.kind in ("forward", "backward"):
                compute[(e.stage, e.kind, e.micro_batch)] = e
    assert len(compute) == n * 2 * m
    for (s, kind, mb), e in compute.items():
        assert e.end_s - e.start_s == pytest.approx((f if kind == "forward" else b)[s])
        if kind == "forward" and s > 0:
            assert e.start_s >= compute[(s - 1, "forward", mb)].end_s + c[s - 1] - 1e-12
        if kind == "backward" and s < n - 1:
            assert e.start_s >= compute[(s + 1, "backward", mb)].end_s + c[s] - 1e-12
        if kind == "backward":
            assert e.start_s >= compute[(s, "forward", mb)].end_s - 1e-12


def test_the_forms_and_the_cache_agree():
    p, v, m = 2, 3, 4
    f = [1.0, 1.5, 0.5, 2.0, 1.0, 0.75]
    b = [2 * x for x in f]
    c = [0.1] * 5
    direct = simulate(build_schedule("1f1b", p, m, num_chunks=v), f, b, c, c).makespan_s
    assert simulate_1f1b(f, b, m, c, c, num_chunks=v).makespan_s == direct
    cache = SimulationCache()
    assert cache.schedule(p, m, v) == build_schedule("1f1b", p, m, num_chunks=v)
    assert cache.schedule(p, m) == build_schedule("1f1b", p, m)
    assert cache.makespan(f, b, m, c, c, num_chunks=v) == direct
    assert cache.makespan(f, b, m, c, c) == simulate_1f1b(f, b, m, c, c).makespan_s != direct
    with pytest.raises(ValueError, match="6 stages do not split into 4 chunks"):
        cache.makespan(f, b, m, c, c, num_chunks=4)


class OneCore:
    """A node with one core: n processes computing each progress at 1/n."""

    def rate(self, node, computing):
        return 1.0 / computing


def test_a_group_computes_on_its_first_stage_node():
    steps = build_schedule("1f1b", 2, 2, num_chunks=2)
    # Groups 0 and 1 on nodes 0 and 1; stage 2 (group 0's second chunk) names node 1, which the
    # group does not move to: the cores are not shared, as without a rate model.
    stages = [StageTiming(Region(1.0), Region(2.0), node=node) for node in (0, 1, 1, 1)]
    alone = simulate_pipelines([steps], [stages])
    shared = simulate_pipelines([steps], [stages], OneCore())
    assert shared.makespans_s == pytest.approx(alone.makespans_s)
    one_node = [StageTiming(Region(1.0), Region(2.0), node=0)] * 4
    assert simulate_pipelines([steps], [one_node], OneCore()).makespans_s[0] > (
        alone.makespans_s[0] + 1.0
    )


def test_bad_shapes_and_broken_lists_are_reported():
    steps = build_schedule("1f1b", 2, 2, num_chunks=2)
    stage = StageTiming(Region(1.0), Region(1.0))
    with pytest.raises(ValueError, match="a multiple of the groups"):
        simulate_pipelines([steps], [[stage] * 3])
    assert str(steps[1][0]) == "RECV_FORWARD stage 1 mb 0 <- stage 0"
    del steps[1][0]
    with pytest.raises(
        ScheduleError,
        match=r"^deadlock in simulation: group 0 at step 1, "
        r"group 1 at step \d+$",
    ):
        simulate(steps, [1.0] * 4, [1.0] * 4)
