"""The iteration of a plan whose ranks are processes sharing host CPUs (CPU-emulated kinds).

:class:`SharedHostModel` is the predictor's rate model for emulated clusters
(:class:`~megatron_het.perf.cost.rate_model.RateModel`: ``predict(...,
rate_model=SharedHostModel())``). It applies when every rank of the plan is of an emulated kind and
the host profile of each has :attr:`~megatron_het.perf.measure.profile_format.Profile.host_sharing`
figures; otherwise it returns None and each rank is taken to own its device.

What changes against the one-device-per-rank model, each from a measured figure:

- pipeline: every pipeline runs at once in the predictor's simulator on the shared cores
  (:class:`~megatron_het.emulation.host_sharing.HostCores`) with the stage's compute as host CPU
  seconds (the profile's times without the slowdown), the TP collectives inside the compute
  region (with :attr:`Profile.host_collective_s`, the measured wall and CPU time of one
  collective between computing peers: its CPU time as work on the shared cores, the rest as a
  wait; else the link model's all-reduce as a wait; under sequence parallelism a reduce-scatter
  or all-gather counts half a measured collective, by its bytes; with ``tp_comm_overlap`` each
  step of a layer's rings (a rank's block sent and one received) is two measured gloo
  transfers as CPU work and half a measured collective's wait for its peers: on shared cores
  nothing is left for the GEMMs to hide it behind), each stage-boundary
  transfer's measured gloo time as CPU work at both ends (per chunk of an interleaved device
  group: each receives and sends its micro-batches; a rank's ``1/tp`` of the activations under
  sequence parallelism), and the slowdown as the region's floor, a wait that frees
  the core: the executor's :class:`~megatron_het.emulation.emulator.Emulator` (CPU basis) pads
  a region to ``slowdown x`` the CPU time of the rank's own thread, the stage's compute without
  gloo's share;
- DP gradient sync: the host's part of it (the sync over the host's own gloo figures, the
  emulated links' pace left out; per device group, over its replica units when the pipelines'
  layouts differ) is CPU work slowed by the host sharing of the ranks that sync
  at once only for its CPU share (gloo copies and reduces on the CPU, and waits on its
  peers and the loopback for the rest: the share the measured TP collective spends on CPU,
  :attr:`Profile.host_collective_s`, else all of it); an emulated link's pace is a wait that
  frees the core, so the sync takes the longer of that and the link model's time;
- optimizer step: every rank steps at once after the gradient sync; the emulator slows only the
  pipeline's compute regions, so the step runs at host speed, sharing the host
  (:meth:`HostSharing.finish_time` of the measured per-parameter time);
- per-iteration overhead: the driver's two world collectives of a few numbers per iteration (the
  gathered loss/timing table and the global gradient norm), each costed as a mixed-kind
  all-reduce of a few bytes with the measured gloo latency.

Everything here is emulation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_het.emulation.host_sharing import HostCores, HostSharing
from megatron_het.parallel.stage_plan import PipelinePlan
from megatron_het.perf.cost.boundary_time import rank_activation_bytes
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.perf.cost.compute_time import choose_profile
from megatron_het.perf.cost.rate_model import PredictionInputs, SharedIteration
from megatron_het.perf.cost.tp_collectives import REGATHERS, ring_collectives
from megatron_het.perf.estimates import StagePrediction
from megatron_het.perf.schedule.simulator import Region, StageTiming

# The world collectives the driver runs per iteration besides the pipeline's and the DP sync's:
# the all-gather of every rank's loss/stop/timing row and the global gradient-norm all-reduce.
WORLD_COLLECTIVES_PER_ITERATION = 2
WORLD_COLLECTIVE_BYTES = 64


def host_sharing_by_node(inputs: PredictionInputs) -> dict[int, HostSharing] | None:
    """Per node, the host figures when every rank of the plan is emulated and its host profile
    has them; None otherwise."""
    out: dict[int, HostSharing] = {}
    for rank in inputs.plan.ranks():
        spec = inputs.comm.spec_of(rank)
        profile = choose_profile(spec, inputs.profiles).profile
        if not spec.emulated or profile is None or not profile.host_sharing:
            return None
        out.setdefault(inputs.comm.node_of(rank), HostSharing(profile.host_sharing))
    return out


class SharedHostModel:
    """The rate model of ranks sharing host cores (see the module docstring)."""

    def shared_iteration(
        self, inputs: PredictionInputs, rows: Sequence[StagePrediction]
    ) -> SharedIteration | None:
        sharing = host_sharing_by_node(inputs)
        if sharing is None:
            return None
        cores = HostCores(sharing)
        row_of = {(r.pipeline, r.stage): r for r in rows}
        transfer = _transfer_cpu_s(inputs)
        stages = tuple(
            tuple(
                _stage_timing(inputs, p, s, pipeline, row_of[(p, s)], transfer)
                for s in range(pipeline.num_stages)
            )
            for p, pipeline in enumerate(inputs.plan.pipelines)
        )
        return SharedIteration(
            stages,
            cores,
            _dp_sync(inputs, rows, cores),
            _optimizer(inputs, rows, cores),
            _overhead(inputs),
        )

    def __repr__(self) -> str:
        return "SharedHostModel() (emulation)"


def _stage_timing(
    inputs: PredictionInputs,
    p: int,
    s: int,
    pipeline: PipelinePlan,
    row: StagePrediction,
    transfer: float,
) -> StageTiming:
    """Stage ``s`` of pipeline ``p`` (a chunk of its device group when interleaved) on its
    host: CPU work, in-region waits and the floor."""
    stage = pipeline.stages[s]
    spec = inputs.comm.spec_of(stage.ranks[0])
    compute = inputs.compute(s, pipeline)
    tp_forward, tp_backward = inputs.tp_comm(s, pipeline)
    counts = inputs.tp_collectives(s, pipeline)
    work_forward = slowed_forward = compute.forward_s / spec.slowdown
    work_backward = slowed_backward = compute.backward_s / spec.slowdown
    host = choose_profile(spec, inputs.profiles).profile
    if stage.tp > 1 and host is not None and host.host_collective_s:
        # Measured per collective: its CPU share is work on the shared cores, the rest a wait;
        # both replace the link model's all-reduce.
        wall, cpu = host.host_collective_s
        forward_all, backward_all = counts.forward_all, counts.backward_all
        tp_rings = (0.0, 0.0)
        if inputs.tp_comm_overlap and counts.forward_gathers:
            # The layers' gathers and reduce-scatters are rings of tp - 1 steps each (the
            # backward's with the inputs' second gathers); the rest stay collectives, of
            # which a gather or reduce-scatter counts half.
            layers = stage.num_layers
            rings = ring_collectives(layers, min(inputs.recomputed_layers_of(stage), layers))
            forward_all -= rings[0] / 2
            backward_all -= rings[1] / 2
            steps = (rings[0] * (stage.tp - 1), (rings[1] + REGATHERS * layers) * (stage.tp - 1))
            # A step sends one block and receives one: two transfers' CPU time, as a
            # boundary's two ends count; and it waits for its peers as half a measured
            # collective does.
            step = 2 * _transfer_cpu_s(inputs, inputs.act_bytes / stage.tp)
            work_forward += steps[0] * step
            work_backward += steps[1] * step
            tp_rings = ((wall - cpu) / 2 * steps[0], (wall - cpu) / 2 * steps[1])
        work_forward += forward_all * cpu
        work_backward += backward_all * cpu
        tp_forward = forward_all * (wall - cpu) + tp_rings[0]
        tp_backward = backward_all * (wall - cpu) + tp_rings[1]
    # Each way, a micro-batch is received from the stage before and sent to the next (every
    # chunk of an interleaved group does both, but for the pipeline's first input and last
    # output).
    transfers = (s > 0) + (s < pipeline.num_stages - 1)
    if inputs.plan.sequence_parallel:  # a rank moves its positions only
        transfer = _transfer_cpu_s(
            inputs, rank_activation_bytes(inputs.plan, stage, inputs.act_bytes)
        )
    work_forward += transfers * transfer
    work_backward += transfers * transfer
    return StageTiming(
        Region(work_forward, tp_forward, spec.slowdown * slowed_forward),
        Region(work_backward, tp_backward, spec.slowdown * slowed_backward),
        row.p2p_forward_s,
        row.p2p_backward_s,
        inputs.comm.node_of(stage.ranks[0]),
        stage.tp,
    )


def _transfer_cpu_s(inputs: PredictionInputs, nbytes: float | None = None) -> float:
    """CPU seconds one end spends on a stage-boundary transfer: the host's measured gloo p2p
    time of the activations (``nbytes``, default all of them; a loopback copy runs on the CPUs
    of both ends); 0 unmeasured."""
    rank = inputs.plan.ranks()[0]
    profile = choose_profile(inputs.comm.spec_of(rank), inputs.profiles).profile
    entry = None if profile is None else profile.comm_figures("p2p", "intra_node")
    if entry is None:
        return 0.0
    nbytes = inputs.act_bytes if nbytes is None else nbytes
    return entry.latency_s + nbytes / (entry.bandwidth_gbps * 1e9)


def _dp_sync(inputs: PredictionInputs, rows: Sequence[StagePrediction], cores: HostCores) -> float:
    """The slowest stage's gradient sync: its host part (gloo copies and reduces) slowed as CPU
    work on the host's cores, where every rank of a stage with dp > 1 syncs at once, or the
    link model's time where an emulated link's pace (a wait) takes longer. (An interleaved
    device group syncs all its chunks at once: its rows carry that sync, its ranks count
    once.)"""
    syncing: dict[int, int] = {}
    for rank in _ranks_of(rows, lambda row: row.dp_sync_s > 0):
        node = inputs.comm.node_of(rank)
        syncing[node] = syncing.get(node, 0) + 1
    if not syncing:
        return 0.0
    slowest = max(cores.factor(node, count) for node, count in syncing.items())
    cpu_share = _collective_cpu_share(inputs)
    slowed = cpu_share * slowest + (1.0 - cpu_share)
    host = CommCost(inputs.comm.cluster, inputs.profiles, paced_links=False)
    return max(
        max(row.dp_sync_s, inputs.dp_sync_over(host, row.stage, row.pipeline).time_s * slowed)
        for row in rows
        if row.dp_sync_s > 0
    )


def _collective_cpu_share(inputs: PredictionInputs) -> float:
    """The share of a host collective's wall time spent on the CPU (the measured TP
    collective's CPU / wall time; 1 where unmeasured)."""
    rank = inputs.plan.ranks()[0]
    profile = choose_profile(inputs.comm.spec_of(rank), inputs.profiles).profile
    if profile is None or not profile.host_collective_s:
        return 1.0
    wall, cpu = profile.host_collective_s
    return min(1.0, cpu / wall) if wall > 0 else 1.0


