"""Interleaved 1F1B as data: sound under the rendezvous check, Megatron-LM's order and warm-up,
broken lists caught, activation peaks with per-stage weights (also from the compute alone)."""

import pytest

from megatron_het.pipeline import (
    Action,
    ActionKind,
    P2PBatch,
    ScheduleError,
    build_schedule,
    check_schedule,
    interleaved_micro_batch_counts_ok,
    interleaved_one_f_one_b,
    one_f_one_b,
    peak_activation,
    sequential_forward,
)
from megatron_het.pipeline.schedule_check import held_counts
from megatron_het.pipeline.schedules import (
    interleaved_compute,
    interleaved_group_size,
    interleaved_order,
)

K = ActionKind
GRID = [
    (p, v, m)
    for p in range(2, 7)
    for v in range(2, 5)
    for m in sorted({p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 4 * p, 5 * p - 2})
]
SENDS = (K.SEND_FORWARD, K.SEND_BACKWARD)


def actions(steps):
    return [a for step in steps for a in (step.actions if isinstance(step, P2PBatch) else (step,))]


def compute_order(steps):
    return [
        (a.kind.name[0], a.stage, a.micro_batch)
        for a in actions(steps)
        if a.kind in (K.FORWARD, K.BACKWARD)
    ]


def megatron_group_size(p, m):
    """Megatron-LM's rule for --microbatch-group-size-per-virtual-stage N: p <= N <= m, and
    the last group (m % N micro-batches) empty or at least p; the smallest such N."""
    return min(n for n in range(p, m + 1) if m % n == 0 or m % n >= p)


