"""Pipeline schedules written as data, and a process-free check that they are sound.

A schedule for one stage is a list of steps run in order by an executor (written separately):

- ``Action(FORWARD | BACKWARD, mb)``: compute on micro-batch ``mb`` at this stage;
- ``Action(SEND_* | RECV_*, mb, peer_stage)``: one blocking point-to-point transfer of the
  activations (forward) or of their gradients (backward) of ``mb`` with ``peer_stage``;
- ``P2PBatch(actions)``: transfers posted together and waited on together (the executor issues
  them as one batched isend/irecv), e.g. SEND_FORWARD + RECV_BACKWARD in the 1F1B steady state.

:func:`check_schedule` runs all stages' lists against each other with rendezvous semantics (a
transfer completes only when the peer posts the matching one), which is stricter than buffered
sends: a schedule it accepts cannot deadlock on a real backend either.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union


class ActionKind(enum.Enum):
    RECV_FORWARD = "recv_forward"      # activations of mb from stage - 1
    FORWARD = "forward"
    SEND_FORWARD = "send_forward"      # activations of mb to stage + 1
    RECV_BACKWARD = "recv_backward"    # output gradients of mb from stage + 1
    BACKWARD = "backward"
    SEND_BACKWARD = "send_backward"    # input gradients of mb to stage - 1


_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD)
_SENDS = (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD)
# The direction each transfer kind goes: peer_stage - stage.
_PEER_OFFSET = {ActionKind.RECV_FORWARD: -1, ActionKind.SEND_FORWARD: +1,
                ActionKind.RECV_BACKWARD: +1, ActionKind.SEND_BACKWARD: -1}


@dataclass(frozen=True)
class Action:
    """One instruction; ``peer_stage`` is set for transfers and None for compute."""

    kind: ActionKind
    micro_batch: int
    peer_stage: Optional[int] = None

    def __str__(self) -> str:
        if self.peer_stage is None:
            return f"{self.kind.name} mb {self.micro_batch}"
        arrow = "->" if self.kind in _SENDS else "<-"
        return f"{self.kind.name} mb {self.micro_batch} {arrow} stage {self.peer_stage}"


@dataclass(frozen=True)
class P2PBatch:
    """Transfers posted together; the step ends when all of them have completed."""

    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return "[" + " + ".join(map(str, self.actions)) + "]"


Step = Union[Action, P2PBatch]
ScheduleFn = Callable[[int, int, int], list[Step]]


class ScheduleError(Exception):
    """A schedule that would deadlock, mismatch transfers or skip or repeat work (a bug)."""


@dataclass(frozen=True)
class ScheduleReport:
    """What :func:`check_schedule` measured. ``peak_in_flight[s]``: the most micro-batches
    stage ``s`` holds activations for at once (forwarded, not yet backwarded)."""

    num_stages: int
    num_micro_batches: int
    peak_in_flight: tuple[int, ...]


def _check_args(num_stages: int, num_micro_batches: int, stage: int) -> None:
    if num_stages < 1 or num_micro_batches < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"need num_stages >= 1, num_micro_batches >= 1 and 0 <= stage < "
                         f"num_stages; got {num_stages}, {num_micro_batches}, {stage}")


def _recv_forward(stage: int, mb: int) -> list[Step]:
    return [] if stage == 0 else [Action(ActionKind.RECV_FORWARD, mb, stage - 1)]


def _send_forward(stage: int, num_stages: int, mb: int) -> list[Step]:
    return [] if stage == num_stages - 1 else [Action(ActionKind.SEND_FORWARD, mb, stage + 1)]


def _recv_backward(stage: int, num_stages: int, mb: int) -> list[Step]:
    return [] if stage == num_stages - 1 else [Action(ActionKind.RECV_BACKWARD, mb, stage + 1)]


def _send_backward(stage: int, mb: int) -> list[Step]:
    return [] if stage == 0 else [Action(ActionKind.SEND_BACKWARD, mb, stage - 1)]


def _batched(steps: list[Step]) -> list[Step]:
    return [P2PBatch(tuple(steps))] if len(steps) > 1 else steps


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
        steps += _batched(_send_forward(stage, num_stages, fwd_mb)
                          + _recv_backward(stage, num_stages, bwd_mb))
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


SCHEDULES: dict[str, ScheduleFn] = {"1f1b": one_f_one_b, "gpipe": gpipe}


def build_schedule(name: str, num_stages: int, num_micro_batches: int) -> list[list[Step]]:
    """Every stage's list for the schedule called ``name`` (see SCHEDULES)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return [SCHEDULES[name](num_stages, num_micro_batches, s) for s in range(num_stages)]


def check_schedule(per_stage_actions: Sequence[Sequence[Step]],
                   num_micro_batches: Optional[int] = None) -> ScheduleReport:
    """Prove that the stages' lists, run together, finish and do the right work.

    Simulates all stages without processes: compute runs at once; a transfer (or P2PBatch)
    blocks until the peer's current step posts the matching transfer on the same channel.
    Raises ScheduleError on a deadlock (naming where each stage waits), on a send matched by a
    receive of another micro-batch, on a transfer or compute whose data is not there yet, and
    unless every stage forwards and backwards each micro-batch ``0..num_micro_batches-1``
    exactly once (``num_micro_batches`` defaults to one more than the largest seen).
    """
    num_stages = len(per_stage_actions)
    if num_stages == 0:
        raise ScheduleError("a schedule needs at least one stage")
    stages = [_StageRun(s, num_stages, steps) for s, steps in enumerate(per_stage_actions)]
    while not all(run.done for run in stages):
        moved = False
        for run in stages:
            moved |= run.run_until_transfer()
        moved |= _match_transfers(stages)
        for run in stages:
            moved |= run.finish_step_if_matched()
        if not moved:
            waiting = "; ".join(f"stage {r.stage} at step {r.pc} {r.steps[r.pc]}"
                                for r in stages if not r.done)
            raise ScheduleError(f"deadlock: no stage can move ({waiting})")
    seen = [a.micro_batch for steps in per_stage_actions for step in steps
            for a in _actions_of(step)]
    if num_micro_batches is None:
        num_micro_batches = max(seen, default=-1) + 1
    for run in stages:
        run.check_complete(num_micro_batches)
    return ScheduleReport(num_stages, num_micro_batches,
                          tuple(run.peak_in_flight for run in stages))


