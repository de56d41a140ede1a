"""Stage-boundary transfers overlapped with compute (Megatron-LM's --overlap-p2p-communication):
the overlapped lists as data, sound under the strict backend models of the check, and what the
overlap saves in the simulation and the closed form."""

import itertools
import random

import pytest

from megatron_het.perf import closed_form_interleaved, lower_bound_interleaved
from megatron_het.perf.schedule.simulation_cache import SimulationCache
from megatron_het.perf.schedule.simulator import simulate
from megatron_het.pipeline import (
    Action,
    ActionKind,
    P2PBatch,
    P2PPost,
    P2PWait,
    ScheduleError,
    build_schedule,
    check_schedule,
    interleaved_one_f_one_b,
)

K = ActionKind
GRID = [
    (p, v, m)
    for p in range(2, 6)
    for v in range(2, 4)
    for m in sorted({p, p + 1, 2 * p, 2 * p + 1, 3 * p, 4 * p - 1})
]
MODELS = list(itertools.product((False, True), repeat=2))  # (untagged, in_order)


def compute(steps):
    return [a for a in steps if isinstance(a, Action) and a.kind in (K.FORWARD, K.BACKWARD)]


def makespan(p, v, m, f, b, c=None, overlap=True):
    lists = build_schedule("1f1b", p, m, num_chunks=v, overlap_p2p=overlap)
    return simulate(lists, f, b, c, c, record_timeline=False).makespan_s


@pytest.mark.parametrize("p, v, m", GRID)
def test_overlapped_lists_are_sound_under_every_backend_model(p, v, m):
    blocking = build_schedule("1f1b", p, m, num_chunks=v)
    lists = build_schedule("1f1b", p, m, num_chunks=v, overlap_p2p=True)
    peaks = check_schedule(blocking, m, num_stages=v * p).peak_in_flight
    for untagged, in_order in MODELS:
        for schedule in (blocking, lists):
            report = check_schedule(
                schedule, m, num_stages=v * p, untagged=untagged, in_order=in_order
            )
            assert report.peak_in_flight == peaks
    for group, steps in enumerate(lists):
        assert compute(steps) == compute(blocking[group])
        assert not [s for s in steps if isinstance(s, P2PBatch)]
        posts = [s.actions for s in steps if isinstance(s, P2PPost)]
        waits = [s.actions for s in steps if isinstance(s, P2PWait)]
        assert sorted(map(str, posts)) == sorted(map(str, waits))  # each post waited once
        # each post carries one direction only
        assert all(
            len({a.kind in (K.SEND_FORWARD, K.RECV_FORWARD) for a in post}) == 1 for post in posts
        )


def test_activations_are_posted_before_the_backward_of_their_round():
    steps = build_schedule("1f1b", 3, 6, num_chunks=2, overlap_p2p=True)[1]
    kinds = [type(s).__name__ if not isinstance(s, Action) else s.kind.name for s in steps]
    # steady state: forward, post of its activations, then the backward (after a wait for
    # its gradient, posted one round earlier), then the post of the gradients
    i = kinds.index("BACKWARD")
    assert kinds[i - 3 : i + 2] == ["FORWARD", "P2PPost", "P2PWait", "BACKWARD", "P2PPost"]
    assert steps[i - 2].actions[0].kind in (K.SEND_FORWARD, K.RECV_FORWARD)
    assert steps[i + 1].actions[0].kind in (K.SEND_BACKWARD, K.RECV_BACKWARD)


def test_plain_pipelines_keep_blocking_transfers_but_can_overlap_too():
    # As Megatron-LM, the option is for interleaved pipelines: plain lists stay as they are.
    assert build_schedule("1f1b", 3, 5, overlap_p2p=True) == build_schedule("1f1b", 3, 5)
    # The transform itself also serves a 1F1B list whose actions name their stage.
    lists = [interleaved_one_f_one_b(3, 1, 5, g, overlap_p2p=True) for g in range(3)]
    for untagged, in_order in MODELS:
        check_schedule(lists, 5, untagged=untagged, in_order=in_order)
    assert any(isinstance(step, P2PPost) for step in lists[1])


def test_the_check_catches_missing_and_stray_waits():
    lists = [list(s) for s in build_schedule("1f1b", 2, 4, num_chunks=2, overlap_p2p=True)]
    steps = lists[1]
    i = next(i for i, s in enumerate(steps) if isinstance(s, P2PWait) and i > 5)
    dropped = steps.pop(i)
    with pytest.raises(ScheduleError, match="has not been received"):
        check_schedule(lists, 4, num_stages=4)
    steps.insert(i, dropped)
    steps.append(dropped)
    with pytest.raises(ScheduleError, match="waits for transfers that are not posted"):
        check_schedule(lists, 4, num_stages=4)
    steps.pop()
    last_wait = max(i for i, s in enumerate(steps) if isinstance(s, P2PWait))
    del steps[last_wait]
    with pytest.raises(ScheduleError, match="posts transfers it never waits for"):
        check_schedule(lists, 4, num_stages=4)


