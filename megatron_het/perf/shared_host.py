"""The iteration of a plan whose ranks are processes sharing host CPUs (CPU-emulated kinds).

Used by :func:`megatron_het.perf.predictor.predict` when every rank of the plan is of an emulated
kind and the host profile of each has :attr:`~megatron_het.perf.profile.Profile.host_sharing`
figures; otherwise each rank is taken to own its device and this module is not involved.

What changes against the one-device-per-rank model, each from a measured figure:

- pipeline: every pipeline runs at once in :func:`~megatron_het.perf.host_sim.simulate_shared_host`
  with the stage's compute as host CPU seconds (the profile's times without the slowdown), the
  TP collectives inside the compute region (with :attr:`Profile.host_collective_s`, the
  measured wall and CPU time of one collective between computing peers: its CPU time as work
  on the shared cores, the rest as a wait; else the link model's all-reduce as a wait), each
  stage-boundary transfer's measured gloo time as CPU work at both ends, and the slowdown as
  the injected wait after the region, which frees the core: the executor's
  :class:`~megatron_het.emulation.Emulator` (CPU basis) pads a region to ``slowdown x`` the
  CPU time of the rank's own thread, the stage's compute without gloo's share;
- DP gradient sync: the link model's time, slowed by the host sharing of the ranks that sync
  at once (gloo copies and reduces on the CPU);
- optimizer step: every rank steps at once after the gradient sync; the emulator slows only the
  pipeline's compute regions, so the step runs at host speed, sharing the host
  (:meth:`HostSharing.finish_time` of the measured per-parameter time);
- per-iteration overhead: the driver's two world collectives of a few numbers per iteration (the
  gathered loss/timing table and the global gradient norm), each costed as a mixed-kind
  all-reduce of a few bytes with the measured gloo latency.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from megatron_het.perf.host_sharing import HostSharing
from megatron_het.perf.host_sim import HostStage, simulate_shared_host
from megatron_het.perf.stage_cost import choose_profile

if TYPE_CHECKING:  # pragma: no cover
    from megatron_het.perf.predictor import StagePrediction

# The world collectives the driver runs per iteration besides the pipeline's and the DP sync's:
# the all-gather of every rank's loss/stop/timing row and the global gradient-norm all-reduce.
WORLD_COLLECTIVES_PER_ITERATION = 2
WORLD_COLLECTIVE_BYTES = 64
# The vocab-parallel cross-entropy's small all-reduces in its forward (max, then the sums).
CROSS_ENTROPY_COLLECTIVES = 2


def host_sharing_by_node(ctx: Any) -> Optional[dict[int, HostSharing]]:
    """Per node, the host figures when every rank of the plan is emulated and its host profile
    has them; None otherwise."""
    out: dict[int, HostSharing] = {}
    for rank in ctx.plan.ranks():
        spec = ctx.comm.spec_of(rank)
        profile = choose_profile(spec, ctx.profiles).profile
        if not spec.emulated or profile is None or not profile.host_sharing:
            return None
        out.setdefault(ctx.comm.node_of(rank), HostSharing(profile.host_sharing))
    return out


def tp_collectives(stage: Any, recompute: bool) -> tuple[int, int]:
    """(forward, backward) TP collectives per micro-batch of a stage (0 at tp=1): the layers'
    2 all-reduces each way (2 more backward under recompute), the vocab-parallel embedding's
    forward one, the head's input-gradient one and its cross-entropy's 2 small ones (the
    maximum, then the sums) in the forward."""
    if stage.tp == 1:
        return 0, 0
    forward = 2 * stage.num_layers + (1 if stage.has_embedding else 0) + (
        CROSS_ENTROPY_COLLECTIVES if stage.has_head else 0)
    backward = 2 * stage.num_layers * (2 if recompute else 1) + (1 if stage.has_head else 0)
    return forward, backward


@dataclass(frozen=True)
class SharedHostTimes:
    """Seconds per iteration of a plan on shared hosts (see the module docstring)."""

    pipelines_s: tuple[float, ...]
    dp_sync_s: float
    optimizer_s: float
    overhead_s: float


def shared_host_times(ctx: Any, rows: Sequence["StagePrediction"]) -> Optional[SharedHostTimes]:
    """The iteration's parts for a plan on shared hosts, or None when
    :func:`host_sharing_by_node` is None."""
    sharing = host_sharing_by_node(ctx)
    if sharing is None:
        return None
    row_of = {(r.pipeline, r.stage): r for r in rows}
    transfer = _transfer_cpu_s(ctx)
    pipelines = []
    for p, pipeline in enumerate(ctx.plan.pipelines):
        stages = []
        for s, stage in enumerate(pipeline.stages):
            spec = ctx.comm.spec_of(stage.ranks[0])
            compute = ctx.compute(s, pipeline)
            tp_forward, tp_backward = ctx.tp_comm(s, pipeline)
            row = row_of[(p, s)]
            recompute = stage.recompute if ctx.recompute is None else ctx.recompute
            forward_count, backward_count = tp_collectives(stage, recompute)
            node = ctx.comm.node_of(stage.ranks[0])
            work_forward = slowed_forward = compute.forward_s / spec.slowdown
            work_backward = slowed_backward = compute.backward_s / spec.slowdown
            host = choose_profile(spec, ctx.profiles).profile
            if stage.tp > 1 and host.host_collective_s:
                # Measured per collective: its CPU share is work on the shared cores, the rest
                # a wait; both replace the link model's all-reduce.
                wall, cpu = host.host_collective_s
                work_forward += forward_count * cpu
                work_backward += backward_count * cpu
                tp_forward, tp_backward = (forward_count * (wall - cpu),
                                           backward_count * (wall - cpu))
            # Each way, a micro-batch is received from the stage before and sent to the next.
            transfers = (s > 0) + (s < len(pipeline.stages) - 1)
            work_forward += transfers * transfer
            work_backward += transfers * transfer
            stages.append(HostStage(
                node=node, processes=stage.tp,
                slowdown=spec.slowdown, work_forward_s=work_forward,
                work_backward_s=work_backward, wait_forward_s=tp_forward,
                wait_backward_s=tp_backward, p2p_forward_s=row.p2p_forward_s,
                p2p_backward_s=row.p2p_backward_s, slowed_forward_s=slowed_forward,
                slowed_backward_s=slowed_backward))
        pipelines.append(stages)
    result = simulate_shared_host(pipelines, [pp.micro_batches for pp in ctx.plan.pipelines],
                                  sharing)
    return SharedHostTimes(result.makespans_s, _dp_sync(ctx, rows, sharing),
                           _optimizer(ctx, rows, sharing), _overhead(ctx))


def _transfer_cpu_s(ctx: Any) -> float:
    """CPU seconds one end spends on a stage-boundary transfer: the host's measured gloo p2p
    time of the activations (a loopback copy runs on the CPUs of both ends); 0 unmeasured."""
    rank = ctx.plan.ranks()[0]
    profile = choose_profile(ctx.comm.spec_of(rank), ctx.profiles).profile
    entry = None if profile is None else profile.comm_figures("p2p", "intra_node")
    if entry is None:
        return 0.0
    return entry.latency_s + ctx.act_bytes / (entry.bandwidth_gbps * 1e9)


def _dp_sync(ctx: Any, rows: Sequence["StagePrediction"],
             sharing: dict[int, HostSharing]) -> float:
    """The slowest stage's gradient sync, slowed as CPU work: gloo copies and reduces on the
    host's cores, and every rank of a stage with dp > 1 syncs at once."""
    syncing: dict[int, int] = {}
    for row in rows:
        if row.dp_sync_s > 0:
            for rank in row.ranks:
                node = ctx.comm.node_of(rank)
                syncing[node] = syncing.get(node, 0) + 1
    if not syncing:
        return 0.0
    slowest = max(
        sharing[node].factor(count) if node in sharing else 1.0 for node, count in syncing.items())
    return max(row.dp_sync_s for row in rows) * slowest


