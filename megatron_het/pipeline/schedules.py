"""Pipeline schedules written as data, and a process-free check that they are sound.

A pipeline has ``p`` device groups and ``n = v * p`` stages (model chunks, global index
``s = 0..n-1`` from embedding to head); stage ``s`` runs on group ``s % p``, so group ``g`` holds
the local chunks ``c = 0..v-1`` = stages ``c * p + g``. Without interleaving ``v = 1`` and a
group is a stage. Activations flow ``s -> s + 1``, their gradients ``s + 1 -> s``.

A schedule for one group is a list of steps run in order by an executor (written separately):

- ``Action(FORWARD | BACKWARD, mb, stage=s)``: compute on micro-batch ``mb`` at stage ``s``;
- ``Action(SEND_* | RECV_*, mb, peer_stage, s)``: one blocking point-to-point transfer of the
  activations (forward) or of their gradients (backward) of ``mb`` between ``s`` and
  ``peer_stage = s +- 1``;
- ``P2PBatch(actions)``: transfers posted together and waited on together (the executor issues
  them as one batched isend/irecv), e.g. SEND_FORWARD + RECV_BACKWARD in the 1F1B steady state;
- ``P2PPost(actions)`` / ``P2PWait(actions)``: the same transfers posted without waiting and
  waited on later, so compute in between overlaps them (:func:`overlap_transfers` turns a list
  of blocking transfers into one, as Megatron-LM's ``--overlap-p2p-communication`` does for
  interleaved pipelines).

``stage=None`` means the list's own stage (the non-interleaved lists, one stage per list).
The actions live in :mod:`megatron_het.pipeline.actions`; :func:`check_schedule` (in
:mod:`megatron_het.pipeline.schedule_check`, re-exported here) proves a schedule sound without
processes. Schedules here: 1F1B, GPipe, interleaved 1F1B and the interleaved forward-only
order.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from megatron_het.pipeline.actions import (
    _RECV_OF,
    Action,
    ActionKind,
    P2PBatch,
    P2PPost,
    P2PWait,
    ScheduleError,
    Step,
    _actions_of,
    _batched,
)
from megatron_het.pipeline.overlap import overlap_transfers
from megatron_het.pipeline.schedule_check import ScheduleReport, check_schedule, peak_activation

ScheduleFn = Callable[[int, int, int], list[Step]]


def _check_args(num_stages: int, num_micro_batches: int, stage: int) -> None:
    if num_stages < 1 or num_micro_batches < 1 or not 0 <= stage < num_stages:
        raise ValueError(
            f"need num_stages >= 1, num_micro_batches >= 1 and 0 <= stage < "
            f"num_stages; got {num_stages}, {num_micro_batches}, {stage}"
        )


def _recv_forward(stage: int, mb: int) -> list[Action]:
    return [] if stage == 0 else [Action(ActionKind.RECV_FORWARD, mb, stage - 1)]


def _send_forward(stage: int, num_stages: int, mb: int) -> list[Action]:
    return [] if stage == num_stages - 1 else [Action(ActionKind.SEND_FORWARD, mb, stage + 1)]


def _recv_backward(stage: int, num_stages: int, mb: int) -> list[Action]:
    return [] if stage == num_stages - 1 else [Action(ActionKind.RECV_BACKWARD, mb, stage + 1)]


def _send_backward(stage: int, mb: int) -> list[Action]:
    return [] if stage == 0 else [Action(ActionKind.SEND_BACKWARD, mb, stage - 1)]


def one_f_one_b(num_stages: int, num_micro_batches: int, stage: int) -> list[Step]:
    """The non-interleaved 1F1B schedule of ``stage``.

    Warm-up: ``min(num_stages - stage - 1, num_micro_batches)`` forwards; steady state: one
    forward then one backward, pairing the transfers with the next stage (send activations of
    the newest micro-batch + receive gradients of the oldest) and with the previous stage (send
    gradients + receive the next input) as P2PBatch steps; cool-down: the remaining backwards.
    Micro-batches are backwarded in ascending order, so at most ``num_stages - stage`` are in
    flight at once.
    """
    _check_args(num_stages, num_micro_batches, stage)
    warmup = min(num_stages - stage - 1, num_micro_batches)
    steady = num_micro_batches - warmup
    steps: list[Step] = []
    for mb in range(warmup):
        steps += _recv_forward(stage, mb)
        steps.append(Action(ActionKind.FORWARD, mb))
        steps += _send_forward(stage, num_stages, mb)
    if steady > 0:
        steps += _recv_forward(stage, warmup)
    for i in range(steady):
        fwd_mb, bwd_mb = warmup + i, i
        steps.append(Action(ActionKind.FORWARD, fwd_mb))
        steps += _batched(
            _send_forward(stage, num_stages, fwd_mb) + _recv_backward(stage, num_stages, bwd_mb)
        )
        steps.append(Action(ActionKind.BACKWARD, bwd_mb))
        next_input = _recv_forward(stage, fwd_mb + 1) if i < steady - 1 else []
        steps += _batched(_send_backward(stage, bwd_mb) + next_input)
    for mb in range(steady, num_micro_batches):
        steps += _recv_backward(stage, num_stages, mb)
        steps.append(Action(ActionKind.BACKWARD, mb))
        steps += _send_backward(stage, mb)
    return steps


def gpipe(num_stages: int, num_micro_batches: int, stage: int) -> list[Step]:
    """All forwards, then all backwards (ascending, as in 1F1B, so gradients accumulate in the
    same order). Simple, but every micro-batch's activations are held at once."""
    _check_args(num_stages, num_micro_batches, stage)
    steps: list[Step] = []
    for mb in range(num_micro_batches):
        steps += _recv_forward(stage, mb)
        steps.append(Action(ActionKind.FORWARD, mb))
        steps += _send_forward(stage, num_stages, mb)
    for mb in range(num_micro_batches):
        steps += _recv_backward(stage, num_stages, mb)
        steps.append(Action(ActionKind.BACKWARD, mb))
        steps += _send_backward(stage, mb)
    return steps


