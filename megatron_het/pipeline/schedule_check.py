"""A process-free proof that pipeline schedules are sound, and their activation peaks.

:func:`check_schedule` runs all lists of a schedule (:mod:`megatron_het.pipeline.schedules`)
against each other with rendezvous semantics (a transfer completes only when the peer posts
the matching one), which is stricter than buffered sends: a schedule it accepts cannot deadlock
on a real backend either. Transfers travel on channels (sender list, receiver list, direction)
and arrive in send order on each. Two stricter models of a device backend can be asked for:
``untagged`` (messages between two lists match in posting order whatever their direction, as
NCCL matches them without tags) and ``in_order`` (a list's posted steps complete in posting
order, as coalesced groups on one communication stream do).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from megatron_het.pipeline.actions import (
    _COMPUTE,
    _COMPUTE_OF,
    _PEER_OFFSET,
    _RECV_OF,
    _SENDS,
    Action,
    ActionKind,
    P2PBatch,
    P2PPost,
    P2PWait,
    ScheduleError,
    Step,
    _actions_of,
)


@dataclass(frozen=True)
class ScheduleReport:
    """What :func:`check_schedule` measured: ``num_stages`` global stages; ``peak_in_flight[g]``:
    the most (stage, micro-batch) pairs list ``g`` holds activations for at once (forwarded,
    not yet backwarded)."""

    num_stages: int
    num_micro_batches: int
    peak_in_flight: tuple[int, ...]


def check_schedule(
    per_group_actions: Sequence[Sequence[Step]],
    num_micro_batches: int | None = None,
    num_stages: int | None = None,
    *,
    forward_only: bool = False,
    untagged: bool = False,
    in_order: bool = False,
) -> ScheduleReport:
    """Prove that the lists, run together, finish and do the right work.

    ``num_stages``: the global stages n (default: one per list); stage ``s`` runs on list
    ``s % len(lists)``. Simulates all lists without processes: compute runs at once; a transfer
    (or P2PBatch) blocks until the peer's current step posts the matching transfer on the same
    channel (sender list, receiver list, direction). Raises ScheduleError on a deadlock (naming
    where each list waits), on a send matched by a receive of another micro-batch or stage, on
    a transfer or compute whose data is not there yet, on an action of a stage the list does not
    run or with the wrong peer, and unless every stage forwards (and, unless ``forward_only``,
    backwards) each micro-batch ``0..num_micro_batches-1`` exactly once (``num_micro_batches``
    defaults to one more than the largest seen). A :class:`P2PPost` goes on at once and its
    :class:`P2PWait` blocks until its transfers have matched; data a post receives is usable
    only after the wait, and every post must be waited on. ``untagged`` and ``in_order``: the
    stricter backend models of the module docstring.
    """
    num_lists = len(per_group_actions)
    if num_lists == 0:
        raise ScheduleError("a schedule needs at least one stage")
    n = num_lists if num_stages is None else num_stages
    if n < num_lists or n % num_lists or (n > num_lists and num_lists < 2):
        raise ValueError(
            f"{n} stages cannot run round-robin on {num_lists} lists: need a "
            f"multiple of the list count, and at least 2 lists to interleave"
        )
    runs = [_ListRun(g, num_lists, n, steps, in_order) for g, steps in enumerate(per_group_actions)]
    while not all(run.done for run in runs):
        moved = False
        for run in runs:
            moved |= run.advance()
        moved |= _match_transfers(runs, untagged)
        if not moved:
            label = runs[0].label
            waiting = "; ".join(
                f"{label} {r.index} at step {r.pc} {r.steps[r.pc]}" for r in runs if not r.done
            )
            raise ScheduleError(f"deadlock: no {label} can move ({waiting})")
    seen = [
        a.micro_batch for steps in per_group_actions for step in steps for a in _actions_of(step)
    ]
    if num_micro_batches is None:
        num_micro_batches = max(seen, default=-1) + 1
    for run in runs:
        run.check_complete(num_micro_batches, forward_only)
    return ScheduleReport(n, num_micro_batches, tuple(run.peak_in_flight for run in runs))


def peak_activation(
    steps: Sequence[Step], weight_of_stage: Callable[[int], float], own_stage: int = 0
) -> float:
    """The most activation weight one list holds at once: a forward of stage ``s`` adds
    ``weight_of_stage(s)``, its backward removes it (``own_stage``: the stage of actions with
    stage None). E.g. bytes per chunk, for memory with non-uniform chunks."""
    held = peak = 0.0
    for step in steps:
        for a in _actions_of(step):
            if a.kind in _COMPUTE:
                weight = weight_of_stage(own_stage if a.stage is None else a.stage)
                held += weight if a.kind is ActionKind.FORWARD else -weight
                peak = max(peak, held)
    return peak


def held_counts(
    steps: Sequence[Step], own_stage: int = 0
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The in-flight pairs one list can peak at, as ``((stage, count), ...)`` vectors: the
    counts after each forward, duplicates and vectors another one covers in every stage
    dropped. :func:`peak_activation` for any non-negative weights is the largest weighted sum
    over these (a list's steps are walked once; a planner then prices many chunk sizes)."""
    held: dict[int, int] = defaultdict(int)
    seen: set[tuple[tuple[int, int], ...]] = set()
    rising = False  # the last compute was a forward: the counts are at a local peak
    for step in steps:
        for a in _actions_of(step):
            if a.kind not in _COMPUTE:
                continue
            if a.kind is ActionKind.BACKWARD and rising:  # a later forward only adds
                seen.add(tuple(sorted((k, n) for k, n in held.items() if n)))
            stage = own_stage if a.stage is None else a.stage
            rising = a.kind is ActionKind.FORWARD
            held[stage] += 1 if rising else -1
    if rising:
        seen.add(tuple(sorted((k, n) for k, n in held.items() if n)))
    vectors = [dict(v) for v in seen]
    kept = [
        v
        for i, v in enumerate(vectors)
        if not any(j != i and _covers(w, v) and (w != v) for j, w in enumerate(vectors))
    ]
    return tuple(sorted(tuple(sorted(v.items())) for v in kept))


