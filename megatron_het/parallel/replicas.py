"""Which ranks hold which parameters when pipelines split the model differently.

Heterogeneous data parallelism sums gradients per parameter UNIT over every rank holding part
of it (:mod:`megatron_het.optim.replica_sync`); the predictor costs the same sums
(:mod:`megatron_het.perf.cost.dp_sync`). Both read the units from here, a pure function of the plan
(no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import LayerBound, block_of


@dataclass(frozen=True)
class ReplicaUnit:
    """Parameters with the same holders in every pipeline: the embedding (``layers`` None,
    ``part`` "embedding"), decoder layers ``[start, stop)`` (``part`` "layers"; a bound may be
    a half-layer bound ``x.5``) or the head's final norm and output projection (``part``
    "head")."""

    part: str
    layers: tuple[LayerBound, LayerBound] | None = None

    def holds(self, name: str) -> bool:
        """Whether global parameter ``name`` belongs to this unit."""
        if self.part == "embedding":
            return name == "embedding.weight"
        if self.part == "head":
            return name in ("final_norm.weight", "output.weight")
        assert self.layers is not None
        if not name.startswith("layers."):
            return False
        return 2 * self.layers[0] <= block_of(name) < 2 * self.layers[1]


def uniform_layouts(plan: ParallelPlan) -> bool:
    """Whether every pipeline splits the model alike (same stages, layers and tp): then a
    stage's DP replicas hold identical shards and sum them rank by rank over ``dp``."""

    def layout(pipeline: Any) -> tuple:
        return tuple((s.layers, s.tp) for s in pipeline.stages) + (pipeline.pp_size,)

    return len({layout(p) for p in plan.pipelines}) == 1


def replica_units(
    plan: ParallelPlan, num_layers: int, tie_embeddings: bool
) -> list[tuple[ReplicaUnit, tuple[int, ...]]]:
    """Every parameter unit and the ranks holding part of it in any pipeline, consecutive
    layers with the same holders merged; the embedding's holders include the last stages
    (their copy of a tied embedding)."""

    def holders(test: Any) -> tuple[int, ...]:
        return tuple(
            sorted({r for p in plan.pipelines for st in p.stages if test(st) for r in st.ranks})
        )

    units = [
        (
            ReplicaUnit("embedding"),
            holders(lambda st: st.has_embedding or (tie_embeddings and st.has_head)),
        )
    ]
    start = 0  # in half-layer blocks: 2 i is layer i's attention block, 2 i + 1 its MLP block
    for b in range(1, 2 * num_layers + 1):
        here = holders(lambda st, b=b: 2 * st.layers[0] <= b - 1 < 2 * st.layers[1])
        nxt = (
            holders(lambda st, b=b: 2 * st.layers[0] <= b < 2 * st.layers[1])
            if b < 2 * num_layers
            else None
        )
        if here != nxt:
            units.append((ReplicaUnit("layers", (_bound(start), _bound(b))), here))
            start = b
    units.append((ReplicaUnit("head"), holders(lambda st: st.has_head)))
    return units


def _bound(block: int) -> LayerBound:
    """A position in half-layer blocks as a layer bound: 6 -> 3, 7 -> 3.5."""
    return block // 2 if block % 2 == 0 else block / 2


def owned_rows(
    full_rows: int, first: int, count: int, pipeline: int, num_pipelines: int
) -> tuple[int, int]:
    """ZeRO-1 across replicas of different layouts: the rows ``[a, b)`` (local to a TP box of
    rows ``[first, first + count)``) that pipeline ``pipeline``'s contributing rank owns, its
    block of ``full_rows`` rows split evenly over ``num_pipelines``; ``(0, 0)`` if none."""
    lo = full_rows * pipeline // num_pipelines
    hi = full_rows * (pipeline + 1) // num_pipelines
    a, b = max(lo, first), min(hi, first + count)
    return (a - first, b - first) if a < b else (0, 0)