# ---- interleaved 1F1B ----------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def interleaved_group_size(num_groups: int, num_micro_batches: int) -> int | None:
    """Megatron-LM's micro-batch group size N (``--microbatch-group-size-per-virtual-stage``)
    for ``m`` micro-batches over ``p`` device groups: each chunk runs N consecutive
    micro-batches before the next chunk takes them, the last group taking the remainder. N is
    the smallest value in ``[p, m]`` whose remainder ``m % N`` is 0 or at least ``p`` (a
    smaller last group would stall on its own inputs): ``p`` when ``m`` is a multiple of
    ``p``. None when ``m < p``."""
    p, m = num_groups, num_micro_batches
    for size in range(max(p, 1), m + 1):
        if m % size == 0 or m % size >= p:
            return size
    return None


def interleaved_micro_batch_counts_ok(num_groups: int, num_micro_batches: int) -> bool:
    """Whether interleaved 1F1B (more than one chunk per group) runs ``num_micro_batches``
    over ``num_groups`` device groups: at least one per group (a count that is not a
    multiple of the groups runs in micro-batch groups, :func:`interleaved_group_size`)."""
    return num_groups >= 1 and num_micro_batches >= num_groups


def _check_interleaved_args(
    num_groups: int, num_chunks: int, num_micro_batches: int, group: int
) -> None:
    if num_chunks < 1 or num_groups < 1 or not 0 <= group < num_groups:
        raise ValueError(
            f"need num_chunks >= 1, num_groups >= 1 and 0 <= group < num_groups; "
            f"got {num_chunks}, {num_groups}, {group}"
        )
    if num_chunks == 1:
        return
    if num_groups < 2:
        raise ValueError(f"interleaving {num_chunks} chunks needs at least 2 device groups")
    if not interleaved_micro_batch_counts_ok(num_groups, num_micro_batches):
        raise ValueError(
            f"interleaved 1F1B over {num_groups} device groups needs at least "
            f"{num_groups} micro-batches; got {num_micro_batches}"
        )


