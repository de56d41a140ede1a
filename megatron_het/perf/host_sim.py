"""Event-driven simulation of every pipeline of a plan whose ranks share host CPUs.

For CPU-emulated clusters: every rank is a single-threaded process, and the ranks of one node
share its cores. The simulation runs the 1F1B step lists of every stage of every pipeline at
once (the executor's semantics, as in :mod:`megatron_het.perf.simulator`), with these phases of
a compute step on a stage's ``tp`` identical processes:

1. CPU work (seconds as measured alone): progresses at :meth:`HostSharing.rate` of the number of
   processes of that node computing at that moment (processor sharing);
2. in-region waits (the TP all-reduces): wall time, no core;
3. the emulated slowdown's injected wait, no core: the region lasts until ``slowdown x`` its CPU
   work on the rank's thread (phase 1 without gloo's share) has passed since it began, or ends
   at once if phases 1 and 2 took longer (the CPU basis of
   :class:`~megatron_het.emulation.Emulator`, which single-threaded ranks use; the CPU time of
   the work is taken as its time measured alone).

Transfers start when both sides have posted them and last the boundary's p2p time (no core).
A step ends when all its transfers have ended.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from megatron_het.perf.host_sharing import HostSharing
from megatron_het.pipeline.schedules import (Action, ActionKind, P2PBatch, ScheduleError, Step,
                                             build_schedule)

_DIRECTION = {  # transfer kind -> (channel, boundary offset from the stage)
    ActionKind.SEND_FORWARD: ("forward", 0), ActionKind.RECV_FORWARD: ("forward", -1),
    ActionKind.SEND_BACKWARD: ("backward", -1), ActionKind.RECV_BACKWARD: ("backward", 0)}
_EPS = 1e-12


@dataclass(frozen=True)
class HostStage:
    """One stage of one pipeline as the host sees it; times per micro-batch, in seconds.

    ``work_*_s``: CPU seconds of one process measured alone; ``wait_*_s``: waits inside the
    compute region (TP communication); ``p2p_*_s``: the transfer to the next stage (0 on the
    last). ``processes``: its TP ranks; ``node``: the host they run on. ``slowed_*_s``: the part
    of the work on the rank's own thread, whose CPU time the emulator multiplies by the slowdown
    (None: all of it; gloo's copies and reductions run on its own threads and are not slowed).
    """

    node: int
    processes: int
    slowdown: float
    work_forward_s: float
    work_backward_s: float
    wait_forward_s: float = 0.0
    wait_backward_s: float = 0.0
    p2p_forward_s: float = 0.0
    p2p_backward_s: float = 0.0
    slowed_forward_s: Optional[float] = None
    slowed_backward_s: Optional[float] = None


class _Agent:
    """One stage of one pipeline while it runs its step list."""

    def __init__(self, pipeline: int, stage: int, spec: HostStage, steps: Sequence[Step]) -> None:
        self.pipeline, self.stage, self.spec, self.steps = pipeline, stage, spec, steps
        self.pc, self.phase, self.left, self.until, self.region_start = 0, "next", 0.0, 0.0, 0.0
        self.region_work = 0.0
        self.pending, self.wait_s = 0, 0.0
        self.end, self.compute_s = 0.0, 0.0


@dataclass(frozen=True)
class SharedHostResult:
    """``makespans_s[p]``: pipeline p's time; ``compute_s[p][s]``: the wall time stage s of
    pipeline p spends in compute regions, injected waits included (what the executor reports
    as ``compute_s``)."""

    makespans_s: tuple[float, ...]
    compute_s: tuple[tuple[float, ...], ...]


def simulate_shared_host(pipelines: Sequence[Sequence[HostStage]],
                         micro_batches: Sequence[int],
                         sharing: Mapping[int, HostSharing]) -> SharedHostResult:
    """Every pipeline run at once; ``sharing[node]`` is the host's figures (a node without one
    runs its processes as if each had its own core). Raises ScheduleError on a deadlock."""
    agents = []
    for p, (stages, m) in enumerate(zip(pipelines, micro_batches)):
        steps = build_schedule("1f1b", len(stages), m)
        agents += [_Agent(p, s, st, steps[s]) for s, st in enumerate(stages)]
    posted: dict[tuple, _Agent] = {}
    now = 0.0
    while True:
        for a in agents:
            _advance(a, now, pipelines, posted)
        live = [a for a in agents if a.phase != "done"]
        if not live:
            break
        active: dict[int, int] = {}
        for a in live:
            if a.phase == "cpu":
                active[a.spec.node] = active.get(a.spec.node, 0) + a.spec.processes
        rates = {node: (sharing[node].rate(n) if node in sharing else 1.0)
                 for node, n in active.items()}
        dt = min([a.left / rates[a.spec.node] for a in live if a.phase == "cpu"]
                 + [a.until - now for a in live if a.phase in ("wait", "sleep", "xfer")
                    and a.pending == 0], default=None)
        if dt is None:
            stuck = ", ".join(f"pipeline {a.pipeline} stage {a.stage} at step {a.pc}"
                              for a in live)
            raise ScheduleError(f"deadlock in the shared-host simulation: {stuck}")
        dt = max(dt, 0.0)
        for a in live:
            if a.phase == "cpu":
                a.left -= rates[a.spec.node] * dt
        now += dt
    ends = [0.0] * len(pipelines)
    compute: list[list[float]] = [[0.0] * len(stages) for stages in pipelines]
    for a in agents:
        ends[a.pipeline] = max(ends[a.pipeline], a.end)
        compute[a.pipeline][a.stage] = a.compute_s
    return SharedHostResult(tuple(ends), tuple(tuple(c) for c in compute))


def _advance(a: _Agent, now: float, pipelines: Sequence[Sequence[HostStage]],
             posted: dict[tuple, _Agent]) -> None:
    """Move ``a`` through every phase that ends by ``now``; start its next steps."""
    while True:
        if a.phase == "cpu":
            if a.left > _EPS:
                return
            a.phase, a.until = "wait", now + a.wait_s
        elif a.phase == "wait":
            if a.until > now + _EPS:
                return
            a.phase = "sleep"
            a.until = max(now, a.region_start + a.spec.slowdown * a.region_work)
        elif a.phase in ("sleep", "xfer"):
            if a.pending or a.until > now + _EPS:
                return
            if a.phase == "sleep":
                a.compute_s += now - a.region_start
            a.pc += 1
            a.phase = "next"
        elif a.phase == "next":
            if a.pc >= len(a.steps):
                a.phase, a.end = "done", now
                return
            _start_step(a, now, pipelines, posted)
        else:  # done
            return


def _start_step(a: _Agent, now: float, pipelines: Sequence[Sequence[HostStage]],
                posted: dict[tuple, _Agent]) -> None:
    step, spec = a.steps[a.pc], a.spec
    if isinstance(step, Action) and step.kind is ActionKind.FORWARD:
        a.phase, a.left, a.wait_s = "cpu", spec.work_forward_s, spec.wait_forward_s
        a.region_start = now
        a.region_work = (spec.work_forward_s if spec.slowed_forward_s is None
                         else spec.slowed_forward_s)
        return
    if isinstance(step, Action) and step.kind is ActionKind.BACKWARD:
        a.phase, a.left, a.wait_s = "cpu", spec.work_backward_s, spec.wait_backward_s
        a.region_start = now
        a.region_work = (spec.work_backward_s if spec.slowed_backward_s is None
                         else spec.slowed_backward_s)
        return
    actions = step.actions if isinstance(step, P2PBatch) else (step,)
    a.phase, a.pending, a.until = "xfer", len(actions), now
    stages = pipelines[a.pipeline]
    for action in actions:
        channel, offset = _DIRECTION[action.kind]
        boundary = a.stage + offset
        key = (a.pipeline, channel, boundary, action.micro_batch)
        peer = posted.pop(key, None)
        if peer is None:
            posted[key] = a
            continue
        sender = stages[boundary]
        end = now + (sender.p2p_forward_s if channel == "forward" else sender.p2p_backward_s)
        for who in (a, peer):
            who.pending -= 1
            who.until = max(who.until, end)


__all__ = ["HostStage", "SharedHostResult", "simulate_shared_host"]
