"""Event-driven simulation of pipeline schedules: per-stage compute regions, per-boundary p2p.

It executes the per-group step lists of :mod:`megatron_het.pipeline.schedules` with the same
rendezvous semantics as :func:`~megatron_het.pipeline.schedules.check_schedule` and the executor:
a compute step runs when the group reaches it and lasts its stage's time; a transfer starts once
both sides have posted the step holding it and lasts that boundary's p2p time; a step (a single
transfer or a P2PBatch) ends when all its transfers have ended, and the group waits for that
(blocking transfers). A ``P2PPost`` lets the group go on at once and its ``P2PWait`` waits
for its transfers' ends (transfers overlapped with compute; each takes its own time, so a
boundary's transfers in flight together do not share its bandwidth). Without interleaving a
group is a stage; an interleaved pipeline of ``p`` groups has ``n = v p`` stages, stage ``s``
on group ``s % p``, and results stay per group.

:func:`simulate_pipelines` runs several pipelines at once. A compute step is a :class:`Region`:
CPU work, then a wait without a core, lasting at least a floor. With a :class:`CoreSharing`
rate model (processes of one node sharing its cores, as the ranks of a CPU-emulated cluster do)
the work of every process computing on a node progresses at the rate the model gives for their
number at that moment (processor sharing), so the regions of all pipelines interact; without
one every region lasts ``max(work + wait, floor)`` and each group runs on its own clock.
:func:`simulate` and :func:`simulate_1f1b` are the one-pipeline, fixed-time forms.

The analytic models the simulation checks (closed forms, lower bounds, the bubble) live in
:mod:`megatron_het.perf.schedule.closed_forms`; the memo a search loop passes to every
prediction, :class:`~megatron_het.perf.schedule.simulation_cache.SimulationCache`, in
:mod:`megatron_het.perf.schedule.simulation_cache`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from megatron_het.pipeline.actions import _actions_of
from megatron_het.pipeline.schedules import (
    Action,
    ActionKind,
    P2PPost,
    P2PWait,
    ScheduleError,
    Step,
    build_schedule,
)

_DIRECTION = {  # transfer kind -> (channel, boundary offset from the stage)
    ActionKind.SEND_FORWARD: ("forward", 0),
    ActionKind.RECV_FORWARD: ("forward", -1),
    ActionKind.SEND_BACKWARD: ("backward", -1),
    ActionKind.RECV_BACKWARD: ("backward", 0),
}
_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD)


@dataclass(frozen=True)
class TimelineEvent:
    """One step of one group: ``stage`` is the action's global stage; ``kind`` is forward,
    backward or a transfer direction ("forward p2p", "backward p2p")."""

    stage: int
    kind: str
    micro_batch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimulationResult:
    """``makespan_s``: when the last group finishes; ``busy_s[g]``: compute time of group g
    (all its stages); ``timeline[g]``: group g's events in order (empty unless recorded).
    Without interleaving a group is a stage."""

    makespan_s: float
    stage_end_s: tuple[float, ...]
    busy_s: tuple[float, ...]
    timeline: tuple[tuple[TimelineEvent, ...], ...]


@dataclass(frozen=True)
class Region:
    """One compute step, in seconds: ``work_s`` of one process's CPU work as measured alone
    (it progresses at its node's :class:`CoreSharing` rate; at 1 without one), then ``wait_s``
    without a core (e.g. a collective's wait); the region lasts at least ``floor_s`` from its
    start (e.g. an emulated kind's padding). Alone it lasts ``max(work_s + wait_s, floor_s)``."""

    work_s: float
    wait_s: float = 0.0
    floor_s: float = 0.0


@dataclass(frozen=True)
class StageTiming:
    """One stage of one pipeline: its ``forward`` and ``backward`` region per micro-batch, the
    transfer to the next stage each way (0 on the last), and the ``node`` its ``processes``
    (its TP ranks, computing together) run on."""

    forward: Region
    backward: Region
    p2p_forward_s: float = 0.0
    p2p_backward_s: float = 0.0
    node: int = 0
    processes: int = 1


class CoreSharing(Protocol):
    """A rate model: how fast compute progresses where processes share a node's cores."""

    def rate(self, node: int, computing: int) -> float:
        """Work seconds (as measured alone) that one computing process of ``node`` does per
        wall second while ``computing`` processes of that node compute (> 0)."""


@dataclass(frozen=True)
class PipelinesResult:
    """:func:`simulate_pipelines`: per pipeline p, ``makespans_s[p]``, and per device group g
    (a stage without interleaving) ``stage_end_s[p][g]``, ``busy_s[p][g]`` (wall time in compute
    regions, waits included) and ``timeline[p][g]`` (empty unless recorded)."""

    makespans_s: tuple[float, ...]
    stage_end_s: tuple[tuple[float, ...], ...]
    busy_s: tuple[tuple[float, ...], ...]
    timeline: tuple[tuple[tuple[TimelineEvent, ...], ...], ...]


def simulate_pipelines(
    schedules: Sequence[Sequence[Sequence[Step]]],
    stages: Sequence[Sequence[StageTiming]],
    sharing: CoreSharing | None = None,
    record_timeline: bool = False,
) -> PipelinesResult:
    """Run every pipeline's step lists at once: ``schedules[p][g]`` is device group g of
    pipeline p's step list and ``stages[p][s]`` the timing of global stage s (``n = v *
    groups`` of them; n = groups without interleaving). A compute action takes its stage's
    region, a transfer over boundary b (stage b to b + 1) ``stages[p][b].p2p_*_s``; group g
    computes on the node and processes of its first stage ``stages[p][g]``. ``sharing`` (None:
    every process has a core of its own) is the rate of compute on shared nodes. Raises
    ScheduleError on a deadlock."""
    engine = _Engine(schedules, stages, sharing, record_timeline)
    engine.run()
    shape = [len(pipeline) for pipeline in schedules]
    it = iter(engine.agents)
    rows = [[next(it) for _ in range(n)] for n in shape]
    return PipelinesResult(
        tuple(max((a.clock for a in row), default=0.0) for row in rows),
        tuple(tuple(a.clock for a in row) for row in rows),
        tuple(tuple(a.busy for a in row) for row in rows),
        tuple(tuple(tuple(a.events) for a in row) for row in rows),
    )


def simulate(
    per_stage_steps: Sequence[Sequence[Step]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    p2p_forward_s: Sequence[float] | None = None,
    p2p_backward_s: Sequence[float] | None = None,
    record_timeline: bool = True,
) -> SimulationResult:
    """Run one pipeline's step lists (one per stage, or per device group of an interleaved
    schedule); ``forward_s[s]`` / ``backward_s[s]`` is global stage s's compute per micro-batch,
    ``p2p_*_s[b]`` the transfer time over boundary b (stage b to b + 1) in each direction
    (default 0). Raises ScheduleError on a deadlock."""
    n = len(forward_s)
    cf = list(p2p_forward_s or [0.0] * (n - 1)) + [0.0]
    cb = list(p2p_backward_s or [0.0] * (n - 1)) + [0.0]
    timings = [
        StageTiming(Region(forward_s[s]), Region(backward_s[s]), cf[s], cb[s]) for s in range(n)
    ]
    result = simulate_pipelines([per_stage_steps], [timings], None, record_timeline)
    return SimulationResult(
        result.makespans_s[0], result.stage_end_s[0], result.busy_s[0], result.timeline[0]
    )


class _Agent:
    """One device group of one pipeline while it runs its step list (``timing``: its first
    stage's, for its node and processes). ``state``: "run" (takes its next step at ``clock``),
    "cpu" / "tail" (in a region's work / wait and floor), "xfer" (in a transfer step), "done"."""

    __slots__ = (
        "pipeline",
        "group",
        "timing",
        "steps",
        "pc",
        "clock",
        "state",
        "region",
        "start",
        "left",
        "waiting",
        "posts",
        "busy",
        "events",
        "version",
    )

    def __init__(
        self, pipeline: int, group: int, timing: StageTiming, steps: Sequence[Step]
    ) -> None:
        self.pipeline, self.group, self.timing, self.steps = pipeline, group, timing, steps
        self.pc, self.clock, self.state = 0, 0.0, "run"
        self.region, self.start, self.left = timing.forward, 0.0, 0.0
        self.waiting: _Xfer | None = None  # the transfers it is blocked on
        self.posts: dict[tuple[Action, ...], _Xfer] = {}  # posted, not waited on
        self.busy = 0.0
        self.events: list[TimelineEvent] = []
        self.version = 0


class _Xfer:
    """The transfers of one posted step: how many are not matched yet, and when the matched
    ones end."""

    __slots__ = ("left", "end")

    def __init__(self, count: int, now: float) -> None:
        self.left, self.end = count, now


def _stage_of(action: Action, agent: _Agent) -> int:
    """The global stage of an action (None: the list's own stage, its group index)."""
    return agent.group if action.stage is None else action.stage


class _Node:
    """The processes computing on one node: since when ``rate`` holds for them."""

    __slots__ = ("members", "computing", "rate", "since")

    def __init__(self) -> None:
        self.members: list[_Agent] = []
        self.computing, self.rate, self.since = 0, 1.0, 0.0


class _Engine:
    """Agents woken in time order from a heap. Without a rate model an agent runs ahead on its
    own clock until a transfer blocks it (nothing else depends on the time); with one every
    phase boundary is an event, so the nodes' rates are known at every moment."""

    def __init__(
        self,
        schedules: Sequence[Sequence[Sequence[Step]]],
        stages: Sequence[Sequence[StageTiming]],
        sharing: CoreSharing | None,
        record: bool,
    ) -> None:
        if len(schedules) != len(stages) or any(
            not steps or len(timings) < len(steps) or len(timings) % len(steps)
            for steps, timings in zip(schedules, stages)
        ):
            raise ValueError(
                "need for each pipeline one step list per device group and one "
                "StageTiming per stage, a multiple of the groups"
            )
        self.stages, self.sharing, self.record = stages, sharing, record
        self.interleaved = any(len(s) != len(t) for s, t in zip(schedules, stages))
        self.agents = [
            _Agent(p, g, timings[g], group_steps)
            for p, (steps, timings) in enumerate(zip(schedules, stages))
            for g, group_steps in enumerate(steps)
        ]
        self.heap: list[tuple[float, int, int, _Agent]] = []
        self.order = itertools.count()
        # a transfer's key -> (the side that posted it first, when, its stage, its post)
        self.posted: dict[tuple[int, str, int, int], tuple[_Agent, float, int, _Xfer]] = {}
        self.nodes: dict[int, _Node] = {}

    def run(self) -> None:
        for agent in self.agents:
            self._steps(agent)
        while self.heap:
            time, _, version, agent = heapq.heappop(self.heap)
            if version == agent.version:
                self._wake(agent, time)
        stuck = [a for a in self.agents if a.state != "done"]
        if stuck:
            label = "group" if self.interleaved else "stage"
            where = (
                (lambda a: f"{label} {a.group}")
                if len(self.stages) == 1
                else (lambda a: f"pipeline {a.pipeline} {label} {a.group}")
            )
            raise ScheduleError(
                "deadlock in simulation: " + ", ".join(f"{where(a)} at step {a.pc}" for a in stuck)
            )

    def _schedule(self, agent: _Agent, time: float) -> None:
        agent.version += 1
        heapq.heappush(self.heap, (time, next(self.order), agent.version, agent))

    def _wake(self, agent: _Agent, now: float) -> None:
        if agent.state == "cpu":  # its work is done
            self._leave(agent, now)
            region = agent.region
            end = max(now + region.wait_s, agent.start + region.floor_s)
            if end > now:
                agent.state = "tail"
                self._schedule(agent, end)
                return
            self._end_region(agent, now)
        elif agent.state == "tail":
            self._end_region(agent, now)
        elif agent.state == "xfer":
            assert agent.waiting is not None
            agent.clock = max(agent.clock, agent.waiting.end)
            agent.waiting = None
            agent.pc += 1
        agent.state = "run"
        self._steps(agent)

    def _steps(self, agent: _Agent) -> None:
        """Take steps from ``agent.clock`` until one has to wait for an event."""
        steps = agent.steps
        while agent.pc < len(steps):
            step = steps[agent.pc]
            if isinstance(step, Action) and step.kind in _COMPUTE:
                timing = self.stages[agent.pipeline][_stage_of(step, agent)]
                region = timing.forward if step.kind is ActionKind.FORWARD else timing.backward
                if self.sharing is None:
                    self._fixed_region(agent, step, region)
                    continue
                agent.region, agent.start = region, agent.clock
                if region.work_s > 0:
                    agent.state = "cpu"
                    self._enter(agent, agent.clock)
                    return
                end = max(agent.clock + region.wait_s, agent.clock + region.floor_s)
                if end > agent.clock:
                    agent.state = "tail"
                    self._schedule(agent, end)
                    return
                self._end_region(agent, agent.clock)
                continue
            if isinstance(step, P2PPost):
                agent.posts[step.actions] = self._post(agent, step.actions)
                agent.pc += 1
                continue
            xfer = (
                agent.posts.pop(step.actions)
                if isinstance(step, P2PWait)
                else self._post(agent, _actions_of(step))
            )
            agent.state = "xfer"
            if xfer.left:
                agent.waiting = xfer
                return  # the peer's post wakes it
            if self.sharing is not None and xfer.end > agent.clock:
                agent.waiting = xfer
                self._schedule(agent, xfer.end)
                return
            agent.clock = max(agent.clock, xfer.end)
            agent.pc += 1
            agent.state = "run"
        agent.state = "done"

    def _fixed_region(self, agent: _Agent, step: Action, region: Region) -> None:
        duration = max(region.work_s + region.wait_s, region.floor_s)
        if self.record:
            agent.events.append(
                TimelineEvent(
                    _stage_of(step, agent),
                    step.kind.value,
                    step.micro_batch,
                    agent.clock,
                    agent.clock + duration,
                )
            )
        agent.clock += duration
        agent.busy += duration
        agent.pc += 1

    def _end_region(self, agent: _Agent, now: float) -> None:
        if self.record:
            step = agent.steps[agent.pc]
            assert isinstance(step, Action)  # a region is a compute step's
            agent.events.append(
                TimelineEvent(
                    _stage_of(step, agent), step.kind.value, step.micro_batch, agent.start, now
                )
            )
        agent.busy += now - agent.start
        agent.clock = now
        agent.pc += 1

    def _post(self, agent: _Agent, actions: Sequence[Action]) -> _Xfer:
        """Post transfers at ``agent.clock``; match each with a posted peer. The returned
        record counts those still unmatched and the end of the matched ones."""
        xfer = _Xfer(len(actions), agent.clock)
        timings = self.stages[agent.pipeline]
        for action in actions:
            channel, offset = _DIRECTION[action.kind]
            stage = _stage_of(action, agent)
            boundary = stage + offset
            key = (agent.pipeline, channel, boundary, action.micro_batch)
            peer = self.posted.pop(key, None)
            if peer is None:
                self.posted[key] = (agent, agent.clock, stage, xfer)
                continue
            other, posted_at, other_stage, other_xfer = peer
            start = max(agent.clock, posted_at)
            sender = timings[boundary]
            end = start + (sender.p2p_forward_s if channel == "forward" else sender.p2p_backward_s)
            for who, who_stage, record in ((agent, stage, xfer), (other, other_stage, other_xfer)):
                record.left -= 1
                record.end = max(record.end, end)
                if self.record:
                    who.events.append(
                        TimelineEvent(who_stage, f"{channel} p2p", action.micro_batch, start, end)
                    )
            if other.waiting is other_xfer and other_xfer.left == 0:
                self._schedule(other, max(other.clock, other_xfer.end))
        return xfer

    # ---- shared cores ---------------------------------------------------------------------
    def _node(self, agent: _Agent) -> tuple[int, _Node]:
        node = agent.timing.node
        if node not in self.nodes:
            self.nodes[node] = _Node()
        return node, self.nodes[node]

    def _enter(self, agent: _Agent, now: float) -> None:
        index, node = self._node(agent)
        self._settle(node, now)
        agent.left = agent.region.work_s
        node.members.append(agent)
        node.computing += agent.timing.processes
        self._reschedule(index, node, now)

    def _leave(self, agent: _Agent, now: float) -> None:
        index, node = self._node(agent)
        self._settle(node, now)
        node.members.remove(agent)
        node.computing -= agent.timing.processes
        self._reschedule(index, node, now)

    @staticmethod
    def _settle(node: _Node, now: float) -> None:
        elapsed = now - node.since
        if elapsed > 0:
            for member in node.members:
                member.left -= node.rate * elapsed
        node.since = now

    def _reschedule(self, index: int, node: _Node, now: float) -> None:
        assert self.sharing is not None
        node.rate = self.sharing.rate(index, node.computing) if node.computing else 1.0
        if not node.rate > 0:
            raise ValueError(
                f"the rate of node {index} with {node.computing} processes "
                f"computing must be positive, got {node.rate!r}"
            )
        for member in node.members:
            self._schedule(member, now + max(0.0, member.left) / node.rate)


def simulate_1f1b(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_micro_batches: int,
    p2p_forward_s: Sequence[float] | None = None,
    p2p_backward_s: Sequence[float] | None = None,
    record_timeline: bool = True,
    num_chunks: int = 1,
    overlap_p2p: bool = False,
) -> SimulationResult:
    """:func:`simulate` on the 1F1B schedule of ``len(forward_s)`` stages: non-interleaved, or
    interleaved over ``len(forward_s) // num_chunks`` device groups (``overlap_p2p``: its
    transfers overlapped with compute)."""
    steps = build_schedule(
        "1f1b", group_count(len(forward_s), num_chunks), num_micro_batches, num_chunks, overlap_p2p
    )
    return simulate(steps, forward_s, backward_s, p2p_forward_s, p2p_backward_s, record_timeline)


def group_count(num_stages: int, num_chunks: int) -> int:
    """The device groups of ``num_stages`` stages at ``num_chunks`` chunks per group
    (ValueError where they do not divide)."""
    if num_chunks < 1 or num_stages % num_chunks:
        raise ValueError(
            f"{num_stages} stages do not split into {num_chunks} chunks per device group"
        )
    return num_stages // num_chunks


__all__ = [
    "CoreSharing",
    "PipelinesResult",
    "Region",
    "SimulationResult",
    "StageTiming",
    "TimelineEvent",
    "group_count",
    "simulate",
    "simulate_1f1b",
    "simulate_pipelines",
]