def interleaved_order(
    num_groups: int, num_chunks: int, num_micro_batches: int, forward: bool
) -> list[tuple[int, int]]:
    """Megatron-LM's interleaved compute order, the same on every group, as
    ``(chunk, micro_batch)`` for micro-steps ``0..m v - 1``: micro-batch groups of
    N = :func:`interleaved_group_size` (the last one takes the remainder), each run through
    local chunks ``0..v-1`` in turn (backward: ``v-1..0``). With ``m`` a multiple of ``p``
    micro-step ``k`` runs chunk ``(k % (p v)) // p`` on micro-batch ``(k // (p v)) p + k % p``."""
    p, v, m = num_groups, num_chunks, num_micro_batches
    size = interleaved_group_size(p, m) or m
    order = []
    for low in range(0, m, size):
        high = m if low + size >= m else low + size
        order += [(c if forward else v - 1 - c, mb) for c in range(v) for mb in range(low, high)]
    return order


def interleaved_warmup(num_groups: int, num_chunks: int, num_micro_batches: int, group: int) -> int:
    """Forwards before group ``group``'s first backward: ``min(2 (p - g - 1) + (v - 1) N, m v)``
    with N = :func:`interleaved_group_size`, and all ``m v`` when ``m == p`` (as Megatron-LM)."""
    p, v, m = num_groups, num_chunks, num_micro_batches
    if m == p:
        return m * v
    return min(2 * (p - group - 1) + (v - 1) * (interleaved_group_size(p, m) or m), m * v)


def interleaved_one_f_one_b(
    num_groups: int, num_chunks: int, num_micro_batches: int, group: int, overlap_p2p: bool = False
) -> list[Step]:
    """The interleaved 1F1B schedule of device group ``group``; every action names its stage.

    ``num_chunks`` = v chunks per group (v = 1: :func:`one_f_one_b`'s list with stages set).
    Compute follows :func:`interleaved_order` with :func:`interleaved_warmup` forwards, then one
    forward + one backward per step, then the remaining backwards. After every compute
    micro-step (steady state: after each forward+backward pair) comes ONE exchange (a P2PBatch
    when it holds several transfers): the sends of what was just computed (when its consumer
    exists) and the receives of the inputs of the next micro-step that come from another group
    (none for stage 0's input or the head's output gradient), except that the first group
    takes the last group's outputs (and the last the first's gradients) in the exchange where
    they are sent, p - 1 micro-steps on, holding them until needed (:func:`_group_skeleton`;
    with micro-batch groups larger than p they are needed later). A receive's (stage,
    micro-batch) is the one the sender sends in the same position on that channel. Peak
    activations held:
    ``m v`` when ``m == p``, else ``min(warm-up + 1, m v)`` (stage, micro-batch) pairs.
    ``overlap_p2p``: the exchanges posted without waiting, overlapped with compute
    (:func:`overlap_transfers`).
    Raises ValueError when ``num_micro_batches < num_groups`` (v > 1).
    """
    _check_interleaved_args(num_groups, num_chunks, num_micro_batches, group)
    if num_chunks == 1:
        steps = [
            _with_stage(step, group) for step in one_f_one_b(num_groups, num_micro_batches, group)
        ]
    else:
        steps = list(_interleaved_lists(num_groups, num_chunks, num_micro_batches)[group])
    return overlap_transfers(steps, num_groups * num_chunks) if overlap_p2p else steps


def interleaved_compute(
    num_groups: int, num_chunks: int, num_micro_batches: int, group: int
) -> list[Action]:
    """The forwards and backwards of group ``group``'s interleaved 1F1B list, in order, without
    its transfers: all that the activations it holds depend on (v = 1: the 1F1B list's)."""
    _check_interleaved_args(num_groups, num_chunks, num_micro_batches, group)
    if num_chunks == 1:
        return [
            replace(a, stage=group)
            for step in one_f_one_b(num_groups, num_micro_batches, group)
            for a in _actions_of(step)
            if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD)
        ]
    return [
        a
        for compute in _interleaved_rounds(num_groups, num_chunks, num_micro_batches, group)
        for a in compute
    ]


def _with_stage(step: Step, stage: int) -> Step:
    if isinstance(step, Action):
        return replace(step, stage=stage)
    if not isinstance(step, P2PBatch):  # 1F1B lists post and wait in batches only
        raise TypeError(f"cannot set the stage of a {type(step).__name__} step")
    return P2PBatch(tuple(replace(a, stage=stage) for a in step.actions))


# A receive before its sender is known: (kind, sending group).
_Pending = tuple[ActionKind, int]


