"""Pipeline schedules as data: 1F1B and GPipe pass the process-free check; broken lists fail."""

import pytest

from megatron_het.pipeline import (
    Action,
    ActionKind,
    P2PBatch,
    ScheduleError,
    build_schedule,
    check_schedule,
    gpipe,
    one_f_one_b,
)

K = ActionKind
GRID = [(s, m) for s in range(1, 6) for m in range(1, 10)]


def compute_order(steps):
    """The stage's compute as "F0", "B0", ... in list order."""
    return [
        f"{a.kind.name[0]}{a.micro_batch}"
        for a in steps
        if isinstance(a, Action) and a.kind in (K.FORWARD, K.BACKWARD)
    ]


@pytest.mark.parametrize("num_stages, num_mb", GRID)
def test_one_f_one_b_is_sound_and_bounds_activations(num_stages, num_mb):
    per_stage = build_schedule("1f1b", num_stages, num_mb)
    report = check_schedule(per_stage)
    assert report.num_micro_batches == num_mb
    assert report.peak_in_flight == tuple(min(num_stages - s, num_mb) for s in range(num_stages))
    for s, steps in enumerate(per_stage):
        # Written out from the textbook description: warm-up forwards, F/B pairs, cool-down.
        warmup = min(num_stages - s - 1, num_mb)
        expected = [f"F{i}" for i in range(warmup)]
        for i in range(num_mb - warmup):
            expected += [f"F{warmup + i}", f"B{i}"]
        expected += [f"B{i}" for i in range(num_mb - warmup, num_mb)]
        assert compute_order(steps) == expected


@pytest.mark.parametrize("num_stages, num_mb", GRID)
def test_gpipe_is_sound_and_holds_every_micro_batch(num_stages, num_mb):
    report = check_schedule(build_schedule("gpipe", num_stages, num_mb))
    assert report.peak_in_flight == (num_mb,) * num_stages
    assert compute_order(gpipe(num_stages, num_mb, 0)) == (
        [f"F{i}" for i in range(num_mb)] + [f"B{i}" for i in range(num_mb)]
    )


def test_steady_state_pairs_transfers_with_one_peer():
    steps = one_f_one_b(3, 4, 1)
    batches = [step for step in steps if isinstance(step, P2PBatch)]
    assert batches, "the steady state of a middle stage batches its transfers"
    for batch in batches:
        kinds = {a.kind for a in batch.actions}
        assert kinds in ({K.SEND_FORWARD, K.RECV_BACKWARD}, {K.SEND_BACKWARD, K.RECV_FORWARD})
        assert len({a.peer_stage for a in batch.actions}) == 1
    assert str(batches[0]) == "[SEND_FORWARD mb 1 -> stage 2 + RECV_BACKWARD mb 0 <- stage 2]"


def unbatched(per_stage):
    return [
        [a for step in steps for a in (step.actions if isinstance(step, P2PBatch) else (step,))]
        for steps in per_stage
    ]


def test_steady_state_without_batching_deadlocks():
    with pytest.raises(
        ScheduleError,
        match=r"deadlock: no stage can move \(stage 0 at step 3 "
        r"SEND_FORWARD mb 1 -> stage 1; stage 1 at step 3 "
        r"SEND_BACKWARD mb 0 -> stage 0\)",
    ):
        check_schedule(unbatched(build_schedule("1f1b", 2, 2)))
    check_schedule(unbatched(build_schedule("gpipe", 3, 4)))  # GPipe needs no batching


def test_swapped_sends_are_caught():
    per_stage = build_schedule("1f1b", 3, 4)
    steps = per_stage[0]
    assert [str(a) for a in steps[:4]] == [
        "FORWARD mb 0",
        "SEND_FORWARD mb 0 -> stage 1",
        "FORWARD mb 1",
        "SEND_FORWARD mb 1 -> stage 1",
    ]
    steps[1], steps[2] = steps[2], steps[1]  # F0 F1 S0 S1: still sound
    check_schedule(per_stage)
    steps[2], steps[3] = steps[3], steps[2]  # F0 F1 S1 S0: the sends are swapped
    with pytest.raises(ScheduleError) as info:
        check_schedule(per_stage)
    assert str(info.value) == (
        "stage 0 step 2 sends SEND_FORWARD mb 1 -> stage 1 while stage 1 step 0 expects "
        "RECV_FORWARD mb 0 <- stage 0: transfers between two stages must come in the same "
        "order on both sides"
    )


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda st: st[1].pop(0) and st[1].insert(1, Action(K.RECV_FORWARD, 0, 0)),
            "stage 1 step 0 (FORWARD mb 0): the input of micro-batch 0 has not been received",
        ),
        (
            lambda st: st[0].insert(0, Action(K.SEND_FORWARD, 3, 1)),
            "stage 0 step 0 (SEND_FORWARD mb 3 -> stage 1): sends micro-batch 3 before its forward",
        ),
        (
            lambda st: st[0].append(Action(K.SEND_FORWARD, 0, 2)),
            "SEND_FORWARD must have peer_stage 1 on stage 0 of 2",
        ),
        (lambda st: st[1].append(Action(K.BACKWARD, 0)), "micro-batch 0 is backwarded twice"),
        (lambda st: st[0].append(P2PBatch((Action(K.FORWARD, 0),))), "holds one or more transfers"),
    ],
)
def test_broken_lists_are_caught(mutate, message):
    per_stage = build_schedule("1f1b", 2, 2)
    mutate(per_stage)
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_schedule(per_stage)


def test_every_micro_batch_must_be_run():
    steps = one_f_one_b(1, 3, 0)
    assert steps[-1] == Action(K.BACKWARD, 2)
    with pytest.raises(
        ScheduleError,
        match=r"stage 0 runs backward on micro-batches \[0, 1\]; "
        r"every stage must run it once on each of 0..2",
    ):
        check_schedule([steps[:-1]], num_micro_batches=3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        build_schedule("zb", 2, 2)
    with pytest.raises(ValueError, match="0 <= stage < num_stages"):
        one_f_one_b(2, 4, 2)


def test_an_action_shows_its_stage_only_when_set():
    assert str(Action(K.FORWARD, 2)) == "FORWARD mb 2"
    assert str(Action(K.FORWARD, 2, stage=5)) == "FORWARD stage 5 mb 2"
    assert str(Action(K.RECV_BACKWARD, 1, 6, 5)) == "RECV_BACKWARD stage 5 mb 1 <- stage 6"
    assert build_schedule("1f1b", 3, 4, num_chunks=1) == build_schedule("1f1b", 3, 4)
    assert all(
        a.stage is None
        for steps in build_schedule("1f1b", 3, 4)
        for a in steps
        if isinstance(a, Action)
    )