def _optimizer(ctx: Any, rows: Sequence["StagePrediction"],
               sharing: dict[int, HostSharing]) -> float:
    """Every rank's step at host speed, all at once, sharing each node."""
    works: dict[int, list[float]] = {}
    for row in rows:
        spec = ctx.comm.spec_of(row.ranks[0])
        slowdown = spec.slowdown if spec.emulated else 1.0
        # row.optimizer_s carries the kind's slowdown; the emulated run does not wait it out.
        per_rank = row.optimizer_s / slowdown
        for rank in row.ranks:
            works.setdefault(ctx.comm.node_of(rank), []).append(per_rank)
    return max(sharing[node].finish_time(w) if node in sharing else max(w)
               for node, w in works.items())


def _overhead(ctx: Any) -> float:
    ranks = list(ctx.plan.ranks())
    if len(ranks) <= 1:
        return 0.0
    one = ctx.comm.dp_sync(ranks, WORLD_COLLECTIVE_BYTES).time_s
    return WORLD_COLLECTIVES_PER_ITERATION * one


__all__ = ["CROSS_ENTROPY_COLLECTIVES", "SharedHostTimes", "WORLD_COLLECTIVES_PER_ITERATION",
           "WORLD_COLLECTIVE_BYTES", "host_sharing_by_node", "shared_host_times",
           "tp_collectives"]