def expected_order(p, v, m, g):
    """Written out from Megatron-LM's rules: micro-batch groups of N (the last one takes what
    is left), each run through chunks 0..v-1 (backward v-1..0); with m a multiple of p,
    micro-step k runs local chunk (k % pv) // p on micro-batch (k // pv) * p + k % p; warm-up
    forwards, then forward/backward pairs, then the remaining backwards."""
    n = megatron_group_size(p, m)
    table = []
    for low in range(0, m, n):
        high = m if low + n >= m else low + n
        table += [(c, mb) for c in range(v) for mb in range(low, high)]

    def step(k, forward):
        chunk, mb = table[k]
        return (chunk if forward else v - 1 - chunk) * p + g, mb

    if m % p == 0:
        assert [step(k, True) for k in range(m * v)] == [
            (((k % (p * v)) // p) * p + g, (k // (p * v)) * p + k % p) for k in range(m * v)
        ]
    total = m * v
    warmup = total if m == p else min(2 * (p - g - 1) + (v - 1) * n, total)
    order = [("F", *step(k, True)) for k in range(warmup)]
    for j in range(total - warmup):
        order += [("F", *step(warmup + j, True)), ("B", *step(j, False))]
    return order + [("B", *step(k, False)) for k in range(total - warmup, total)], warmup


@pytest.mark.parametrize("p, v, m", GRID)
def test_interleaved_is_sound_in_megatron_order_with_its_warmup_peak(p, v, m):
    lists = build_schedule("1f1b", p, m, num_chunks=v)
    report = check_schedule(lists, m, num_stages=v * p)
    assert (report.num_stages, report.num_micro_batches) == (v * p, m)
    peaks = []
    for g, steps in enumerate(lists):
        order, warmup = expected_order(p, v, m, g)
        assert compute_order(steps) == order
        assert all(a.stage is not None and a.stage % p == g for a in actions(steps))
        # Warm-up forwards are all held; the first steady forward adds one more.
        peaks.append(m * v if m == p else min(warmup + 1, m * v))
    assert report.peak_in_flight == tuple(peaks)


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_one_chunk_is_one_f_one_b_with_stages_named(p, m):
    lists = [interleaved_one_f_one_b(p, 1, m, g) for g in range(p)]
    report = check_schedule(lists, m, num_stages=p)
    assert report.peak_in_flight == tuple(min(p - g, m) for g in range(p))
    for g, steps in enumerate(lists):
        assert all(a.stage == g for a in actions(steps))
        plain = [Action(a.kind, a.micro_batch, a.peer_stage) for a in actions(steps)]
        assert plain == actions(one_f_one_b(p, m, g))


def test_steady_state_exchanges_all_four_transfers_in_one_batch():
    steps = interleaved_one_f_one_b(3, 2, 6, 1)
    batches = [s for s in steps if isinstance(s, P2PBatch)]
    kinds = [sorted(a.kind.value for a in b.actions) for b in batches]
    assert sorted(k.value for k in ActionKind if k not in (K.FORWARD, K.BACKWARD)) in kinds
    # Every exchange follows compute and precedes compute: never two transfer steps in a row.
    is_transfer = [not (isinstance(s, Action) and s.kind in (K.FORWARD, K.BACKWARD)) for s in steps]
    assert not any(a and b for a, b in zip(is_transfer, is_transfer[1:]))


@pytest.mark.parametrize("p, v", [(2, 2), (2, 3), (3, 2), (4, 3)])
def test_each_pair_of_groups_orders_its_messages_alike_at_both_ends(p, v):
    """A backend that matches messages per pair of ranks by order, without tags (NCCL), needs
    the sends from g to h, both directions merged, in the order h receives them."""
    lists = build_schedule("1f1b", p, 2 * p, num_chunks=v)
    sent, received = {}, {}
    for g, steps in enumerate(lists):
        for a in actions(steps):
            if a.kind in (K.FORWARD, K.BACKWARD):
                continue
            if a.kind in SENDS:
                sent.setdefault((g, a.peer_stage % p), []).append((a.stage, a.micro_batch))
            else:
                received.setdefault((a.peer_stage % p, g), []).append((a.peer_stage, a.micro_batch))
    assert sent == received


def test_micro_batch_groups_follow_megatron():
    # Megatron-LM's own example, PP 2, N 3, M 5, VP 2: micro-batches 0 1 2 0 1 2 3 4 3 4 on
    # chunks 0 0 0 1 1 1 0 0 1 1.
    assert interleaved_group_size(2, 5) == 3
    assert interleaved_order(2, 2, 5, True) == list(
        zip([0, 0, 0, 1, 1, 1, 0, 0, 1, 1], [0, 1, 2, 0, 1, 2, 3, 4, 3, 4])
    )
    for p in range(1, 9):
        for m in range(1, 40):
            want = megatron_group_size(p, m) if m >= p else None
            assert interleaved_group_size(p, m) == want, (p, m)
    assert interleaved_group_size(22, 128) == 26  # the paper mix's pipeline: 4 x 26 + 24
    assert interleaved_group_size(4, 8) == 4


def test_micro_batch_count_must_cover_the_groups():
    with pytest.raises(
        ValueError,
        match=r"interleaved 1F1B over 4 device groups needs at least "
        r"4 micro-batches; got 3",
    ):
        interleaved_one_f_one_b(4, 2, 3, 0)
    with pytest.raises(ValueError, match="at least 3"):
        build_schedule("1f1b", 3, 2, num_chunks=2)
    assert [m for m in range(1, 9) if interleaved_micro_batch_counts_ok(4, m)] == [4, 5, 6, 7, 8]
    interleaved_one_f_one_b(4, 1, 3, 0)  # one chunk: any count
    with pytest.raises(ValueError, match="at least 2 device groups"):
        interleaved_one_f_one_b(1, 2, 2, 0)
    with pytest.raises(ValueError, match="does not interleave"):
        build_schedule("gpipe", 2, 4, num_chunks=2)
    with pytest.raises(ValueError, match="num_chunks >= 1"):
        build_schedule("1f1b", 2, 4, num_chunks=0)


def find(steps, pred):
    return [i for i, step in enumerate(steps) if isinstance(step, Action) and pred(step)]


def test_swapped_receives_are_caught():
    lists = build_schedule("1f1b", 2, 4, num_chunks=2)
    steps = lists[1]
    first, second = (
        find(steps, lambda a: a.kind is K.RECV_FORWARD)[:1]
        + [i for i, s in enumerate(steps) if isinstance(s, P2PBatch)][:1]
    )
    assert str(steps[first]) == "RECV_FORWARD stage 1 mb 0 <- stage 0"
    assert str(steps[second]) == (
        "[SEND_FORWARD stage 1 mb 0 -> stage 2 + RECV_FORWARD stage 1 mb 1 <- stage 0]"
    )
    recv = steps[second].actions[1]
    steps[first] = recv
    steps[second] = P2PBatch((steps[second].actions[0], Action(K.RECV_FORWARD, 0, 0, 1)))
    with pytest.raises(
        ScheduleError,
        match=r"group 0 step 1 sends SEND_FORWARD stage 0 mb 0 -> "
        r"stage 1 while group 1 step 0 expects RECV_FORWARD "
        r"stage 1 mb 1 <- stage 0: transfers between two "
        r"groups must come in the same order",
    ):
        check_schedule(lists, num_stages=4)


def test_a_dropped_send_is_caught():
    lists = build_schedule("1f1b", 3, 3, num_chunks=2)
    assert str(lists[2][6]) == (
        "[SEND_FORWARD stage 2 mb 2 -> stage 3 + RECV_FORWARD stage 5 mb 0 <- stage 4]"
    )
    assert str(lists[2][23]) == "SEND_BACKWARD stage 2 mb 2 -> stage 1"
    last = [list(steps) for steps in lists]
    last[2][6] = last[2][6].actions[1]  # the last message on its channel: never comes
    with pytest.raises(ScheduleError) as info:
        check_schedule(last, num_stages=6)
    assert str(info.value) == (
        "deadlock: no group can move (group 0 at step 9 [SEND_FORWARD stage 3 mb 1 -> stage 4 + "
        "RECV_FORWARD stage 3 mb 2 <- stage 2]; group 1 at step 10 [SEND_FORWARD stage 4 mb 1 "
        "-> stage 5 + RECV_FORWARD stage 4 mb 2 <- stage 3]; group 2 at step 10 RECV_FORWARD "
        "stage 5 mb 2 <- stage 4)"
    )
    del lists[2][23]  # a gradient of stage 2 never leaves
    with pytest.raises(
        ScheduleError,
        match=r"deadlock: .*group 1 at step 22 \[SEND_BACKWARD stage "
        r"1 mb 1 -> stage 0 \+ RECV_BACKWARD stage 1 mb 2 <- "
        r"stage 2\]\)$",
    ):
        check_schedule(lists, num_stages=6)
    first = build_schedule("1f1b", 3, 3, num_chunks=2)
    first[2][2] = first[2][2].actions[1]  # later messages on the channel arrive one early
    with pytest.raises(
        ScheduleError,
        match=r"group 2 step 4 sends SEND_FORWARD stage 2 mb 1 -> "
        r"stage 3 while group 0 step 5 expects RECV_FORWARD "
        r"stage 3 mb 0 <- stage 2",
    ):
        check_schedule(first, num_stages=6)


@pytest.mark.parametrize(
    "group, mutate, message",
    [
        (
            0,
            lambda a: Action(a.kind, a.micro_batch, a.peer_stage, 1),
            "stage 1 does not run on group 0",
        ),
        (0, lambda a: Action(a.kind, a.micro_batch, a.peer_stage, 6), "stage 6 does not run"),
        (
            0,
            lambda a: Action(a.kind, a.micro_batch, a.peer_stage),
            "must name the stage of every action",
        ),
        (
            1,
            lambda a: Action(a.kind, a.micro_batch, a.peer_stage, a.stage - 2),
            "micro-batch 0 of stage 1 is forwarded twice",
        ),
        (
            1,
            lambda a: Action(a.kind, a.micro_batch, 4, a.stage),
            "FORWARD must have peer_stage None on stage 3 of 4",
        ),
    ],
)
def test_a_wrong_stage_or_peer_is_caught(group, mutate, message):
    lists = build_schedule("1f1b", 2, 2, num_chunks=2)
    i = find(lists[group], lambda a: a.kind is K.FORWARD and a.stage >= 2)[0]
    lists[group][i] = mutate(lists[group][i])
    with pytest.raises(ScheduleError, match=message):
        check_schedule(lists, num_stages=4)


def test_a_wrong_transfer_peer_and_missing_work_are_caught():
    lists = build_schedule("1f1b", 2, 2, num_chunks=2)
    i = find(lists[0], lambda a: a.kind is K.SEND_FORWARD)[0]
    lists[0][i] = Action(K.SEND_FORWARD, 0, 3, 0)
    with pytest.raises(ScheduleError, match="SEND_FORWARD must have peer_stage 1 on stage 0 of 4"):
        check_schedule(lists, num_stages=4)
    lists = build_schedule("1f1b", 2, 2, num_chunks=2)
    assert str(lists[0][-1]) == "BACKWARD stage 0 mb 1"
    lists[0].pop()
    with pytest.raises(
        ScheduleError,
        match=r"group 0 runs backward of stage 0 on micro-batches "
        r"\[0\]; every stage must run it once on each of 0..1",
    ):
        check_schedule(lists, num_stages=4)
    with pytest.raises(ValueError, match="3 stages cannot run round-robin on 2 lists"):
        check_schedule(build_schedule("1f1b", 2, 2), num_stages=3)


@pytest.mark.parametrize("p, v, m", [(2, 2, 3), (3, 2, 2), (4, 3, 5), (3, 1, 2)])
def test_sequential_forward_is_sound_forward_only(p, v, m):
    lists = [sequential_forward(p, v, m, g) for g in range(p)]
    report = check_schedule(lists, m, num_stages=v * p, forward_only=True)
    assert report.peak_in_flight == (m * v,) * p  # nothing is backwarded
    with pytest.raises(ScheduleError, match="runs backward of stage|runs backward on"):
        check_schedule(lists, m, num_stages=v * p)


def test_peak_activation_weighs_each_stage():
    steps = interleaved_one_f_one_b(2, 2, 4, 0)
    assert [f"{k}{s}.{mb}" for k, s, mb in compute_order(steps)] == [
        "F0.0",
        "F0.1",
        "F2.0",
        "F2.1",
        "F0.2",
        "B2.0",
        "F0.3",
        "B2.1",
        "F2.2",
        "B0.0",
        "F2.3",
        "B0.1",
        "B2.2",
        "B2.3",
        "B0.2",
        "B0.3",
    ]
    # Held weight after each compute, stage 0 weighing 1 and stage 2 weighing 10:
    # 1 2 12 22 23 13 14 4 14 13 23 22 12 2 1 0
    assert peak_activation(steps, {0: 1.0, 2: 10.0}.__getitem__) == 23.0
    assert peak_activation(steps, {0: 10.0, 2: 1.0}.__getitem__) == 41.0  # after F0.3 or F2.2
    assert (
        peak_activation(steps, lambda s: 1.0)
        == check_schedule(build_schedule("1f1b", 2, 4, num_chunks=2), num_stages=4).peak_in_flight[
            0
        ]
    )
    plain = [
        Action(K.FORWARD, 0),
        Action(K.FORWARD, 1),
        Action(K.BACKWARD, 0),
        Action(K.FORWARD, 2),
        Action(K.BACKWARD, 1),
        Action(K.BACKWARD, 2),
    ]
    assert peak_activation(plain, lambda s: 0.5 * (s + 1), own_stage=3) == 4.0
    assert peak_activation([], lambda s: 1.0) == 0.0


@pytest.mark.parametrize("p, v, m", GRID + [(p, 1, m) for p in (2, 3, 5) for m in (1, p, 3 * p)])
def test_compute_alone_is_the_lists_compute_and_holds_the_same_peaks(p, v, m):
    for g in range(p):
        full = interleaved_one_f_one_b(p, v, m, g)
        alone = interleaved_compute(p, v, m, g)
        assert compute_order(alone) == compute_order(full)
        assert held_counts(alone, g) == held_counts(full, g)
        n = v * p  # two non-negative weightings: later stages heavier, then lighter
        for weights in ({s: 1.0 + s for s in range(n)}, {s: 1.0 + n - s for s in range(n)}):
            best = max(sum(count * weights[s] for s, count in vec) for vec in held_counts(alone, g))
            assert best == pytest.approx(peak_activation(full, weights.__getitem__, own_stage=g))