def _optimizer(
    inputs: PredictionInputs, rows: Sequence[StagePrediction], cores: HostCores
) -> float:
    """Every rank's step at host speed, all at once, sharing each node (a row carries its
    device's step over all its chunks, so a rank of an interleaved group counts once)."""
    works: dict[int, list[float]] = {}
    seen: set[int] = set()
    for row in rows:
        spec = inputs.comm.spec_of(row.ranks[0])
        slowdown = spec.slowdown if spec.emulated else 1.0
        # row.optimizer_s carries the kind's slowdown; the emulated run does not wait it out.
        per_rank = row.optimizer_s / slowdown
        for rank in row.ranks:
            if rank not in seen:
                seen.add(rank)
                works.setdefault(inputs.comm.node_of(rank), []).append(per_rank)
    return max(
        cores.sharing[node].finish_time(w) if node in cores.sharing else max(w)
        for node, w in works.items()
    )


def _ranks_of(
    rows: Sequence[StagePrediction], keep: Callable[[StagePrediction], bool]
) -> list[int]:
    """The distinct ranks of the rows ``keep`` selects, in order of first appearance."""
    return list(dict.fromkeys(rank for row in rows if keep(row) for rank in row.ranks))


def _overhead(inputs: PredictionInputs) -> float:
    ranks = list(inputs.plan.ranks())
    if len(ranks) <= 1:
        return 0.0
    one = inputs.comm.dp_sync(ranks, WORLD_COLLECTIVE_BYTES).time_s
    return WORLD_COLLECTIVES_PER_ITERATION * one


__all__ = [
    "SharedHostModel",
    "WORLD_COLLECTIVES_PER_ITERATION",
    "WORLD_COLLECTIVE_BYTES",
    "host_sharing_by_node",
]
