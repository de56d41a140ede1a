"""The memo of a search loop's predictions: built 1F1B step lists, simulated makespans and
last-backward ends by their inputs, activation peaks per step list, and stage computes.

One :class:`SimulationCache` per loop, passed to every
:func:`~megatron_het.perf.predictor.predict` call: building the step lists costs more than
simulating them (:mod:`megatron_het.perf.schedule.simulator`), and the planner's probes ask for
the same stage computes (:func:`~megatron_het.perf.cost.compute_time.stage_compute`) again and
again.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_het.perf.cost.compute_time import StageCompute, stage_compute
from megatron_het.perf.schedule.simulator import group_count, simulate
from megatron_het.pipeline.schedule_check import held_counts
from megatron_het.pipeline.schedules import Step, build_schedule, interleaved_compute


def _inputs_key(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_micro_batches: int,
    p2p_forward_s: Sequence[float],
    p2p_backward_s: Sequence[float],
    num_chunks: int,
    overlap_p2p: bool,
) -> tuple:
    """A pipeline simulation's inputs as a memo key (overlap only matters interleaved)."""
    return (
        tuple(forward_s),
        tuple(backward_s),
        num_micro_batches,
        tuple(p2p_forward_s),
        tuple(p2p_backward_s),
        num_chunks,
        overlap_p2p and num_chunks > 1,
    )


class SimulationCache:
    """Built 1F1B step lists by (groups, micro-batches, chunks, overlap), makespans by their
    inputs, activation peaks per list and stage computes by their arguments.

    Create one per search loop and pass it to every :func:`~megatron_het.perf.predictor.predict`
    call: building the step lists costs more than simulating them.
    """

    def __init__(self) -> None:
        self._schedules: dict[tuple[int, int, int, bool], list[list[Step]]] = {}
        self._makespans: dict[tuple, float] = {}
        self._ends: dict[tuple, tuple[float, tuple[tuple[tuple[float, float], ...], ...]]] = {}
        self._held: dict[tuple[int, int, int, int], tuple] = {}
        self._computes: dict[tuple, tuple[StageCompute, object]] = {}

    def schedule(
        self,
        num_stages: int,
        num_micro_batches: int,
        num_chunks: int = 1,
        overlap_p2p: bool = False,
    ) -> list[list[Step]]:
        """The 1F1B lists of ``num_stages`` stages, or with ``num_chunks > 1`` the interleaved
        lists of ``num_stages`` device groups, their transfers overlapped with compute where
        ``overlap_p2p`` (as :func:`build_schedule`)."""
        key = (num_stages, num_micro_batches, num_chunks, overlap_p2p and num_chunks > 1)
        if key not in self._schedules:
            self._schedules[key] = build_schedule("1f1b", *key)
        return self._schedules[key]

    def held_counts(
        self, num_groups: int, num_micro_batches: int, num_chunks: int, group: int
    ) -> tuple[tuple[tuple[int, int], ...], ...]:
        """:func:`~megatron_het.pipeline.schedule_check.held_counts` of group ``group``'s
        1F1B list (stages as :meth:`schedule` numbers them), memoized."""
        key = (num_groups, num_micro_batches, num_chunks, group)
        if key not in self._held:
            steps = interleaved_compute(num_groups, num_chunks, num_micro_batches, group)
            self._held[key] = held_counts(steps, group)
        return self._held[key]

    def stage_compute(self, args: tuple) -> StageCompute:
        """:func:`~megatron_het.perf.cost.compute_time.stage_compute` of ``args`` (its positional
        arguments), memoized; the profile is keyed by identity (profiles are not hashable)
        and kept alive with the result."""
        choice = args[8]
        key = (*args[:8], id(choice.profile), choice.time_factor, *args[9:])
        if key not in self._computes:
            self._computes[key] = (stage_compute(*args), choice.profile)
        return self._computes[key][0]

    def last_backwards(
        self,
        forward_s: Sequence[float],
        backward_s: Sequence[float],
        num_micro_batches: int,
        p2p_forward_s: Sequence[float],
        p2p_backward_s: Sequence[float],
        num_chunks: int = 1,
        overlap_p2p: bool = False,
    ) -> tuple[float, tuple[tuple[tuple[float, float], ...], ...]]:
        """The simulated makespan and, per device group, the end and duration of the last
        backward of each of its chunks, in chunk order (from the timeline), memoized like
        :meth:`makespan`: the replicas of a plan that run alike are simulated once."""
        key = _inputs_key(
            forward_s,
            backward_s,
            num_micro_batches,
            p2p_forward_s,
            p2p_backward_s,
            num_chunks,
            overlap_p2p,
        )
        if key not in self._ends:
            groups = group_count(len(forward_s), num_chunks)
            steps = self.schedule(groups, num_micro_batches, num_chunks, overlap_p2p)
            result = simulate(
                steps, forward_s, backward_s, p2p_forward_s, p2p_backward_s, record_timeline=True
            )
            ends = []
            for g, events in enumerate(result.timeline):
                chunks: list[tuple[float, float]] = []
                for stage in range(g, len(forward_s), groups):
                    last = next(
                        e for e in reversed(events) if e.kind == "backward" and e.stage == stage
                    )
                    chunks.append((last.end_s, last.end_s - last.start_s))
                ends.append(tuple(chunks))
            self._ends[key] = (result.makespan_s, tuple(ends))
        return self._ends[key]

    def makespan(
        self,
        forward_s: Sequence[float],
        backward_s: Sequence[float],
        num_micro_batches: int,
        p2p_forward_s: Sequence[float],
        p2p_backward_s: Sequence[float],
        num_chunks: int = 1,
        overlap_p2p: bool = False,
    ) -> float:
        """The simulated 1F1B makespan (no timeline), memoized; per-STAGE inputs, interleaved
        over ``len(forward_s) // num_chunks`` groups when ``num_chunks > 1`` (``overlap_p2p``:
        transfers overlapped with compute)."""
        key = _inputs_key(
            forward_s,
            backward_s,
            num_micro_batches,
            p2p_forward_s,
            p2p_backward_s,
            num_chunks,
            overlap_p2p,
        )
        if key not in self._makespans:
            steps = self.schedule(
                group_count(len(forward_s), num_chunks), num_micro_batches, num_chunks, overlap_p2p
            )
            self._makespans[key] = simulate(
                steps, forward_s, backward_s, p2p_forward_s, p2p_backward_s, record_timeline=False
            ).makespan_s
        return self._makespans[key]


__all__ = ["SimulationCache"]
