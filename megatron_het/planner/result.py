"""What the planner returns: a searched (or evaluated) plan, its candidates and the upper bound.

Plain data shared by the search (:mod:`megatron_het.planner.search`), the bound
(:mod:`megatron_het.planner.upper_bound`, itself a search per kind) and the reports; the caller
composes a plan with its bound (:meth:`SearchResult.with_upper_bound`), so neither search module
imports the other's caller.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import Prediction
from megatron_het.planner.space import Layout


@dataclass(frozen=True)
class Candidate:
    """A searched plan: its layout, layer split, closed-form time and (for the top ones) the
    simulated prediction."""

    layout: Layout
    layers: tuple[int, ...]
    closed_form_s: float
    plan: ParallelPlan
    prediction: Optional[Prediction] = None


@dataclass(frozen=True)
class KindBound:
    """One kind's share of the bound: its best homogeneous plan's throughput per device.

    ``memory_ignored`` is True when the kind cannot hold the model alone, so its plan was
    searched without the memory limit (an optimistic figure for that kind).
    """

    kind: str
    devices: int
    tokens_per_s_per_device: float
    plan_summary: str
    memory_ignored: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.devices * self.tokens_per_s_per_device


@dataclass(frozen=True)
class UpperBound:
    """The bound in tokens/s, its per-kind terms and the time its searches took."""

    kinds: tuple[KindBound, ...]
    search_time_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return sum(k.tokens_per_s for k in self.kinds)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens_per_s": self.tokens_per_s, "search_time_s": self.search_time_s,
                "kinds": [{"kind": k.kind, "devices": k.devices,
                           "tokens_per_s_per_device": k.tokens_per_s_per_device,
                           "plan": k.plan_summary, "memory_ignored": k.memory_ignored}
                          for k in self.kinds]}


@dataclass(frozen=True)
class SearchResult:
    """The best plan and how it was found. ``search_time_s`` is the plan search alone;
    ``upper_bound`` (None until :meth:`with_upper_bound`) carries the time of its own
    searches."""

    plan: ParallelPlan
    prediction: Prediction
    candidates: tuple[Candidate, ...]
    layouts_evaluated: int
    search_time_s: float
    upper_bound: Optional[UpperBound] = None

    @property
    def efficiency(self) -> Optional[float]:
        """Predicted tokens/s over the theoretical upper bound (None without a bound)."""
        if self.upper_bound is None:
            return None
        return self.prediction.tokens_per_s / self.upper_bound.tokens_per_s

    def with_upper_bound(self, bound: UpperBound) -> "SearchResult":
        """This result with ``bound`` attached (reports then show the bound and efficiency)."""
        return replace(self, upper_bound=bound)


__all__ = ["Candidate", "KindBound", "SearchResult", "UpperBound"]