def test_untagged_and_in_order_models_catch_what_tags_allow():
    """Two lists, four stages, one micro-batch: list 1 posts its gradient's receive first.
    With tags (gloo) that waits on its own channel; without tags (NCCL matches the messages
    between two ranks in order) list 0's first message to list 1, an activation, meets it;
    with one communication stream per rank nothing behind the early post can complete."""

    def a(kind, stage, peer=None):
        return Action(kind, 0, peer, stage)

    early = (a(K.RECV_BACKWARD, 1, 2),)
    lists = [
        [
            a(K.FORWARD, 0),
            a(K.SEND_FORWARD, 0, 1),
            a(K.RECV_FORWARD, 2, 1),
            a(K.FORWARD, 2),
            a(K.SEND_FORWARD, 2, 3),
            a(K.RECV_BACKWARD, 2, 3),
            a(K.BACKWARD, 2),
            a(K.SEND_BACKWARD, 2, 1),
            a(K.RECV_BACKWARD, 0, 1),
            a(K.BACKWARD, 0),
        ],
        [
            P2PPost(early),
            a(K.RECV_FORWARD, 1, 0),
            a(K.FORWARD, 1),
            a(K.SEND_FORWARD, 1, 2),
            a(K.RECV_FORWARD, 3, 2),
            a(K.FORWARD, 3),
            a(K.BACKWARD, 3),
            a(K.SEND_BACKWARD, 3, 2),
            P2PWait(early),
            a(K.BACKWARD, 1),
            a(K.SEND_BACKWARD, 1, 0),
        ],
    ]
    check_schedule(lists, 1, num_stages=4)
    with pytest.raises(ScheduleError, match="same order on both sides"):
        check_schedule(lists, 1, num_stages=4, untagged=True)
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule(lists, 1, num_stages=4, in_order=True)


@pytest.mark.parametrize("p, v, mult", [(2, 2, 2), (3, 2, 2), (4, 2, 3), (4, 3, 2), (5, 4, 2)])
def test_overlap_pays_one_way_through_every_boundary_and_back(p, v, mult):
    """Uniform stages, transfers no longer than a forward: the steady state hides them all and
    the makespan is the compute's plus one micro-batch's way over the 2 (n - 1) boundaries,
    as the closed form says; blocking transfers pay per exchange."""
    m, n = mult * p, p * v
    f, b = [1.0] * n, [2.0] * n
    for c in (0.3, 1.0):
        p2p = [c] * (n - 1)
        alone = makespan(p, v, m, f, b)
        overlapped = makespan(p, v, m, f, b, p2p)
        assert overlapped == pytest.approx(alone + 2 * (n - 1) * c, rel=1e-12)
        assert closed_form_interleaved(f, b, m, v, p2p, p2p, overlap_p2p=True) == pytest.approx(
            overlapped, rel=1e-12
        )
        assert overlapped < makespan(p, v, m, f, b, p2p, overlap=False)


def test_overlapped_closed_form_against_the_simulation_on_random_stages():
    rng = random.Random(5)
    ratios = []
    for _ in range(60):
        p, v = rng.randint(2, 5), rng.randint(2, 4)
        m, n = rng.randint(2 * p, 3 * p), p * v
        f = [rng.uniform(0.5, 2.0) for _ in range(n)]
        b = [x * rng.uniform(1.5, 2.5) for x in f]
        scale = rng.choice([0.2, 1.0, 1.5])
        cf = [rng.uniform(0, scale) for _ in range(n - 1)]
        cb = [rng.uniform(0, scale) for _ in range(n - 1)]
        lists = build_schedule("1f1b", p, m, num_chunks=v, overlap_p2p=True)
        time = simulate(lists, f, b, cf, cb, record_timeline=False).makespan_s
        assert time >= lower_bound_interleaved(f, b, m, v, cf, cb) - 1e-9
        assert (
            time
            <= makespan(p, v, m, f, b, None, False)
            + sum(cf)
            + sum(cb)
            + (m * v * (max(cf) + max(cb)))
            + 1e-9
        )
        ratios.append(closed_form_interleaved(f, b, m, v, cf, cb, overlap_p2p=True) / time)
    assert 0.9 < min(ratios) and max(ratios) < 1.3


def test_the_cache_keeps_overlapped_and_blocking_apart():
    cache = SimulationCache()
    f, b, c = [1.0] * 4, [2.0] * 4, [0.5] * 3
    blocking = cache.makespan(f, b, 4, c, c, 2)
    overlapped = cache.makespan(f, b, 4, c, c, 2, overlap_p2p=True)
    assert overlapped < blocking
    assert cache.makespan(f, b, 4, c, c, 2) == blocking
    assert cache.last_backwards(f, b, 4, c, c, 2, overlap_p2p=True)[0] == overlapped
    # plain pipelines ignore the option (as the runtime does)
    assert cache.makespan(f[:2], b[:2], 4, c[:1], c[:1], 1, overlap_p2p=True) == cache.makespan(
        f[:2], b[:2], 4, c[:1], c[:1], 1
    )