def _interleaved_rounds(p: int, v: int, m: int, group: int) -> list[list[Action]]:
    """Group ``group``'s compute, split at its exchanges: warm-up [F], steady [F, B], then
    cool-down [B]; an exchange sits before each round and after the last."""
    forwards = [
        Action(ActionKind.FORWARD, mb, stage=c * p + group)
        for c, mb in interleaved_order(p, v, m, True)
    ]
    backwards = [
        Action(ActionKind.BACKWARD, mb, stage=c * p + group)
        for c, mb in interleaved_order(p, v, m, False)
    ]
    warmup = interleaved_warmup(p, v, m, group)
    steady = m * v - warmup
    return (
        [[f] for f in forwards[:warmup]]
        + [[forwards[warmup + j], backwards[j]] for j in range(steady)]
        + [[b] for b in backwards[steady:]]
    )


def _sends(p: int, n: int, compute: list[Action]) -> tuple[list[Action], list[Action]]:
    """The sends of ``compute``'s outputs: (forward-going, backward-going)."""
    forward, backward = [], []
    for a in compute:
        s = a.stage
        assert s is not None
        if a.kind is ActionKind.FORWARD and s < n - 1:
            forward.append(Action(ActionKind.SEND_FORWARD, a.micro_batch, s + 1, s))
        if a.kind is ActionKind.BACKWARD and s > 0:
            backward.append(Action(ActionKind.SEND_BACKWARD, a.micro_batch, s - 1, s))
    return forward, backward


def _wraps(p: int, n: int, a: Action) -> bool:
    """Whether ``a``'s input crosses from the last group back to the first (forward) or from
    the first to the last (backward): a receive posted when its sender sends."""
    s = a.stage
    assert s is not None
    if a.kind is ActionKind.FORWARD:
        return s > 0 and s % p == 0
    return s < n - 1 and s % p == p - 1


def _group_skeleton(p: int, v: int, m: int, group: int) -> list[Action | list[Action | _Pending]]:
    """Group ``group``'s compute actions and exchanges (lists of transfers whose receives are
    still pending), in order: an exchange before each round and after the last. An exchange
    holds the sends of the round before it and the receives of the round after it, except on
    the wrap-around channels (last group -> first group forward, first -> last backward): as in
    Megatron-LM, the first group takes the output of the last group's forward ``j`` in the
    exchange after its own forward ``j + p - 1``, when the two run at the same time, and holds
    it until its chunk needs it (the last group likewise for backward ``j``). Forward-going
    transfers come first in every exchange, so a pair of groups exchanging both ways (p = 2)
    posts its messages in the same order at either end."""
    n = v * p
    rounds = _interleaved_rounds(p, v, m, group)
    forward: list[list[Action | _Pending]] = [[] for _ in range(len(rounds) + 1)]
    backward: list[list[Action | _Pending]] = [[] for _ in range(len(rounds) + 1)]
    for i, compute in enumerate(rounds):
        sent_forward, sent_backward = _sends(p, n, compute)
        forward[i + 1] += sent_forward
        backward[i + 1] += sent_backward
    for i, compute in enumerate(rounds):
        for a in compute:
            s = a.stage
            assert s is not None
            if a.kind is ActionKind.FORWARD and s > 0 and not _wraps(p, n, a):
                forward[i].append((ActionKind.RECV_FORWARD, (s - 1) % p))
            if a.kind is ActionKind.BACKWARD and s < n - 1 and not _wraps(p, n, a):
                backward[i].append((ActionKind.RECV_BACKWARD, (s + 1) % p))
    if group == 0:  # the last group's forward j is received after this group's j + p - 1
        for j, (chunk, _) in enumerate(interleaved_order(p, v, m, True)):
            if chunk < v - 1:
                forward[j + p].append((ActionKind.RECV_FORWARD, p - 1))
    if group == p - 1:  # the first group's backward j, after this group's backward j + p - 1
        warmup = interleaved_warmup(p, v, m, group)
        for j, (chunk, _) in enumerate(interleaved_order(p, v, m, False)):
            if chunk > 0:
                backward[warmup + j + p].append((ActionKind.RECV_BACKWARD, 0))
    seq: list[Action | list[Action | _Pending]] = [forward[0] + backward[0]]
    for i, compute in enumerate(rounds):
        seq += compute
        seq.append(forward[i + 1] + backward[i + 1])
    return seq


