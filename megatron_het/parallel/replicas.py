"""Which ranks hold which parameters when pipelines split the model differently.

Heterogeneous data parallelism sums gradients per parameter UNIT over every rank holding part
of it (:mod:`megatron_het.optim.replica_sync`); the predictor costs the same sums
(:mod:`megatron_het.perf.dp_sync`). Both read the units from here, a pure function of the plan
(no torch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron_het.parallel.plan import ParallelPlan


@dataclass(frozen=True)
class ReplicaUnit:
    """Parameters with the same holders in every pipeline: the embedding (``layers`` None,
    ``part`` "embedding"), decoder layers ``[start, stop)`` (``part`` "layers") or the head's
    final norm and output projection (``part`` "head")."""

    part: str
    layers: Optional[tuple[int, int]] = None

    def holds(self, name: str) -> bool:
        """Whether global parameter ``name`` belongs to this unit."""
        if self.part == "embedding":
            return name == "embedding.weight"
        if self.part == "head":
            return name in ("final_norm.weight", "output.weight")
        assert self.layers is not None
        if not name.startswith("layers."):
            return False
        return self.layers[0] <= int(name.split(".")[1]) < self.layers[1]


def uniform_layouts(plan: ParallelPlan) -> bool:
    """Whether every pipeline splits the model alike (same stages, layers and tp): then a
    stage's DP replicas hold identical shards and sum them rank by rank over ``dp``."""
    def layout(pipeline: Any) -> tuple:
        return tuple((s.layers, s.tp) for s in pipeline.stages) + (pipeline.pp_size,)
    return len({layout(p) for p in plan.pipelines}) == 1


def replica_units(plan: ParallelPlan, num_layers: int,
                  tie_embeddings: bool) -> list[tuple[ReplicaUnit, tuple[int, ...]]]:
    """Every parameter unit and the ranks holding part of it in any pipeline, consecutive
    layers with the same holders merged; the embedding's holders include the last stages
    (their copy of a tied embedding)."""
    def holders(test: Any) -> tuple[int, ...]:
        return tuple(sorted({r for p in plan.pipelines for st in p.stages if test(st)
                             for r in st.ranks}))
    units = [(ReplicaUnit("embedding"), holders(
        lambda st: st.has_embedding or (tie_embeddings and st.has_head)))]
    start = 0
    for i in range(1, num_layers + 1):
        here = holders(lambda st, i=i: st.layers[0] <= i - 1 < st.layers[1])
        nxt = (holders(lambda st, i=i: st.layers[0] <= i < st.layers[1])
               if i < num_layers else None)
        if here != nxt:
            units.append((ReplicaUnit("layers", (start, i)), here))
            start = i
    units.append((ReplicaUnit("head"), holders(lambda st: st.has_head)))
    return units


def owned_rows(full_rows: int, first: int, count: int, pipeline: int,
               num_pipelines: int) -> tuple[int, int]:
    """ZeRO-1 across replicas of different layouts: the rows ``[a, b)`` (local to a TP box of
    rows ``[first, first + count)``) that pipeline ``pipeline``'s contributing rank owns, its
    block of ``full_rows`` rows split evenly over ``num_pipelines``; ``(0, 0)`` if none."""
    lo = full_rows * pipeline // num_pipelines
    hi = full_rows * (pipeline + 1) // num_pipelines
    a, b = max(lo, first), min(hi, first + count)
    return (a - first, b - first) if a < b else (0, 0)
