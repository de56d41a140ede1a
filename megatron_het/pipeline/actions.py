"""The instructions of pipeline schedules: compute and point-to-point transfer actions.

See :mod:`megatron_het.pipeline.schedules` for how lists of them make a schedule and
:mod:`megatron_het.pipeline.schedule_check` for the process-free proof that one is sound.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class ActionKind(enum.Enum):
    RECV_FORWARD = "recv_forward"  # activations of mb from stage - 1
    FORWARD = "forward"
    SEND_FORWARD = "send_forward"  # activations of mb to stage + 1
    RECV_BACKWARD = "recv_backward"  # output gradients of mb from stage + 1
    BACKWARD = "backward"
    SEND_BACKWARD = "send_backward"  # input gradients of mb to stage - 1


_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD)
_SENDS = (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD)
# The direction each transfer kind goes: peer_stage - stage.
_PEER_OFFSET = {
    ActionKind.RECV_FORWARD: -1,
    ActionKind.SEND_FORWARD: +1,
    ActionKind.RECV_BACKWARD: +1,
    ActionKind.SEND_BACKWARD: -1,
}
# The receive that takes each send, and the compute a send carries the result of.
_RECV_OF = {
    ActionKind.SEND_FORWARD: ActionKind.RECV_FORWARD,
    ActionKind.SEND_BACKWARD: ActionKind.RECV_BACKWARD,
}
_COMPUTE_OF = {
    ActionKind.SEND_FORWARD: ActionKind.FORWARD,
    ActionKind.SEND_BACKWARD: ActionKind.BACKWARD,
}


@dataclass(frozen=True)
class Action:
    """One instruction; ``peer_stage`` is set for transfers and None for compute; ``stage`` is
    the global stage it belongs to (None: the list's own stage)."""

    kind: ActionKind
    micro_batch: int
    peer_stage: int | None = None
    stage: int | None = None

    def __str__(self) -> str:
        own = "" if self.stage is None else f" stage {self.stage}"
        if self.peer_stage is None:
            return f"{self.kind.name}{own} mb {self.micro_batch}"
        arrow = "->" if self.kind in _SENDS else "<-"
        return f"{self.kind.name}{own} mb {self.micro_batch} {arrow} stage {self.peer_stage}"


@dataclass(frozen=True)
class P2PBatch:
    """Transfers posted together; the step ends when all of them have completed."""

    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return "[" + " + ".join(map(str, self.actions)) + "]"


@dataclass(frozen=True)
class P2PPost:
    """Transfers posted together without waiting: the list goes on at once (its compute then
    overlaps them), and a later :class:`P2PWait` with the same ``actions`` waits for them."""

    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return "post [" + " + ".join(map(str, self.actions)) + "]"


@dataclass(frozen=True)
class P2PWait:
    """Wait until the transfers of the earlier :class:`P2PPost` with these ``actions`` have
    completed (a received tensor is usable, a sent one free, only after it)."""

    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return "wait [" + " + ".join(map(str, self.actions)) + "]"


Step = Action | P2PBatch | P2PPost | P2PWait


class ScheduleError(Exception):
    """A schedule that would deadlock, mismatch transfers or skip or repeat work (a bug)."""


def _batched(transfers: list[Action]) -> Sequence[Step]:
    return [P2PBatch(tuple(transfers))] if len(transfers) > 1 else transfers


def _actions_of(step: Step) -> tuple[Action, ...]:
    """The actions a step starts (a wait starts none: its transfers were posted before)."""
    if isinstance(step, (P2PBatch, P2PPost)):
        return step.actions
    return () if isinstance(step, P2PWait) else (step,)
