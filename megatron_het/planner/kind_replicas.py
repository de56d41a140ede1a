"""Heterogeneous data parallelism in the planner: every kind runs replicas of its own pipeline.

The layouts of :mod:`megatron_het.planner.space` make every DP replica the same pipeline across
the kinds. This family gives each accelerator kind ``k`` its own ``dp_k`` replicas of a
pipeline made of that kind alone (its own TP degree, stage count, recompute and layer split),
and shares the global batch by speed (HexiScale / Metis style): every replica of kind ``k``
runs ``m_k`` micro-batches of the plan's one micro-batch size, with
``sum_k dp_k m_k = global batch / micro-batch size``. No activation crosses between kinds;
the gradients do, once per iteration (each parameter summed over every replica that holds it,
:mod:`megatron_het.perf.cost.dp_sync`, with full-size buffers that the memory check counts).

Search, per plan-wide setting (ZeRO-1 off or on, sequence parallelism with it) and micro-batch
size (a "family"):

1. every kind's single-kind layouts on its own devices
   (:func:`~megatron_het.cluster.kind_subcluster`,
   :func:`~megatron_het.planner.space.pipeline_shapes`) get lower bounds: a line
   ``C + c m`` under their pipeline time in ``m`` micro-batches
   (:func:`~megatron_het.planner.bounds.time_lower_bound`) and their largest device group's
   cross-kind sync (:meth:`ReplicaSearch._sync_bound`); the family's bound is the least
   slowest-replica time the kinds' layouts can share the batch in, plus the least sync;
2. families are taken by increasing bound while it is under the closed-form time of the best
   plan of identical replicas (and of the best family found); in each, every kind's
   :data:`PROBED_LAYOUTS` most promising layouts are probed into stage models
   (:func:`~megatron_het.planner.stage_model.probe_stage_model`, at ``m = stages``, the most
   micro-batches in flight; memory raised by the replica sums' full-size buffers; recompute
   where a layout needs it to fit), which make the lines exact for the 1F1B closed form;
3. :func:`allocate` picks a layout and a share per kind: the least slowest pipeline plus the
   largest sync, over every cap on the sync (:func:`shares_by_speed`: bisection on the
   slowest replica's time, then shares that add up exactly, :func:`exact_shares`); the chosen
   splits are rebalanced at their shares and the shares found again (twice);
4. the assembled plan is predicted in full (simulation, the cross-kind DP sync, memory) and
   returned as a candidate beside the identical-replica layouts'.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from megatron_het.cluster import ClusterSpec, kind_subcluster
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.replicas import ReplicaUnit
from megatron_het.parallel.stage_plan import PipelinePlan
from megatron_het.perf import Prediction, Profile, SimulationCache, fits, predict
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.perf.cost.dp_sync import unit_parameters
from megatron_het.perf.cost.memory import layer_parameters
from megatron_het.perf.cost.roofline import DTYPE_BYTES, FP32_BYTES
from megatron_het.planner.batch_shares import allocate, shares_by_speed
from megatron_het.planner.bounds import KindCosts, memory_feasible, time_lower_bound
from megatron_het.planner.space import (
    Layout,
    Placement,
    build_plan,
    micro_batch_sizes,
    pipeline_shapes,
)
from megatron_het.planner.stage_model import Affine, StageModel, balance_layers, probe_stage_model

# Per kind and family, how many of its layouts are probed (those with the least bound at the
# bound's batch share): the bound orders them well, and probes of thousands of devices cost.
PROBED_LAYOUTS = 3


@dataclass(frozen=True)
class KindPart:
    """One kind's replicas: ``layout`` over that kind's devices alone (its ``dp`` replicas,
    ``micro_batches`` each) and the layer count of every stage."""

    kind: str
    layout: Layout
    layers: tuple[int, ...]


@dataclass(frozen=True)
class ReplicaLayout:
    """A heterogeneous-DP layout: one :class:`KindPart` per kind, in the cluster's kind order.

    Quacks like :class:`~megatron_het.planner.space.Layout` where reports read one."""

    parts: tuple[KindPart, ...]
    micro_batch_size: int
    zero1: bool
    sequence_parallel: bool = False
    num_chunks: int = 1

    @property
    def dp(self) -> int:
        return sum(part.layout.dp for part in self.parts)

    def describe(self) -> str:
        kinds = " + ".join(
            f"{p.layout.dp}x [{_blocks(p.layout)}] m={p.layout.micro_batches}" for p in self.parts
        )
        return (
            f"hetero-dp dp={self.dp} {kinds} mbs={self.micro_batch_size}"
            f"{' zero1' if self.zero1 else ''}{' sp' if self.sequence_parallel else ''}"
        )


def _blocks(layout: Layout) -> str:
    return " -> ".join(
        f"{b.stages}x {b.kind} tp={b.tp}{' rc' if b.recompute else ''}" for b in layout.blocks
    )


@dataclass(frozen=True)
class _Option:
    """A kind's layout: ``time(m) = fixed + per_micro_batch * m`` for one replica's pipeline
    and optimizer, ``sync`` its largest device group's cross-kind sync (bounds where
    ``model`` is None, else from its probed stage model with the split ``layers``)."""

    layout: Layout
    layers: tuple[int, ...]
    fixed: float
    per_micro_batch: float
    sync: float = 0.0
    model: StageModel | None = None
    kind: _Kind | None = None

    def most_micro_batches(self, budget: float) -> int:
        """The most micro-batches a replica runs within ``budget`` seconds (0: none)."""
        return max(0, math.floor((budget - self.fixed) / self.per_micro_batch + 1e-9))


class _Kind:
    """One kind's devices as a cluster of their own, and the map of its ranks into the mix."""

    def __init__(
        self,
        kind: str,
        cluster: ClusterSpec,
        placement: Placement,
        profiles: Mapping[str, Profile] | None,
    ) -> None:
        self.kind = kind
        self.cluster = kind_subcluster(cluster, kind)
        self.placement = Placement(self.cluster)
        self.comm = CommCost(self.cluster, profiles)
        self._costs: KindCosts | None = None
        mine, mixed = self.placement.ranks_of[kind], placement.ranks_of[kind]
        self.rank_in_mix = dict(zip(mine, mixed))
        # a TP group is node-local alone iff it is in the mix: same-node neighbours agree
        self.consistent = len(mine) == len(mixed) and all(
            (self.placement.node_of[a] == self.placement.node_of[b])
            == (placement.node_of[c] == placement.node_of[d])
            for a, b, c, d in zip(mine, mine[1:], mixed, mixed[1:])
        )

    def costs(self, search: ReplicaSearch) -> KindCosts:
        """The per-layer costs of this kind's devices alone (built once)."""
        if self._costs is None:
            self._costs = KindCosts(
                search.model,
                self.cluster,
                self.placement,
                search.seq_length,
                search.profiles,
                search.dtype,
                search.cache,
                search.fused_elementwise,
            )
        return self._costs


