"""The planner's layer moves between chunks (planner/chunk_polish.py), against a made-up
iteration time: the moves taken, the least gain a move needs, and the memory check."""

from types import SimpleNamespace

from megatron_het.parallel.plan import ParallelPlan
from megatron_het.planner.chunk_polish import MIN_GAIN, polish_chunks, with_chunk_sizes

PLAN = ParallelPlan.load("scripts/plans/cpu_emulated_interleaved.json")  # chunks 3, 1, 3, 1


def sizes(plan):
    return [stage.num_layers for stage in plan.pipelines[0].stages]


def timed(cost):
    """A predictor whose iteration time is ``cost(sizes)``."""
    return lambda plan: SimpleNamespace(iteration_time_s=cost(sizes(plan)), sizes=sizes(plan))


def test_moves_layers_while_the_time_drops_and_keeps_every_stage_whole():
    moved = with_chunk_sizes(PLAN, [2, 2, 2, 2])
    assert sizes(moved) == [2, 2, 2, 2]
    assert [st.layers for st in moved.pipelines[0].stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [st.ranks for st in moved.pipelines[0].stages] == [
        st.ranks for st in PLAN.pipelines[0].stages
    ]
    # Uneven chunks cost more (the sum of their squares): the best split evens them out.
    predict = timed(lambda s: float(sum(n * n for n in s)))
    plan, prediction = polish_chunks(PLAN, predict, lambda p: True, predict(PLAN))
    assert sizes(plan) == [2, 2, 2, 2] and prediction.iteration_time_s == 16.0


def uneven(base, step):
    """``base`` plus ``step`` per unit of the squares' sum: a move from a 3-layer chunk to a
    1-layer one lowers it by ``2 step``."""
    return lambda s: base + step * sum(n * n for n in s)


def test_a_move_must_gain_min_gain_and_fit():
    base = 100.0
    # Each move gains about half of MIN_GAIN: none is taken.
    predict = timed(uneven(base, base * MIN_GAIN / 4))
    plan, _ = polish_chunks(PLAN, predict, lambda p: True, predict(PLAN))
    assert plan is PLAN
    # About twice MIN_GAIN: taken, unless the plan no longer fits.
    predict = timed(uneven(base, base * MIN_GAIN))
    plan, _ = polish_chunks(PLAN, predict, lambda p: True, predict(PLAN))
    assert sizes(plan) == [2, 2, 2, 2]
    plan, _ = polish_chunks(PLAN, predict, lambda p: p.sizes == [3, 1, 3, 1], predict(PLAN))
    assert plan is PLAN