def _covers(big: dict[int, int], small: dict[int, int]) -> bool:
    return all(big.get(k, 0) >= n for k, n in small.items())


class _Posted:
    """Transfers posted together, and those of them not matched yet."""

    def __init__(self, actions: tuple[Action, ...]) -> None:
        self.actions = actions
        self.unmatched = list(actions)

    @property
    def complete(self) -> bool:
        return not self.unmatched


class _ListRun:
    """The state of one list (a stage, or a device group's stages) in :func:`check_schedule`."""

    def __init__(
        self, index: int, num_lists: int, num_stages: int, steps: Sequence[Step], in_order: bool
    ) -> None:
        self.index, self.num_lists, self.num_stages = index, num_lists, num_stages
        self.steps = list(steps)
        self.in_order = in_order
        self.interleaved = num_stages != num_lists
        self.label = "group" if self.interleaved else "stage"
        self.pc = 0
        self.outstanding: list[_Posted] = []  # posted, not waited on, in posting order
        self.blocking: _Posted | None = None  # the blocking step posted at pc
        self.done_work: dict[tuple[ActionKind, int], set[int]] = defaultdict(set)
        self.in_flight = self.peak_in_flight = 0
        for i, step in enumerate(self.steps):
            self._check_step_shape(i, step)

    @property
    def done(self) -> bool:
        return self.pc >= len(self.steps)

    def stage_of(self, a: Action) -> int:
        return self.index if a.stage is None else a.stage

    def _what(self, a: Action) -> str:
        stage = f" of stage {self.stage_of(a)}" if self.interleaved else ""
        return f"micro-batch {a.micro_batch}{stage}"

    def _fail(self, message: str) -> NoReturn:
        where = self.steps[self.pc] if not self.done else "end"
        raise ScheduleError(f"{self.label} {self.index} step {self.pc} ({where}): {message}")

    def _check_step_shape(self, i: int, step: Step) -> None:
        actions = step.actions if isinstance(step, P2PWait) else _actions_of(step)
        where = f"{self.label} {self.index} step {i} ({step})"
        if isinstance(step, (P2PBatch, P2PPost, P2PWait)) and (
            not actions or any(a.kind in _COMPUTE for a in actions)
        ):
            raise ScheduleError(
                f"{where}: a {type(step).__name__} holds one or more transfers, no compute"
            )
        n = self.num_stages
        for a in actions:
            if a.stage is None and self.interleaved:
                raise ScheduleError(
                    f"{where}: a list running several stages must name the stage of every action"
                )
            s = self.stage_of(a)
            if not 0 <= s < n or s % self.num_lists != self.index:
                hint = "; interleaved lists need num_stages" if s >= n == self.num_lists else ""
                raise ScheduleError(
                    f"{where}: stage {s} does not run on {self.label} "
                    f"{self.index} (stage s runs on list s % {self.num_lists} "
                    f"of {n} stages{hint})"
                )
            want = None if a.kind in _COMPUTE else s + _PEER_OFFSET[a.kind]
            if a.peer_stage != want or (want is not None and not 0 <= want < n):
                raise ScheduleError(
                    f"{where}: {a.kind.name} must have peer_stage {want} on stage {s} of {n}"
                )

    def eligible(self, posted: _Posted) -> bool:
        """Whether ``posted``'s transfers can progress: always, or with ``in_order`` once
        every earlier post of this list has completed."""
        if not self.in_order:
            return True
        for earlier in self.outstanding:
            if earlier is posted:
                return True
            if not earlier.complete:
                return False
        return True

    def advance(self) -> bool:
        """Run compute and posts until a step must wait; take finished waits. True if
        anything happened."""
        moved = False
        while not self.done:
            step = self.steps[self.pc]
            if isinstance(step, Action) and step.kind in _COMPUTE:
                self._compute(step)
            elif isinstance(step, P2PPost):
                self._post(step.actions)
            elif isinstance(step, P2PWait):
                posted = next((p for p in self.outstanding if p.actions == step.actions), None)
                if posted is None:
                    self._fail("waits for transfers that are not posted (or waited on already)")
                if not posted.complete:
                    return moved
                self._take(posted)
            else:  # a blocking transfer: post it once, then wait for it
                if self.blocking is None:
                    self.blocking = self._post(_actions_of(step))
                    moved = True
                if not self.blocking.complete:
                    return moved
                self._take(self.blocking)
                self.blocking = None
            self.pc += 1
            moved = True
        if self.outstanding:
            self._fail(f"posts transfers it never waits for: {self.outstanding[0].actions[0]}")
        return moved

    def _post(self, actions: tuple[Action, ...]) -> _Posted:
        for a in actions:
            self._check_send_ready(a)
        posted = _Posted(actions)
        self.outstanding.append(posted)
        return posted

    def _take(self, posted: _Posted) -> None:
        """A wait on a complete post: its received data is usable from now on."""
        self.outstanding.remove(posted)
        for a in posted.actions:
            key = (a.kind, self.stage_of(a))
            if a.micro_batch in self.done_work[key]:
                self._fail(f"{a.kind.value} of {self._what(a)} happens twice")
            self.done_work[key].add(a.micro_batch)

    def _compute(self, a: Action) -> None:
        s, mb, done = self.stage_of(a), a.micro_batch, self.done_work
        if mb in done[(a.kind, s)]:
            self._fail(f"{self._what(a)} is {a.kind.value}ed twice")
        if a.kind is ActionKind.FORWARD:
            if s > 0 and mb not in done[(ActionKind.RECV_FORWARD, s)]:
                self._fail(f"the input of {self._what(a)} has not been received")
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        else:
            if mb not in done[(ActionKind.FORWARD, s)]:
                self._fail(f"{self._what(a)} has not been forwarded here")
            if s < self.num_stages - 1 and mb not in done[(ActionKind.RECV_BACKWARD, s)]:
                self._fail(f"the output gradient of {self._what(a)} has not been received")
            self.in_flight -= 1
        done[(a.kind, s)].add(mb)

    def _check_send_ready(self, a: Action) -> None:
        needs = _COMPUTE_OF.get(a.kind)
        if needs is not None and a.micro_batch not in self.done_work[(needs, self.stage_of(a))]:
            self._fail(f"sends {self._what(a)} before its {needs.value} ran here")

    def first_unmatched(self, accept: Callable[[Action], bool]) -> tuple[_Posted, Action] | None:
        """The earliest unmatched transfer (in posting order) that ``accept`` takes."""
        for posted in self.outstanding:
            for a in posted.unmatched:
                if accept(a):
                    return posted, a
        return None

    def check_complete(self, num_micro_batches: int, forward_only: bool) -> None:
        expected = set(range(num_micro_batches))
        for s in range(self.index, self.num_stages, self.num_lists):
            for kind in _COMPUTE[:1] if forward_only else _COMPUTE:
                got = self.done_work[(kind, s)]
                if got == expected:
                    continue
                what = f"{kind.value} of stage {s}" if self.interleaved else kind.value
                raise ScheduleError(
                    f"{self.label} {self.index} runs {what} on micro-batches {sorted(got)}; "
                    f"every stage must run it once on each of 0..{num_micro_batches - 1}"
                )