@functools.lru_cache(maxsize=32)
def _interleaved_lists(p: int, v: int, m: int) -> tuple[tuple[Step, ...], ...]:
    """Every group's list: the skeletons, with each channel's k-th receive filled in with the
    k-th send on it (messages on a channel arrive in send order)."""
    skeletons = [_group_skeleton(p, v, m, g) for g in range(p)]
    sends: dict[tuple[int, int, ActionKind], list[Action]] = defaultdict(list)
    for g, seq in enumerate(skeletons):
        for part in seq:
            for a in part if isinstance(part, list) else ():
                if isinstance(a, Action):  # channel: (sender, receiver, receive kind)
                    assert a.peer_stage is not None  # a send names its receiver
                    sends[(g, a.peer_stage % p, _RECV_OF[a.kind])].append(a)
    queues = {channel: iter(queue) for channel, queue in sends.items()}
    lists = []
    for g, seq in enumerate(skeletons):
        steps: list[Step] = []
        for part in seq:
            if isinstance(part, Action):
                steps.append(part)
                continue
            transfers = [
                a if isinstance(a, Action) else _received(a[0], next(queues[(a[1], g, a[0])]))
                for a in part
            ]
            steps += _batched(transfers)
        lists.append(tuple(steps))
    assert all(next(queue, None) is None for queue in queues.values()), "a send is not received"
    return tuple(lists)


def _received(kind: ActionKind, send: Action) -> Action:
    """The receive that takes ``send``."""
    assert send.stage is not None and send.peer_stage is not None
    return Action(kind, send.micro_batch, peer_stage=send.stage, stage=send.peer_stage)


def sequential_forward(
    num_groups: int, num_chunks: int, num_micro_batches: int, group: int
) -> list[Step]:
    """Forward only (evaluation) on group ``group``: the micro-batches in order, each through
    the group's stages in order (receive, forward, send); every action names its stage. Sound
    under :func:`check_schedule` with ``forward_only=True``."""
    _check_interleaved_args(num_groups, num_chunks, num_groups, group)
    if num_micro_batches < 1:
        raise ValueError(f"need num_micro_batches >= 1, got {num_micro_batches}")
    n = num_groups * num_chunks
    steps: list[Step] = []
    for mb in range(num_micro_batches):
        for s in range(group, n, num_groups):
            if s > 0:
                steps.append(Action(ActionKind.RECV_FORWARD, mb, s - 1, s))
            steps.append(Action(ActionKind.FORWARD, mb, stage=s))
            if s < n - 1:
                steps.append(Action(ActionKind.SEND_FORWARD, mb, s + 1, s))
    return steps


SCHEDULES: dict[str, ScheduleFn] = {"1f1b": one_f_one_b, "gpipe": gpipe}


def build_schedule(
    name: str,
    num_stages: int,
    num_micro_batches: int,
    num_chunks: int = 1,
    overlap_p2p: bool = False,
) -> list[list[Step]]:
    """Every list of the schedule called ``name`` (see SCHEDULES): one per stage, or with
    ``num_chunks > 1`` ("1f1b" only) the interleaved lists of ``num_stages`` device groups.
    ``overlap_p2p`` (interleaved lists only, as Megatron-LM): transfers overlapped with compute
    (:func:`overlap_transfers`)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if num_chunks < 1:
        raise ValueError(f"need num_chunks >= 1, got {num_chunks}")
    if num_chunks == 1:
        return [SCHEDULES[name](num_stages, num_micro_batches, s) for s in range(num_stages)]
    if name != "1f1b":
        raise ValueError(
            f"schedule {name!r} does not interleave; {num_chunks} chunks per "
            f"device group need '1f1b'"
        )
    return [
        interleaved_one_f_one_b(num_stages, num_chunks, num_micro_batches, g, overlap_p2p)
        for g in range(num_stages)
    ]


__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "P2PBatch",
    "P2PPost",
    "P2PWait",
    "ScheduleError",
    "ScheduleReport",
    "Step",
    "build_schedule",
    "check_schedule",
    "gpipe",
    "interleaved_compute",
    "interleaved_group_size",
    "interleaved_micro_batch_counts_ok",
    "interleaved_one_f_one_b",
    "interleaved_order",
    "interleaved_warmup",
    "one_f_one_b",
    "overlap_transfers",
    "peak_activation",
    "sequential_forward",
]
