"""Per-stage costs of a layout as affine functions of the stage's layer count, and the split.

Every figure the predictor gives per stage is affine in that stage's number of decoder layers
``l >= 1`` once the layout is fixed: compute and TP communication per micro-batch, the DP
gradient sync (bytes grow with the parameters), the optimizer step and the peak memory; the p2p
times do not depend on ``l``. :func:`probe_stage_model` reads the slopes and intercepts from two
closed-form predictions of the layout (every stage with 1 layer, then with 2), so the layer split
can be optimised without calling the predictor again: :meth:`StageModel.iteration_time` is the
predictor's closed-form iteration time of any split, its pipeline priced by the predictor's own
:func:`~megatron_het.perf.schedule.closed_forms.closed_form_pipeline`
(``tests/unit/test_planner_prices_as_predictor.py`` checks both against each other on every
stage model real searches build).

An interleaved layout (``v`` chunks per device group) is modelled per device group: ``l`` is
the group's layers (at least ``v``, dealt out over its chunks), its compute the sum over its
chunks (still affine: the embedding and head sit on fixed chunks), probed at ``v`` and ``2 v``
layers per group; the pipeline time is the interleaved closed form over its chunks, with the
transfers overlapped with compute (the runtime's default). Its memory is exact where ``v``
divides ``l`` and interpolated between (the held chunks' sizes then depend on which chunks are
larger); the final plans are checked.

:func:`balance_layers` finds the split: the smallest 1F1B cycle bottleneck that fits the layers
under every stage's memory (bisection), excess layers taken from the stages slowest per layer,
then single-layer moves while they lower the iteration time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.perf import Prediction, Profile, SimulationCache, predict
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.perf.cost.memory import RESERVED_FRACTION, device_capacity_bytes
from megatron_het.perf.schedule.closed_forms import closed_form_pipeline
from megatron_het.planner.space import Layout, Placement, build_plan


@dataclass(frozen=True)
class Affine:
    """``intercept + slope * l``."""

    intercept: float
    slope: float

    def __call__(self, layers: float) -> float:
        return self.intercept + self.slope * layers


@dataclass(frozen=True)
class StageModel:
    """One layout's per-stage costs; index ``s`` is the stage in pipeline order.

    ``p2p`` holds one (forward, backward) boundary-time pair of lists per distinct pipeline
    (pipelines differ only in which node boundaries they cross; per chunk boundary when
    interleaved); ``usable_bytes`` is what :func:`megatron_het.perf.fits` allows on the
    stage's devices. With interleaving a stage here is a device group (see the module
    docstring) and ``chunk_fixed[g][c]`` the parts of its chunk c's forward and backward that
    do not grow with the chunk's layers (the embedding's, the head's).
    """

    layout: Layout
    forward: tuple[Affine, ...]
    backward: tuple[Affine, ...]
    dp_sync: tuple[Affine, ...]
    optimizer: tuple[Affine, ...]
    memory: tuple[Affine, ...]
    usable_bytes: tuple[float, ...]
    p2p: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...]
    chunk_fixed: tuple[tuple[tuple[float, float], ...], ...] = ()  # [group][chunk]: (f, b)

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @property
    def min_layers(self) -> int:
        """The fewest layers a stage (device group) may hold: one per chunk."""
        return self.layout.num_chunks

    def steady_p2p(self) -> list[list[float]]:
        """Per distinct pipeline, per stage: the p2p time in its steady-state 1F1B cycle (0
        when interleaved: the closed form counts the transfers per exchange instead)."""
        out = []
        p = self.num_stages
        if self.layout.num_chunks > 1:
            return [[0.0] * p for _ in self.p2p]
        for cf, cb in self.p2p:
            out.append(
                [
                    (max(cf[s], cb[s]) if s < p - 1 else 0.0)
                    + (max(cf[s - 1], cb[s - 1]) if s > 0 else 0.0)
                    for s in range(p)
                ]
            )
        return out

    def iteration_time(self, layers: Sequence[int]) -> float:
        """The closed-form iteration time (pipeline + DP sync + optimizer) of a split; equal to
        ``predict(..., pipeline_model="closed_form").iteration_time_s`` of its plan: the
        pipeline is priced by the predictor's own
        :func:`~megatron_het.perf.schedule.closed_forms.closed_form_pipeline` over the
        per-stage (per-chunk) times the lines give (the slowest of the distinct pipelines)."""
        m, v = self.layout.micro_batches, self.layout.num_chunks
        forward, backward = self.stage_times(layers)
        pipeline = max(
            closed_form_pipeline(forward, backward, m, v, cf, cb, overlap_p2p=True)
            for cf, cb in self.p2p
        )
        tail = max(a(n) for a, n in zip(self.dp_sync, layers)) + max(
            a(n) for a, n in zip(self.optimizer, layers)
        )
        return pipeline + tail

    def stage_times(self, layers: Sequence[int]) -> tuple[list[float], list[float]]:
        """Per stage of a pipeline (chunk, when interleaved: stage ``c p + g`` is chunk c of
        group g), its forward and backward per micro-batch at the split ``layers``."""
        if self.layout.num_chunks == 1:
            return (
                [a(n) for a, n in zip(self.forward, layers)],
                [a(n) for a, n in zip(self.backward, layers)],
            )
        p, v = self.num_stages, self.layout.num_chunks
        chunks = [self.chunk_times(g, c, layers[g]) for c in range(v) for g in range(p)]
        return [f for f, _ in chunks], [b for _, b in chunks]

    def chunk_times(self, group: int, chunk: int, layers: int) -> tuple[float, float]:
        """(forward, backward) of chunk ``chunk`` of a device group holding ``layers`` layers,
        dealt out as :func:`~megatron_het.parallel.plan_builders.interleave_plan` does."""
        v = self.layout.num_chunks
        size = layers // v + (chunk < layers % v)
        fixed_f, fixed_b = self.chunk_fixed[group][chunk]
        return (
            self.forward[group].slope * size + fixed_f,
            self.backward[group].slope * size + fixed_b,
        )

    def chunk_time(self, group: int, chunk: int, layers: int) -> float:
        """Forward + backward of chunk ``chunk`` (:meth:`chunk_times`)."""
        return sum(self.chunk_times(group, chunk, layers))

    def simulated_time(self, layers: Sequence[int], cache: SimulationCache) -> float:
        """Like :meth:`iteration_time` with the event-driven 1F1B simulation for the pipeline
        (what ``predict`` reports by default). Plain pipelines only: an interleaved one's
        simulation needs per-chunk times."""
        if self.layout.num_chunks > 1:
            raise ValueError("simulated_time models plain (non-interleaved) layouts")
        m = self.layout.micro_batches
        forward, backward = self.stage_times(layers)
        pipeline = max(cache.makespan(forward, backward, m, cf, cb) for cf, cb in self.p2p)
        return (
            pipeline
            + max(a(n) for a, n in zip(self.dp_sync, layers))
            + max(a(n) for a, n in zip(self.optimizer, layers))
        )

    def memory_caps(self, extra_bytes: float = 0.0) -> list[int]:
        """The most layers each stage holds within its usable memory (plus ``extra_bytes``)."""
        caps = []
        for mem, usable in zip(self.memory, self.usable_bytes):
            room = usable + extra_bytes - mem.intercept
            caps.append(
                math.floor(room / mem.slope - 1e-9)
                if mem.slope > 0
                else (1 << 30 if room >= 0 else 0)
            )
        return caps

    def memory_shortfall(self, num_layers: int) -> tuple[float, int]:
        """The least, over splits, of the largest memory overrun of any device (bytes; <= 0
        when a split fits), and the stage with it at that split."""
        lo, hi = -max(self.usable_bytes), max(m(num_layers) for m in self.memory)
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if _fits_layers(self.memory_caps(mid), num_layers, self.min_layers):
                hi = mid
            else:
                lo = mid
        caps = self.memory_caps(hi)
        worst = max(
            range(self.num_stages),
            key=lambda s: self.memory[s](min(caps[s], num_layers)) - self.usable_bytes[s],
        )
        return hi, worst


def _fits_layers(caps: Sequence[int], num_layers: int, least: int = 1) -> bool:
    return min(caps) >= least and sum(caps) >= num_layers


def _affine(low: float, high: float, at_low: int = 1) -> Affine:
    """The line through ``(at_low, low)`` and ``(2 at_low, high)``."""
    slope = (high - low) / at_low
    return Affine(low - slope * at_low, slope)


def probe_stage_model(
    model: ModelConfig,
    layout: Layout,
    placement: Placement,
    cluster: ClusterSpec,
    seq_length: int,
    profiles: Mapping[str, Profile] | None,
    dtype: str,
    cache: SimulationCache,
    comm: CommCost | None = None,
    fused_elementwise: bool = True,
) -> StageModel:
    """Two closed-form predictions of ``layout`` (``v`` and ``2 v`` layers per stage or device
    group, ``v`` its chunks) -> its StageModel; ``comm``: a communication model to reuse;
    ``fused_elementwise``: as :func:`~megatron_het.perf.predict` prices the layers."""
    v, p = layout.num_chunks, layout.num_stages
    replicas = placement.distinct_pipelines(layout)
    probes: list[Prediction] = []
    for layers in (v, 2 * v):
        plan = build_plan(layout, [layers] * p, placement, dtype)
        probes.append(
            predict(
                model,
                plan,
                cluster,
                seq_length,
                profiles,
                options=RunOptions.from_plan(
                    plan, dtype=dtype, fused_elementwise=fused_elementwise
                ),
                pipeline_model="closed_form",
                cache=cache,
                validate=False,
                pipelines=replicas,
                comm=comm,
            )
        )
    n = v * p  # stages (chunks) of one pipeline
    sums = [_group_rows(probe.stages[:n], p) for probe in probes]
    one, two = probes[0].stages[:p], probes[1].stages[:p]
    usable = tuple(
        device_capacity_bytes(cluster.accelerator_of(a.ranks[0])) * (1.0 - RESERVED_FRACTION)
        for a in one
    )
    p2p = []
    for i in range(len(replicas)):
        rows = probes[0].stages[i * n : (i + 1) * n]
        pair = (
            tuple(r.p2p_forward_s for r in rows[:-1]),
            tuple(r.p2p_backward_s for r in rows[:-1]),
        )
        if pair not in p2p:
            p2p.append(pair)

    def line(low: float, high: float) -> Affine:
        return _affine(low, high, v)

    forward = tuple(line(a, b) for a, b in zip(sums[0][0], sums[1][0]))
    backward = tuple(line(a, b) for a, b in zip(sums[0][1], sums[1][1]))
    first = probes[0].stages[:n]  # one layer per chunk
    fixed = (
        tuple(
            tuple(
                (
                    first[c * p + g].forward_s - forward[g].slope,
                    first[c * p + g].backward_s - backward[g].slope,
                )
                for c in range(v)
            )
            for g in range(p)
        )
        if v > 1
        else ()
    )
    return StageModel(
        layout,
        forward=forward,
        backward=backward,
        dp_sync=tuple(line(a.dp_sync_s, b.dp_sync_s) for a, b in zip(one, two)),
        optimizer=tuple(line(a.optimizer_s, b.optimizer_s) for a, b in zip(one, two)),
        memory=tuple(line(a.memory.total_bytes, b.memory.total_bytes) for a, b in zip(one, two)),
        usable_bytes=usable,
        p2p=tuple(p2p),
        chunk_fixed=fixed,
    )


def _group_rows(rows: Sequence, groups: int) -> tuple[list[float], list[float]]:
    """Per device group (stage s on group s % groups), its chunks' forward and backward."""
    return (
        [sum(r.forward_s for r in rows[g::groups]) for g in range(groups)],
        [sum(r.backward_s for r in rows[g::groups]) for g in range(groups)],
    )