def _match_transfers(runs: list[_ListRun], untagged: bool) -> bool:
    """Pair the first unmatched send of every channel with the receiver's first unmatched
    receive on it (a channel: sender, receiver and, unless ``untagged``, the direction)."""
    moved = False
    num_lists = len(runs)
    for sender in runs:
        channels: set[tuple[int, ActionKind | None]] = set()
        for posted in list(sender.outstanding):
            for send in [a for a in posted.unmatched if a.kind in _SENDS]:
                assert send.peer_stage is not None
                to = send.peer_stage % num_lists
                channel = (to, None if untagged else send.kind)
                if channel in channels:
                    continue  # an earlier send on this channel is still unmatched
                channels.add(channel)
                receiver = runs[to]
                kinds = (
                    (ActionKind.RECV_FORWARD, ActionKind.RECV_BACKWARD)
                    if untagged
                    else (_RECV_OF[send.kind],)
                )
                found = receiver.first_unmatched(
                    lambda a: (
                        a.kind in kinds
                        and a.peer_stage is not None
                        and a.peer_stage % num_lists == sender.index
                    )
                )
                if found is None or not (sender.eligible(posted) and receiver.eligible(found[0])):
                    continue
                taken, recv = found
                if (
                    recv.kind is not _RECV_OF[send.kind]
                    or recv.micro_batch != send.micro_batch
                    or receiver.stage_of(recv) != send.peer_stage
                ):
                    label = sender.label
                    raise ScheduleError(
                        f"{label} {sender.index} step {sender.pc} sends {send} while {label} "
                        f"{receiver.index} step {receiver.pc} expects {recv}: transfers between "
                        f"two {label}s must come in the same order on both sides"
                    )
                posted.unmatched.remove(send)
                taken.unmatched.remove(recv)
                channels.discard(channel)  # the next send on it may match too
                moved = True
    return moved
