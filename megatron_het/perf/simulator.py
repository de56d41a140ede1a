"""Event-driven simulation of a pipeline schedule with per-stage compute and per-boundary p2p times.

It executes the per-stage step lists of :mod:`megatron_het.pipeline.schedules` with the same
rendezvous semantics as :func:`~megatron_het.pipeline.schedules.check_schedule` and the executor:
a compute step runs when the stage reaches it; a transfer starts once both sides have posted the
step holding it and lasts that boundary's p2p time; a step (a single transfer or a P2PBatch)
ends when all its transfers have ended, and the stage waits for that (blocking transfers).

:func:`closed_form_1f1b` is the analytic model the simulation checks (see its docstring for the
formula and when it is exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_het.pipeline.schedules import (Action, ActionKind, P2PBatch, ScheduleError, Step,
                                             build_schedule)

_DIRECTION = {  # transfer kind -> (channel, boundary offset from the stage)
    ActionKind.SEND_FORWARD: ("forward", 0), ActionKind.RECV_FORWARD: ("forward", -1),
    ActionKind.SEND_BACKWARD: ("backward", -1), ActionKind.RECV_BACKWARD: ("backward", 0)}


@dataclass(frozen=True)
class TimelineEvent:
    """One step of one stage: ``kind`` is forward, backward or a transfer kind's value."""

    stage: int
    kind: str
    micro_batch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimulationResult:
    """``makespan_s``: when the last stage finishes; ``busy_s[s]``: compute time of stage s;
    ``timeline[s]``: stage s's events in order (empty unless recorded)."""

    makespan_s: float
    stage_end_s: tuple[float, ...]
    busy_s: tuple[float, ...]
    timeline: tuple[tuple[TimelineEvent, ...], ...]


class _Stage:
    __slots__ = ("steps", "pc", "clock", "posted", "waiting", "step_end", "events")

    def __init__(self, steps: Sequence[Step]) -> None:
        self.steps, self.pc, self.clock = steps, 0, 0.0
        self.posted, self.waiting, self.step_end = False, 0, 0.0
        self.events: list[TimelineEvent] = []


def simulate(per_stage_steps: Sequence[Sequence[Step]], forward_s: Sequence[float],
             backward_s: Sequence[float], p2p_forward_s: Optional[Sequence[float]] = None,
             p2p_backward_s: Optional[Sequence[float]] = None,
             record_timeline: bool = True) -> SimulationResult:
    """Run the stages' step lists; ``forward_s[s]`` / ``backward_s[s]`` is stage s's compute
    per micro-batch, ``p2p_*_s[b]`` the transfer time over boundary b (stage b to b + 1) in
    each direction (default 0). Raises ScheduleError on a deadlock."""
    p = len(per_stage_steps)
    durations = {"forward": list(p2p_forward_s or [0.0] * (p - 1)),
                 "backward": list(p2p_backward_s or [0.0] * (p - 1))}
    compute = {ActionKind.FORWARD: forward_s, ActionKind.BACKWARD: backward_s}
    stages = [_Stage(steps) for steps in per_stage_steps]
    posted: dict[tuple[str, int, int], tuple[int, float]] = {}
    busy = [0.0] * p
    progress = True
    while progress:
        progress = False
        for s, st in enumerate(stages):
            while st.pc < len(st.steps):
                if st.posted:
                    if st.waiting:
                        break
                    st.clock, st.posted = st.step_end, False
                    st.pc += 1
                    progress = True
                    continue
                step = st.steps[st.pc]
                if isinstance(step, Action) and step.kind in compute:
                    duration = compute[step.kind][s]
                    if record_timeline:
                        st.events.append(TimelineEvent(s, step.kind.value, step.micro_batch,
                                                       st.clock, st.clock + duration))
                    st.clock += duration
                    busy[s] += duration
                    st.pc += 1
                else:
                    _post(s, step, stages, posted, durations, record_timeline)
                progress = True
    stuck = [f"stage {s} at step {st.pc}" for s, st in enumerate(stages) if st.pc < len(st.steps)]
    if stuck:
        raise ScheduleError(f"deadlock in simulation: {', '.join(stuck)}")
    ends = tuple(st.clock for st in stages)
    return SimulationResult(max(ends), ends, tuple(busy),
                            tuple(tuple(st.events) for st in stages))


def _post(s: int, step: Step, stages: list[_Stage],
          posted: dict[tuple[str, int, int], tuple[int, float]],
          durations: dict[str, list[float]], record: bool) -> None:
    """Post a transfer step of stage ``s``; match each transfer with a posted peer."""
    st = stages[s]
    actions = step.actions if isinstance(step, P2PBatch) else (step,)
    st.posted, st.waiting, st.step_end = True, len(actions), st.clock
    for a in actions:
        channel, offset = _DIRECTION[a.kind]
        key = (channel, s + offset, a.micro_batch)
        peer = posted.pop(key, None)
        if peer is None:
            posted[key] = (s, st.clock)
            continue
        other = stages[peer[0]]
        start = max(st.clock, peer[1])
        end = start + durations[channel][key[1]]
        for who, stage_index in ((st, s), (other, peer[0])):
            who.waiting -= 1
            who.step_end = max(who.step_end, end)
            if record:
                who.events.append(TimelineEvent(stage_index, f"{channel} p2p", a.micro_batch,
                                                start, end))