def layer_caps(stage_model: StageModel, num_layers: int, check_memory: bool = True) -> list[int]:
    """The most layers each stage may take: leave one for every other stage, and (with
    ``check_memory``) stay within the stage's usable memory."""
    most = num_layers - (stage_model.num_stages - 1) * stage_model.min_layers
    if not check_memory:
        return [most] * stage_model.num_stages
    return [min(c, most) for c in stage_model.memory_caps()]


def balance_layers(
    stage_model: StageModel, num_layers: int, polish: bool = True, check_memory: bool = True
) -> list[int] | None:
    """The layer count of every stage (sum ``num_layers``, each >= 1, within memory unless
    ``check_memory`` is False) that minimises :meth:`StageModel.iteration_time` (bisection on
    the cycle bottleneck, then :func:`polish_split`); None if no split fits in memory."""
    p, least = stage_model.num_stages, stage_model.min_layers
    caps = layer_caps(stage_model, num_layers, check_memory)
    if not _fits_layers(caps, num_layers, least):
        return None
    steady = [max(k) for k in zip(*stage_model.steady_p2p())]
    slope = [stage_model.forward[s].slope + stage_model.backward[s].slope for s in range(p)]
    base = [
        stage_model.forward[s].intercept + stage_model.backward[s].intercept + steady[s]
        for s in range(p)
    ]

    def units(cycle: float) -> list[int]:
        return [
            min(caps[s], math.floor((cycle - base[s]) / slope[s] + 1e-9))
            if slope[s] > 0
            else caps[s]
            for s in range(p)
        ]

    lo = max(base[s] + slope[s] * least for s in range(p))
    hi = max(base[s] + slope[s] * caps[s] for s in range(p))
    if sum(units(lo)) < num_layers:
        for _ in range(64):
            mid = 0.5 * (lo + hi)
            if sum(units(mid)) >= num_layers:
                hi = mid
            else:
                lo = mid
        lo = hi
    layers = [max(least, u) for u in units(lo)]
    excess = sum(layers) - num_layers
    for s in sorted(range(p), key=lambda s: -slope[s]):
        take = min(excess, layers[s] - least)
        layers[s] -= take
        excess -= take
    whole = _whole_chunks(layers, least, caps, num_layers)
    if whole is not None and (
        stage_model.iteration_time(whole) < stage_model.iteration_time(layers)
    ):
        layers = whole
    if polish:
        layers = polish_split(stage_model, layers, caps)
    return layers


