"""What splitting the model at layer bounds costs a plan (the planner's report).

A pipeline's steady pace is set by its busiest device group: the compute (forward + backward,
TP communication included) of all its chunks per micro-batch. Bounds fall between layers (or
between a layer's attention and MLP blocks), so the groups of a mixed pipeline rarely match:
with whole layers, Llama-140B on the HETHUB mix puts 8 layers on each accelerator-a group and
4 on each MI250X group, and the MI250X groups wait. This module puts
that loss in one figure: the busiest group's time against the time every group would take
were layers divisible at will (each group keeping its embedding or head, every layer costing
what it costs on that group; a water-filling of the pipeline's layers over its groups).

Per-layer times come from a group's chunks of whole layers without the embedding or the head
(else from such a chunk of the same kind and TP; else the end is counted as layers). Only
pipelines of one layout are read (heterogeneous data parallelism balances by batch shares
instead).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.replicas import uniform_layouts
from megatron_het.perf import Prediction, StagePrediction

# Bisection steps on the divisible time (relative precision far below the predictor's).
STEPS = 60


@dataclass(frozen=True)
class LayerSplit:
    """``busiest_s``: the busiest device group's compute per micro-batch; ``divisible_s``:
    the busiest group's with layers divisible at will."""

    busiest_s: float
    divisible_s: float

    @property
    def loss(self) -> float:
        """How much longer the layer bounds make the busiest group: busiest / divisible - 1."""
        return self.busiest_s / self.divisible_s - 1.0

    def describe(self) -> str:
        return (
            f"the busiest device group computes {1e3 * self.busiest_s:.1f} ms "
            f"per micro-batch; with layers divisible at will {1e3 * self.divisible_s:.1f} "
            f"ms (the layer bounds cost {100 * self.loss:.1f}%)"
        )


def _busy(row: StagePrediction) -> float:
    return row.forward_s + row.backward_s


def layer_split(prediction: Prediction, plan: ParallelPlan) -> LayerSplit | None:
    """The layer-bound loss of pipeline 0 (None for pipelines of different layouts or a
    pipeline of one device group)."""
    if not uniform_layouts(plan):
        return None
    pipeline = plan.pipelines[0]
    if pipeline.pp_size < 2:
        return None
    rows = [r for r in prediction.stages if r.pipeline == 0]
    last = len(rows) - 1

    def plain(r: StagePrediction) -> bool:  # whole layers, neither the embedding nor the head
        return (
            0 < r.stage < last
            and r.layers[1] > r.layers[0]
            and all(bound == int(bound) for bound in r.layers)
        )

    per_layer: dict[tuple[str, int], float] = {}
    for r in rows:
        if plain(r):
            per_layer.setdefault((r.accelerator, r.tp), _busy(r) / (r.layers[1] - r.layers[0]))
    groups = []  # (fixed seconds, seconds per layer, layers) per device group
    for g in range(pipeline.pp_size):
        chunks = [rows[s] for s in pipeline.group_stages(g)]
        layers = sum(r.layers[1] - r.layers[0] for r in chunks)
        busy = sum(_busy(r) for r in chunks)
        t = per_layer.get((chunks[0].accelerator, chunks[0].tp))
        if t is None:
            t = busy / layers if layers else 0.0
        fixed = max(0.0, busy - t * layers)
        groups.append((fixed, t, layers))
    total_layers = sum(n for _, _, n in groups)
    busiest = max(f + t * n for f, t, n in groups)

    def layers_within(time_s: float) -> float:
        return sum(max(0.0, (time_s - f) / t) for f, t, _ in groups if t > 0)

    lo, hi = max(f for f, _, _ in groups), busiest
    for _ in range(STEPS):
        mid = (lo + hi) / 2
        if layers_within(mid) >= total_layers:
            hi = mid
        else:
            lo = mid
    return LayerSplit(busiest, hi)