def simulate_1f1b(forward_s: Sequence[float], backward_s: Sequence[float],
                  num_micro_batches: int, p2p_forward_s: Optional[Sequence[float]] = None,
                  p2p_backward_s: Optional[Sequence[float]] = None,
                  record_timeline: bool = True) -> SimulationResult:
    """:func:`simulate` on the non-interleaved 1F1B schedule of ``len(forward_s)`` stages."""
    steps = build_schedule("1f1b", len(forward_s), num_micro_batches)
    return simulate(steps, forward_s, backward_s, p2p_forward_s, p2p_backward_s,
                    record_timeline)


def closed_form_1f1b(forward_s: Sequence[float], backward_s: Sequence[float],
                     num_micro_batches: int, p2p_forward_s: Optional[Sequence[float]] = None,
                     p2p_backward_s: Optional[Sequence[float]] = None) -> float:
    """Iteration time of non-interleaved 1F1B with non-uniform stages, analytically.

    ``T = sum_s (f_s + b_s) + sum_b (c_b^f + c_b^b) + (m - 1) * max_s (f_s + b_s + k_s)``

    The first micro-batch's forward and backward cross every stage and boundary once (the
    critical path's ramp); the other ``m - 1`` go at the pace of the slowest stage's 1F1B cycle,
    which with blocking transfers includes its steady-state p2p: ``k_s`` is
    ``max(c_s^f, c_s^b)`` towards the next stage (send activations while receiving gradients)
    plus ``max(c_{s-1}^b, c_{s-1}^f)`` towards the previous one.

    Exact for uniform stages without p2p (``(m + p - 1)(f + b)``), and with p2p for p <= 2 or
    m = 1. With uniform p2p ``c`` and p >= 3, m >= 2 the simulation is exactly ``c`` below it
    (one steady-state exchange of the middle stages overlaps the ramp). In general the
    simulation lies between :func:`lower_bound_1f1b` and this value (tested on random stages),
    so the closed form is an upper bound.
    """
    f, b, m = list(forward_s), list(backward_s), num_micro_batches
    p = len(f)
    cf = list(p2p_forward_s or [0.0] * (p - 1))
    cb = list(p2p_backward_s or [0.0] * (p - 1))
    cycle = [f[s] + b[s] + (max(cf[s], cb[s]) if s < p - 1 else 0.0)
             + (max(cf[s - 1], cb[s - 1]) if s > 0 else 0.0) for s in range(p)]
    return sum(f) + sum(b) + sum(cf) + sum(cb) + (m - 1) * max(cycle)


def lower_bound_1f1b(forward_s: Sequence[float], backward_s: Sequence[float],
                     num_micro_batches: int) -> float:
    """No schedule beats this: some stage k must run all m micro-batches' forward and backward,
    after the first micro-batch reached it and before its gradient leaves for stage 0."""
    f, b, m = list(forward_s), list(backward_s), num_micro_batches
    return max(sum(f[:k]) + sum(b[:k]) + m * (f[k] + b[k]) for k in range(len(f)))


def bubble_fraction(makespan_s: float, forward_s: Sequence[float], backward_s: Sequence[float],
                    num_micro_batches: int) -> float:
    """Fraction of the pipeline time the busiest stage is idle: ``1 - m (f+b)_max / T``.

    For uniform 1F1B without p2p it is ``(p - 1) / (m + p - 1)``.
    """
    busiest = max(f + b for f, b in zip(forward_s, backward_s)) * num_micro_batches
    return 0.0 if makespan_s <= 0 else max(0.0, 1.0 - busiest / makespan_s)


class SimulationCache:
    """Built 1F1B step lists by (stages, micro-batches) and makespans by their inputs.

    Create one per search loop and pass it to every :func:`~megatron_het.perf.predictor.predict`
    call: building the step lists costs more than simulating them.
    """

    def __init__(self) -> None:
        self._schedules: dict[tuple[int, int], list[list[Step]]] = {}
        self._makespans: dict[tuple, float] = {}

    def schedule(self, num_stages: int, num_micro_batches: int) -> list[list[Step]]:
        key = (num_stages, num_micro_batches)
        if key not in self._schedules:
            self._schedules[key] = build_schedule("1f1b", num_stages, num_micro_batches)
        return self._schedules[key]

    def makespan(self, forward_s: Sequence[float], backward_s: Sequence[float],
                 num_micro_batches: int, p2p_forward_s: Sequence[float],
                 p2p_backward_s: Sequence[float]) -> float:
        """The simulated 1F1B makespan (no timeline), memoized."""
        key = (tuple(forward_s), tuple(backward_s), num_micro_batches, tuple(p2p_forward_s),
               tuple(p2p_backward_s))
        if key not in self._makespans:
            steps = self.schedule(len(forward_s), num_micro_batches)
            self._makespans[key] = simulate(steps, forward_s, backward_s, p2p_forward_s,
                                            p2p_backward_s, record_timeline=False).makespan_s
        return self._makespans[key]