@dataclass
class ReplicaSearch:
    """Search the heterogeneous-DP family of one planner search (see the module docstring)."""

    model: ModelConfig
    cluster: ClusterSpec
    placement: Placement
    global_batch_size: int
    seq_length: int
    profiles: Mapping[str, Profile] | None
    dtype: str
    check_memory: bool
    cache: SimulationCache
    comm: CommCost
    fused_elementwise: bool = True
    probes: int = 0
    _kinds: list[_Kind] = field(default_factory=list)

    def candidates(
        self, max_micro_batch_size: int, keep: int, beat: float = math.inf
    ) -> list[tuple[ReplicaLayout, ParallelPlan, Prediction, float]]:
        """The ``keep`` fastest heterogeneous-DP plans that fit, predicted in full:
        (layout, plan, simulated prediction, closed-form iteration seconds), fastest first.
        Settings and micro-batch sizes are tried by increasing lower bound until it passes
        ``beat`` (the closed-form time of the best plan found otherwise) or the found ones."""
        found: list[tuple[float, ReplicaLayout, ParallelPlan]] = []
        for bound, family in self._families(max_micro_batch_size):
            if bound * (1 - 1e-6) >= min([beat] + [t for t, _, _ in found][:keep]):
                break
            built = self._allocate(*family)
            if built is None:
                continue
            layout, plan = built
            estimate = predict(
                self.model,
                plan,
                self.cluster,
                self.seq_length,
                self.profiles,
                options=RunOptions.from_plan(
                    plan, dtype=self.dtype, fused_elementwise=self.fused_elementwise
                ),
                pipeline_model="closed_form",
                cache=self.cache,
                validate=False,
                comm=self.comm,
            )
            found.append((estimate.iteration_time_s, layout, plan))
            found.sort(key=lambda item: item[0])
        out = []
        for closed, layout, plan in found[:keep]:
            prediction = predict(
                self.model,
                plan,
                self.cluster,
                self.seq_length,
                self.profiles,
                options=RunOptions.from_plan(
                    plan, dtype=self.dtype, fused_elementwise=self.fused_elementwise
                ),
                cache=self.cache,
                comm=self.comm,
                validate=False,
            )
            if self.check_memory and not fits(prediction, self.cluster).ok:
                continue
            out.append((layout, plan, prediction, closed))
        out.sort(key=lambda item: item[2].iteration_time_s)
        return out

    def _families(
        self, max_micro_batch_size: int
    ) -> list[tuple[float, tuple[int, bool, bool, list[list[_Option]]]]]:
        """Every (setting, micro-batch size) with its kinds' bounded layouts, by increasing
        lower bound on its time (none for a cluster of one kind, or whose kinds' devices do
        not keep their node grouping alone)."""
        if len(self.placement.kinds) < 2:
            return []
        self._kinds = [
            _Kind(k, self.cluster, self.placement, self.profiles) for k in self.placement.kinds
        ]
        if not all(k.consistent for k in self._kinds):
            return []
        out = []
        for zero1, sp in ((False, False), (True, False), (True, True)):
            for mbs in micro_batch_sizes(self.global_batch_size, 1, max_micro_batch_size):
                bounded = [self._bounded(k, mbs, zero1, sp) for k in self._kinds]
                total = self.global_batch_size // mbs
                if not all(bounded) or total < sum(min(o.layout.dp for o in b) for b in bounded):
                    continue
                picks = shares_by_speed(bounded, total)
                if picks is not None:  # the least pipeline time + the least any kind syncs
                    bound = max(o.fixed + o.per_micro_batch * m for o, m in picks) + max(
                        min(o.sync for o in opts) for opts in bounded
                    )
                    out.append((bound, (mbs, zero1, sp, bounded)))
        out.sort(key=lambda item: item[0])
        return out

    def _bounded(self, kind: _Kind, mbs: int, zero1: bool, sp: bool) -> list[_Option]:
        """The kind's single-kind layouts that may fit (recompute where the layout needs it by
        the per-layer bytes), each with the lower bound of its replica's time as its line
        (:func:`~megatron_het.planner.bounds.time_lower_bound`, plus the least cross-kind
        sync of its largest stage)."""
        costs = kind.costs(self)
        num_layers = self.model.num_layers
        out = []
        for dp, blocks in pipeline_shapes(self.model, kind.placement):
            if sp and (
                not any(b.tp > 1 for b in blocks) or any(self.seq_length % b.tp for b in blocks)
            ):
                continue
            for recompute in (False, True):
                layout = Layout(
                    dp,
                    tuple(replace(b, recompute=recompute) for b in blocks),
                    mbs,
                    1,
                    zero1 and dp > 1,
                    1,
                    sp,
                )
                if self.check_memory and not memory_feasible(
                    replace(layout, micro_batches=layout.num_stages), costs, num_layers
                ):
                    continue
                one, two = (
                    time_lower_bound(
                        replace(layout, micro_batches=m), costs, num_layers, tight=False
                    )
                    for m in (1, 2)
                )
                out.append(
                    _Option(
                        layout, (), 2 * one - two, two - one, self._sync_bound(kind, layout, zero1)
                    )
                )
                break
        return out

    def _sync_bound(self, kind: _Kind, layout: Layout, zero1: bool) -> float:
        """The least time the replica sums take on the stage with the most layers (at least
        ``L / stages``) of ``layout``: :meth:`_sync_estimate` of its decoder layers alone."""
        return self._ring_sync(
            kind,
            layout,
            zero1,
            math.ceil(self.model.num_layers / layout.num_stages) * layer_parameters(self.model, 1),
        )

    def _sync_estimate(
        self, kind: _Kind, layout: Layout, layers: Sequence[int], zero1: bool
    ) -> float:
        """The replica sums of the stage of ``layers`` with the most parameters (the
        embedding's and head's included), as :meth:`_ring_sync` prices them."""
        params = max(
            n * layer_parameters(self.model, 1) + _fixed_parameters(self.model, s, len(layers))
            for s, n in enumerate(layers)
        )
        return self._ring_sync(kind, layout, zero1, params)

    def _ring_sync(self, kind: _Kind, layout: Layout, zero1: bool, params: float) -> float:
        """The all-reduce of ``params`` full-size gradients (and under ZeRO-1 the updated
        rows) over one rank of each of the kind's replicas and one of every other kind: fewer
        members than any real unit's holders."""
        share, tp = self.placement.count(kind.kind) // layout.dp, layout.blocks[0].tp
        ring = [
            r
            for d in range(layout.dp)
            for r in self.placement.ranks_of[kind.kind][d * share : d * share + tp]
        ]
        ring += [self.placement.ranks_of[k][0] for k in self.placement.kinds if k != kind.kind]
        time = self.comm.dp_sync(ring, params * FP32_BYTES).time_s
        if zero1:  # the owners' updated rows, summed to every holder after the step
            time += self.comm.dp_sync(ring, params * DTYPE_BYTES[self.dtype]).time_s
        return time

    def _allocate(
        self, mbs: int, zero1: bool, sp: bool, bounded: list[list[_Option]]
    ) -> tuple[ReplicaLayout, ParallelPlan] | None:
        """Probe each kind's most promising layouts (by their bound at the bound's shares),
        share the batch by their probed speeds, rebalance the chosen splits at their shares
        (twice) and build the plan."""
        total = self.global_batch_size // mbs
        found = allocate(bounded, total)
        if found is None:
            return None
        picks, options = found[0], []
        for kind, opts, (pick, m) in zip(self._kinds, bounded, picks):
            samples = pick.layout.dp * m  # the kind's share of the batch at the bound

            def share(o: _Option) -> int:
                return max(1, math.ceil(samples / o.layout.dp))

            ranked = sorted(opts, key=lambda o: o.fixed + o.per_micro_batch * share(o) + o.sync)
            probed = [
                self._rebalanced(p, share(p), zero1)
                for p in (self._probe(kind, o.layout, zero1) for o in ranked[:PROBED_LAYOUTS])
                if p is not None
            ]
            if not probed:
                return None
            options.append(probed)
        chosen = allocate(options, total)
        for _ in range(2):
            if chosen is None:
                return None
            options = [[self._rebalanced(o, m, zero1)] for o, m in chosen[0]]
            chosen = allocate(options, total)
        if chosen is None:
            return None
        picks = chosen[0]
        parts = tuple(
            KindPart(k.kind, replace(o.layout, micro_batches=m), o.layers)
            for k, (o, m) in zip(self._kinds, picks)
        )
        layout = ReplicaLayout(
            parts, mbs, zero1, sp and any(b.tp > 1 for p in parts for b in p.layout.blocks)
        )
        return layout, self._plan(layout)

    def _probe(self, kind: _Kind, layout: Layout, zero1: bool) -> _Option | None:
        """The layout's stage model (its memory with the replica buffers, at its most
        micro-batches in flight), balanced; with recompute when it does not fit without."""
        recomputed = replace(
            layout, blocks=tuple(replace(b, recompute=True) for b in layout.blocks)
        )
        for attempt in dict.fromkeys((layout, recomputed)):
            self.probes += 1
            attempt = replace(attempt, micro_batches=attempt.num_stages)
            sm = probe_stage_model(
                self.model,
                attempt,
                kind.placement,
                kind.cluster,
                self.seq_length,
                self.profiles,
                self.dtype,
                self.cache,
                kind.comm,
                self.fused_elementwise,
            )
            sm = _with_replica_buffers(sm, self.model)
            layers = balance_layers(sm, self.model.num_layers, check_memory=self.check_memory)
            if layers is not None:
                return self._line(kind, sm, layers, zero1)
        return None

    def _line(self, kind: _Kind, sm: StageModel, layers: Sequence[int], zero1: bool) -> _Option:
        """The option of a probed layout with split ``layers``: its closed-form pipeline +
        optimizer time at 1 and 2 micro-batches, plus its sync estimate."""
        at = [sm_at(sm, m).iteration_time(layers) for m in (1, 2)]
        sync = self._sync_estimate(kind, sm.layout, layers, zero1)
        return _Option(sm.layout, tuple(layers), 2 * at[0] - at[1], at[1] - at[0], sync, sm, kind)

    def _rebalanced(self, option: _Option, micro_batches: int, zero1: bool) -> _Option:
        """``option`` with its split balanced at ``micro_batches`` (memory as probed)."""
        assert option.model is not None and option.kind is not None
        sm = sm_at(option.model, micro_batches)
        layers = balance_layers(sm, self.model.num_layers, check_memory=self.check_memory)
        if layers is None or sm.iteration_time(layers) >= sm.iteration_time(option.layers):
            return option
        return self._line(option.kind, option.model, layers, zero1)

    def _plan(self, layout: ReplicaLayout) -> ParallelPlan:
        pipelines: list[PipelinePlan] = []
        for kind, part in zip(self._kinds, layout.parts):
            alone = build_plan(part.layout, part.layers, kind.placement, self.dtype)
            for pipeline in alone.pipelines:
                pipelines.append(
                    PipelinePlan.trusted(
                        pipeline.micro_batches,
                        tuple(
                            replace(stage, ranks=tuple(kind.rank_in_mix[r] for r in stage.ranks))
                            for stage in pipeline.stages
                        ),
                    )
                )
        return ParallelPlan(
            layout.micro_batch_size,
            tuple(pipelines),
            dtype=self.dtype,
            use_distributed_optimizer=layout.zero1,
            sequence_parallel=layout.sequence_parallel or None,
            tp_comm_overlap=layout.sequence_parallel or None,
            description=f"megatron_het planner: {layout.describe()}",
        )


