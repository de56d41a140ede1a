"""The event-driven pipeline simulator against the closed form and by hand."""

import random

import pytest

from megatron_het.perf.schedule.closed_forms import (
    bubble_fraction,
    closed_form_1f1b,
    lower_bound_1f1b,
)
from megatron_het.perf.schedule.simulation_cache import SimulationCache
from megatron_het.perf.schedule.simulator import (
    Region,
    StageTiming,
    simulate,
    simulate_1f1b,
    simulate_pipelines,
)
from megatron_het.pipeline.schedules import Action, ActionKind, ScheduleError, build_schedule


@pytest.mark.parametrize("m", [1, 3, 8])
def test_one_stage_is_m_times_forward_plus_backward(m):
    result = simulate_1f1b([1.5], [2.75], m)
    assert result.makespan_s == m * (1.5 + 2.75)
    assert result.busy_s == (m * (1.5 + 2.75),)


@pytest.mark.parametrize("p", [2, 3, 4, 7])
@pytest.mark.parametrize("m", [1, 2, 4, 9, 16])
def test_uniform_stages_equal_the_closed_form(p, m):
    f, b = [1.0] * p, [2.0] * p
    result = simulate_1f1b(f, b, m, record_timeline=False)
    assert result.makespan_s == pytest.approx(closed_form_1f1b(f, b, m), abs=1e-12)
    assert result.makespan_s == pytest.approx((m + p - 1) * 3.0)
    assert bubble_fraction(result.makespan_s, f, b, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 6])
def test_uniform_p2p(p, m):
    f, b, c = [1.0] * p, [2.0] * p, [0.25] * (p - 1)
    makespan = simulate_1f1b(f, b, m, c, c, record_timeline=False).makespan_s
    closed = closed_form_1f1b(f, b, m, c, c)
    # p <= 2 or one micro-batch: exact; otherwise one steady-state exchange of the middle
    # stages overlaps the ramp, so the closed form is one p2p time above the simulation
    overlap = 0.25 if p >= 3 and m >= 2 else 0.0
    assert makespan == pytest.approx(closed - overlap, abs=1e-12)


def test_non_uniform_stages_lie_between_the_bounds():
    rng = random.Random(7)
    for _ in range(300):
        p, m = rng.randint(2, 6), rng.randint(1, 12)
        f = [rng.uniform(0.3, 3.0) for _ in range(p)]
        b = [x * rng.uniform(1.5, 3.0) for x in f]
        cf = [rng.uniform(0.0, 0.5) for _ in range(p - 1)]
        cb = [rng.uniform(0.0, 0.5) for _ in range(p - 1)]
        makespan = simulate_1f1b(f, b, m, cf, cb, record_timeline=False).makespan_s
        assert (
            lower_bound_1f1b(f, b, m) - 1e-9 <= makespan <= closed_form_1f1b(f, b, m, cf, cb) + 1e-9
        )


def test_more_micro_batches_shrink_the_bubble():
    f, b = [1.0, 1.3, 0.8, 1.1], [2.0, 2.5, 1.7, 2.1]
    fractions = [
        bubble_fraction(simulate_1f1b(f, b, m).makespan_s, f, b, m) for m in (1, 2, 4, 8, 16, 32)
    ]
    assert all(a > b for a, b in zip(fractions, fractions[1:]))


def test_timeline_respects_dependencies():
    f, b, c = [1.0, 2.0, 1.5], [2.0, 3.0, 2.5], [0.1, 0.2]
    result = simulate_1f1b(f, b, 4, c, c)
    compute = {
        (e.stage, e.kind, e.micro_batch): e
        for line in result.timeline
        for e in line
        if e.kind in ("forward", "backward")
    }
    assert len(compute) == 3 * 2 * 4
    for (s, kind, mb), e in compute.items():
        assert e.end_s - e.start_s == pytest.approx((f if kind == "forward" else b)[s])
        if kind == "forward" and s > 0:
            assert e.start_s >= compute[(s - 1, "forward", mb)].end_s + c[s - 1] - 1e-12
        if kind == "backward" and s < 2:
            assert e.start_s >= compute[(s + 1, "backward", mb)].end_s + c[s] - 1e-12
    for line in result.timeline:
        for a, later in zip(line, line[1:]):
            if "p2p" not in a.kind and "p2p" not in later.kind:
                assert later.start_s >= a.end_s - 1e-12
    assert result.makespan_s == max(result.stage_end_s)