def _whole_chunks(
    layers: Sequence[int], v: int, caps: Sequence[int], num_layers: int
) -> list[int] | None:
    """``layers`` rounded to multiples of ``v`` (largest remainders up, sum kept, caps
    respected), so that every chunk of a group has the same size; None for plain layouts or
    when ``v`` does not divide the model's layers."""
    if v == 1 or num_layers % v:
        return None
    units = [n / v for n in layers]
    whole = [max(1, min(int(u), caps[s] // v)) for s, u in enumerate(units)]
    order = sorted(range(len(units)), key=lambda s: whole[s] - units[s])
    left = num_layers // v - sum(whole)
    for s in order * 2:
        if left == 0:
            break
        step = 1 if left > 0 else -1
        if (step > 0 and (whole[s] + 1) * v <= caps[s]) or (step < 0 and whole[s] > 1):
            whole[s] += step
            left -= step
    return [u * v for u in whole] if left == 0 else None


def polish_split(
    stage_model: StageModel,
    layers: list[int],
    caps: Sequence[int],
    time_of: Callable[[Sequence[int]], float] | None = None,
) -> list[int]:
    """Move one layer at a time between stages while ``time_of`` (default: the closed-form
    :meth:`StageModel.iteration_time`) drops, best move first; returns the improved split."""
    time_of = time_of or stage_model.iteration_time
    layers = list(layers)
    best = time_of(layers)
    p, least = len(layers), stage_model.min_layers
    while True:
        move, move_time = None, best
        for i in range(p):
            if layers[i] <= least:
                continue
            for j in range(p):
                if j == i or layers[j] >= caps[j]:
                    continue
                layers[i] -= 1
                layers[j] += 1
                t = time_of(layers)
                layers[i] += 1
                layers[j] -= 1
                if t < move_time * (1 - 1e-12):
                    move, move_time = (i, j), t
        if move is None:
            return layers
        layers[move[0]] -= 1
        layers[move[1]] += 1
        best = move_time


__all__ = [
    "Affine",
    "StageModel",
    "balance_layers",
    "layer_caps",
    "polish_split",
    "probe_stage_model",
]