def _actions_of(step: Step) -> tuple[Action, ...]:
    return step.actions if isinstance(step, P2PBatch) else (step,)


class _StageRun:
    """The state of one stage in :func:`check_schedule`'s simulation."""

    def __init__(self, stage: int, num_stages: int, steps: Sequence[Step]) -> None:
        self.stage, self.num_stages, self.steps = stage, num_stages, list(steps)
        self.pc = 0
        self.pending: list[Action] = []   # unmatched transfers of the posted step
        self.posted = False
        self.done_work: dict[ActionKind, set[int]] = {kind: set() for kind in ActionKind}
        self.in_flight = self.peak_in_flight = 0
        for index, step in enumerate(self.steps):
            self._check_step_shape(index, step)

    @property
    def done(self) -> bool:
        return self.pc >= len(self.steps)

    def _fail(self, message: str) -> None:
        raise ScheduleError(f"stage {self.stage} step {self.pc} ({self.steps[self.pc]}): "
                            f"{message}")

    def _check_step_shape(self, index: int, step: Step) -> None:
        actions = _actions_of(step)
        where = f"stage {self.stage} step {index} ({step})"
        if isinstance(step, P2PBatch) and (not actions or any(
                a.kind in _COMPUTE for a in actions)):
            raise ScheduleError(f"{where}: a P2PBatch holds one or more transfers, no compute")
        for a in actions:
            want = None if a.kind in _COMPUTE else self.stage + _PEER_OFFSET[a.kind]
            if a.peer_stage != want or (want is not None and not 0 <= want < self.num_stages):
                raise ScheduleError(f"{where}: {a.kind.name} must have peer_stage {want} on "
                                    f"stage {self.stage} of {self.num_stages}")

    def run_until_transfer(self) -> bool:
        """Run compute steps; post the next transfer step. True if anything happened."""
        moved = False
        while not self.done and not self.posted:
            step = self.steps[self.pc]
            if isinstance(step, Action) and step.kind in _COMPUTE:
                self._compute(step)
                self.pc += 1
            else:
                for a in _actions_of(step):
                    self._check_send_ready(a)
                self.pending, self.posted = list(_actions_of(step)), True
            moved = True
        return moved

    def _compute(self, a: Action) -> None:
        mb, done = a.micro_batch, self.done_work
        if mb in done[a.kind]:
            self._fail(f"micro-batch {mb} is {a.kind.value}ed twice")
        if a.kind is ActionKind.FORWARD:
            if self.stage > 0 and mb not in done[ActionKind.RECV_FORWARD]:
                self._fail(f"the input of micro-batch {mb} has not been received")
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        else:
            if mb not in done[ActionKind.FORWARD]:
                self._fail(f"micro-batch {mb} has not been forwarded here")
            if self.stage < self.num_stages - 1 and mb not in done[ActionKind.RECV_BACKWARD]:
                self._fail(f"the output gradient of micro-batch {mb} has not been received")
            self.in_flight -= 1
        done[a.kind].add(mb)

    def _check_send_ready(self, a: Action) -> None:
        needs = {ActionKind.SEND_FORWARD: ActionKind.FORWARD,
                 ActionKind.SEND_BACKWARD: ActionKind.BACKWARD}.get(a.kind)
        if needs is not None and a.micro_batch not in self.done_work[needs]:
            self._fail(f"sends micro-batch {a.micro_batch} before its {needs.value} ran here")

    def complete(self, a: Action) -> None:
        if a.micro_batch in self.done_work[a.kind]:
            self._fail(f"{a.kind.value} of micro-batch {a.micro_batch} happens twice")
        self.done_work[a.kind].add(a.micro_batch)
        self.pending.remove(a)

    def finish_step_if_matched(self) -> bool:
        if self.posted and not self.pending:
            self.pc, self.posted = self.pc + 1, False
            return True
        return False

    def check_complete(self, num_micro_batches: int) -> None:
        expected = set(range(num_micro_batches))
        for kind in _COMPUTE:
            got = self.done_work[kind]
            if got != expected:
                raise ScheduleError(
                    f"stage {self.stage} runs {kind.value} on micro-batches {sorted(got)}; "
                    f"every stage must run it once on each of 0..{num_micro_batches - 1}")


def _match_transfers(stages: list[_StageRun]) -> bool:
    """Pair posted sends with the peer's posted receives, channel by channel, in order."""
    moved = False
    for sender in stages:
        if not sender.posted:
            continue
        for send in [a for a in sender.pending if a.kind in _SENDS]:
            receiver = stages[send.peer_stage]
            recvs = [a for a in receiver.pending
                     if a.kind not in _SENDS and a.peer_stage == sender.stage]
            if not receiver.posted or not recvs:
                continue
            recv = recvs[0]
            if recv.micro_batch != send.micro_batch:
                raise ScheduleError(
                    f"stage {sender.stage} step {sender.pc} sends {send} while stage "
                    f"{receiver.stage} step {receiver.pc} expects {recv}: transfers between two "
                    f"stages must come in the same order on both sides")
            sender.complete(send)
            receiver.complete(recv)
            moved = True
    return moved
