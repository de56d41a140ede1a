"""Stage-boundary transfers overlapped with compute: a schedule's blocking exchanges turned into
posts and waits (Megatron-LM's ``--overlap-p2p-communication`` for interleaved pipelines).

See :func:`overlap_transfers`; :func:`~megatron_het.pipeline.schedule_check.check_schedule`
proves the result sound, under the stricter device-backend models too.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_het.pipeline.actions import (
    _COMPUTE,
    Action,
    ActionKind,
    P2PPost,
    P2PWait,
    Step,
    _actions_of,
)

_FORWARD_TRANSFERS = (ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD)


def _input_of(action: Action, num_stages: int) -> tuple[ActionKind, int, int] | None:
    """The receive (kind, stage, micro-batch) whose data a compute action reads, if any."""
    s, mb = action.stage, action.micro_batch
    assert s is not None  # overlap_transfers takes actions that name their stage
    if action.kind is ActionKind.FORWARD and s != 0:
        return ActionKind.RECV_FORWARD, s, mb
    if action.kind is ActionKind.BACKWARD and s != num_stages - 1:
        return ActionKind.RECV_BACKWARD, s, mb
    return None


def overlap_transfers(steps: Sequence[Step], num_stages: int) -> list[Step]:
    """``steps`` (one list of blocking transfers: Actions and P2PBatches; every action naming
    its stage) with each transfer step split by direction into posts that compute overlaps.

    The activations of an exchange (sends of a forward's output, receives of the next
    forward's input) are posted right after the forward of the round before it, so the
    backward that follows overlaps them; the gradients are posted where the exchange was and
    overlap the next forward. A post is waited on just before the compute that reads what it
    receives, else before the next post of its direction, else at the end. Every post comes no
    later and every wait no earlier than in ``steps``, so a sound blocking list stays sound
    (:func:`check_schedule` proves it); the compute order is unchanged.
    """
    out: list[Step] = []
    unwaited: list[P2PPost] = []
    after_forward: int | None = None  # where a forward of this round ended in ``out``

    def wait(post: P2PPost, at: int) -> int:
        unwaited.remove(post)
        out.insert(at, P2PWait(post.actions))
        return at + 1

    def post(actions: tuple[Action, ...], at: int) -> None:
        forward = actions[0].kind in _FORWARD_TRANSFERS
        for earlier in [
            p for p in unwaited if (p.actions[0].kind in _FORWARD_TRANSFERS) == forward
        ]:
            at = wait(earlier, at)
        item = P2PPost(actions)
        out.insert(at, item)
        unwaited.append(item)

    for step in steps:
        actions = _actions_of(step)
        if isinstance(step, Action) and step.kind in _COMPUTE:
            need = _input_of(step, num_stages)
            for held in [
                p for p in unwaited if need in {(a.kind, a.stage, a.micro_batch) for a in p.actions}
            ]:
                wait(held, len(out))
            out.append(step)
            if step.kind is ActionKind.FORWARD:
                after_forward = len(out)
            continue
        forward = tuple(a for a in actions if a.kind in _FORWARD_TRANSFERS)
        backward = tuple(a for a in actions if a.kind not in _FORWARD_TRANSFERS)
        if forward:
            post(forward, len(out) if after_forward is None else after_forward)
        if backward:
            post(backward, len(out))
        after_forward = None
    for held in list(unwaited):
        wait(held, len(out))
    return out


__all__ = ["overlap_transfers"]