def sm_at(sm: StageModel, micro_batches: int) -> StageModel:
    """``sm`` with ``micro_batches`` per replica and no DP sync (the replicas of other kinds
    change it; the full prediction prices it)."""
    zero = tuple(Affine(0.0, 0.0) for _ in sm.dp_sync)
    return replace(sm, layout=replace(sm.layout, micro_batches=micro_batches), dp_sync=zero)


def _fixed_parameters(model: ModelConfig, stage: int, num_stages: int) -> int:
    """Full-size parameters stage ``stage`` of a pipeline holds besides its decoder layers
    (the replica units it is a holder of, :func:`~megatron_het.perf.cost.dp_sync.unit_parameters`):
    the embedding on the first stage (and on the last one's copy of a tied embedding), the
    head on the last."""
    params = 0
    last = stage == num_stages - 1
    if stage == 0 or (last and model.tie_embeddings):
        params += unit_parameters(model, ReplicaUnit("embedding"))
    if last:
        params += unit_parameters(model, ReplicaUnit("head"))
    return params


def _with_replica_buffers(sm: StageModel, model: ModelConfig) -> StageModel:
    """``sm`` whose memory holds the replica sums' full-size float32 buffers of every
    parameter a stage holds (:meth:`~megatron_het.perf.cost.dp_sync.DPSync.buffer_bytes`)."""
    per_layer = layer_parameters(model, 1) * FP32_BYTES
    memory = tuple(
        Affine(
            line.intercept + _fixed_parameters(model, s, sm.num_stages) * FP32_BYTES,
            line.slope + per_layer,
        )
        for s, line in enumerate(sm.memory)
    )
    return replace(sm, memory=memory)


__all__ = [
    "KindPart",
    "ReplicaLayout",
    "ReplicaSearch",
]