def test_gpipe_runs_through_the_same_simulator():
    p, m = 3, 5
    steps = build_schedule("gpipe", p, m)
    result = simulate(steps, [1.0] * p, [2.0] * p)
    assert result.makespan_s == pytest.approx((m + p - 1) * 3.0)


def test_a_broken_schedule_is_reported():
    steps = build_schedule("1f1b", 2, 2)
    steps[1] = [
        s for s in steps[1] if not (isinstance(s, Action) and s.kind is ActionKind.RECV_FORWARD)
    ]
    with pytest.raises(ScheduleError):
        simulate(steps, [1.0, 1.0], [1.0, 1.0])


def test_cache_gives_the_same_makespan():
    cache = SimulationCache()
    f, b = [1.0, 2.0], [2.0, 4.0]
    first = cache.makespan(f, b, 6, [0.1], [0.2])
    assert first == simulate_1f1b(f, b, 6, [0.1], [0.2]).makespan_s
    assert cache.makespan(f, b, 6, [0.1], [0.2]) == first


def test_pipelines_without_a_rate_model_run_on_their_own_clocks():
    f, b, m = [1.0, 1.5], [2.0, 2.5], 3
    alone = simulate_1f1b(f, b, m, [0.25], [0.5])
    stages = [
        StageTiming(Region(f[0]), Region(b[0]), 0.25, 0.5),
        StageTiming(Region(f[1]), Region(b[1])),
    ]
    steps = build_schedule("1f1b", 2, m)
    both = simulate_pipelines([steps, steps], [stages, stages], record_timeline=True)
    assert both.makespans_s == (alone.makespan_s, alone.makespan_s)
    assert both.busy_s[1] == alone.busy_s and both.timeline[0] == alone.timeline


def test_a_region_waits_and_lasts_at_least_its_floor():
    steps = build_schedule("1f1b", 1, 2)
    waits = simulate_pipelines([steps], [[StageTiming(Region(1.0, 0.5), Region(2.0, 0.0, 3.0))]])
    assert waits.makespans_s == (pytest.approx(2 * (1.5 + 3.0)),)


class OneCore:
    """A node with one core: n processes computing each progress at 1/n."""

    def rate(self, node, computing):
        return 1.0 / computing


def test_a_rate_model_shares_the_cores_of_a_node():
    steps = build_schedule("1f1b", 1, 1)
    one = [StageTiming(Region(1.0), Region(1.0))]
    other_node = [StageTiming(Region(1.0), Region(1.0), node=1)]
    assert simulate_pipelines([steps, steps], [one, one], OneCore()).makespans_s == (
        pytest.approx(4.0),
        pytest.approx(4.0),
    )
    assert simulate_pipelines([steps, steps], [one, other_node], OneCore()).makespans_s == (
        pytest.approx(2.0),
        pytest.approx(2.0),
    )
    # A wait or a floor frees the core: the other pipeline computes alone meanwhile.
    padded = [StageTiming(Region(1.0, 0.0, 5.0), Region(0.0))]
    assert simulate_pipelines([steps, steps], [padded, one], OneCore()).makespans_s == (
        pytest.approx(5.0),
        pytest.approx(3.0),
    )
    # Without the rate model every process has a core of its own.
    assert simulate_pipelines([steps, steps], [one, one]).makespans_s == (2.0, 2.0)


def test_a_rate_model_must_give_positive_rates():
    class Stalled:
        def rate(self, node, computing):
            return 0.0

    steps = build_schedule("1f1b", 1, 1)
    one = [StageTiming(Region(1.0), Region(1.0))]
    with pytest.raises(ValueError, match="must be positive"):
        simulate_pipelines([steps], [one], Stalled())


def test_a_deadlock_among_pipelines_names_the_stuck_stages():
    first, last = build_schedule("1f1b", 2, 1)
    last = [s for s in last if not (isinstance(s, Action) and s.kind is ActionKind.RECV_FORWARD)]
    stages = [StageTiming(Region(1.0), Region(1.0))] * 2
    with pytest.raises(
        ScheduleError,
        match=r"^deadlock in simulation: pipeline 1 stage 0 at "
        r"step 1, pipeline 1 stage 1 at step 2$",
    ):
        simulate_pipelines(
            [build_schedule("1f1b", 1, 1), [first, last]], [stages[:1], stages], OneCore()
        )
