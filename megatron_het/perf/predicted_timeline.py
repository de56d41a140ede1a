"""A prediction's iteration as a timeline: each pipeline's schedule simulated with the
predicted per-stage times, then the DP sync and the optimizer step.

The planner's chart draws the slowest pipeline from it; a run's trace puts every rank's
predicted spans beside its measured ones (:mod:`megatron_het.training.timeline`). The
simulation is :func:`~megatron_het.perf.schedule.simulator.simulate` with fixed stage times:
each forward (backward) of a stage lasts its row's ``forward_s`` (``backward_s``), each
transfer its boundary's ``p2p_*_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_het.perf.estimates import Prediction, StagePrediction
from megatron_het.perf.schedule.simulator import SimulationResult, simulate
from megatron_het.pipeline.schedules import build_schedule
from megatron_het.trace.recorder import Span


@dataclass(frozen=True)
class SimulatedPipeline:
    """One pipeline of a prediction, simulated: ``rows`` its stages in order, ``num_groups``
    its device groups (an interleaved group runs ``len(rows) // num_groups`` chunks; group g's
    first chunk is stage g), ``simulation.timeline[g]`` group g's steps."""

    pipeline: int
    rows: tuple[StagePrediction, ...]
    num_groups: int
    micro_batches: int
    simulation: SimulationResult

    @property
    def chunks(self) -> int:
        return len(self.rows) // self.num_groups


def simulated_pipeline(prediction: Prediction, pipeline: int) -> SimulatedPipeline:
    """Simulate ``pipeline``'s schedule (1F1B, interleaved where the plan interleaves, with the
    prediction's overlap of transfers) at the predicted stage times."""
    rows = [s for s in prediction.stages if s.pipeline == pipeline]
    (info,) = [p for p in prediction.pipelines if p.pipeline == pipeline]
    num_groups = len(dict.fromkeys(r.ranks for r in rows))
    schedule = build_schedule(
        "1f1b",
        num_groups,
        info.micro_batches,
        num_chunks=len(rows) // num_groups,
        overlap_p2p=prediction.overlap_p2p_comm,
    )
    simulation = simulate(
        schedule,
        [r.forward_s for r in rows],
        [r.backward_s for r in rows],
        [r.p2p_forward_s for r in rows[:-1]],
        [r.p2p_backward_s for r in rows[:-1]],
    )
    return SimulatedPipeline(pipeline, tuple(rows), num_groups, info.micro_batches, simulation)


def slowest_pipeline(prediction: Prediction) -> SimulatedPipeline:
    """:func:`simulated_pipeline` of the pipeline predicted to take longest."""
    slowest = max(prediction.pipelines, key=lambda p: p.time_s)
    return simulated_pipeline(prediction, slowest.pipeline)


def predicted_spans(prediction: Prediction) -> dict[int, list[Span]]:
    """Every rank's predicted iteration, from 0 s: its device group's forwards and backwards
    (category ``compute``, args stage / micro_batch / chunk as the runtime records them), its
    transfers (``p2p``), then the DP sync from the end of the slowest pipeline and the
    optimizer step after the whole sync (``step``). Keyed by world rank."""
    out: dict[int, list[Span]] = {}
    sims = [simulated_pipeline(prediction, p.pipeline) for p in prediction.pipelines]
    end = max(sim.simulation.makespan_s for sim in sims)
    for sim in sims:
        for group in range(sim.num_groups):
            row = sim.rows[group]
            spans = [_span(e, sim) for e in sim.simulation.timeline[group]]
            spans.append(Span("DP gradient sync", "step", end, end + row.dp_sync_s))
            step_start = end + prediction.dp_sync_s
            spans.append(Span("optimizer step", "step", step_start, step_start + row.optimizer_s))
            for rank in row.ranks:
                out[rank] = spans
    return out


def _span(event, sim: SimulatedPipeline) -> Span:  # event: simulator.TimelineEvent
    chunk = event.stage // sim.num_groups
    if event.kind in ("forward", "backward"):
        name = f"{event.kind} mb{event.micro_batch}" + (f" c{chunk}" if sim.chunks > 1 else "")
        category = "compute"
    else:
        name, category = event.kind, "p2p"
    args = {"stage": event.stage, "micro_batch": event.micro_batch, "chunk": chunk}
    return Span(name, category, event.start_s, event.end_s, args)
