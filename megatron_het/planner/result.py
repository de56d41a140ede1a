"""What the planner returns: a searched (or evaluated) plan, its candidates and the two
references its throughput is measured against.

- The homogeneous baseline (:mod:`megatron_het.planner.baseline`, the HETHUB paper's figure):
  the sum over kinds of devices x per-device tokens/s of the kind's best plan alone. A mixed
  plan can beat it (``efficiency`` > 1), for instance where a kind alone needs a wider TP than
  in the mix; :func:`megatron_het.planner.baseline.why_above_baseline` says why from the plans.
- The compute ceiling (:mod:`megatron_het.planner.ceiling`): every device computing at its
  best rate with no communication or bubble; no plan passes it (``ceiling_efficiency`` < 1).

Plain data shared by the search, the baseline (itself a search per kind), the ceiling and the
reports; the caller attaches the references (:meth:`SearchResult.with_baseline`,
:meth:`SearchResult.with_ceiling`), so neither search module imports the other's caller.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import Prediction
from megatron_het.planner.ceiling import Ceiling
from megatron_het.planner.kind_replicas import ReplicaLayout
from megatron_het.planner.space import Layout


@dataclass(frozen=True)
class Candidate:
    """A searched plan: its layout (every replica alike, or replicas of one kind each: then
    ``layers`` lists every kind's split in turn), layer split, closed-form time and (for the
    top ones) the simulated prediction."""

    layout: Layout | ReplicaLayout
    layers: tuple[int, ...]
    closed_form_s: float
    plan: ParallelPlan
    prediction: Prediction | None = None


@dataclass(frozen=True)
class KindBaseline:
    """One kind's share of the baseline: its best homogeneous plan's throughput per device.

    ``memory_ignored`` is True when the kind cannot hold the model alone, so its plan was
    searched without the memory limit (an optimistic figure for that kind). ``layout`` and
    the shares (of the kind's own prediction: bubble, TP communication over its stages'
    compute, DP sync over its iteration) let a report compare the kind's plan with the mix.
    """

    kind: str
    devices: int
    tokens_per_s_per_device: float
    plan_summary: str
    memory_ignored: bool = False
    layout: Layout | None = None
    bubble_fraction: float | None = None
    tp_comm_share: float | None = None
    dp_sync_share: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.devices * self.tokens_per_s_per_device


@dataclass(frozen=True)
class HomogeneousBaseline:
    """The baseline in tokens/s, its per-kind terms and the time its searches took."""

    kinds: tuple[KindBaseline, ...]
    search_time_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return sum(k.tokens_per_s for k in self.kinds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens_per_s": self.tokens_per_s,
            "search_time_s": self.search_time_s,
            "kinds": [
                {
                    "kind": k.kind,
                    "devices": k.devices,
                    "tokens_per_s_per_device": k.tokens_per_s_per_device,
                    "plan": k.plan_summary,
                    "memory_ignored": k.memory_ignored,
                }
                for k in self.kinds
            ],
        }


@dataclass(frozen=True)
class SearchResult:
    """The best plan and how it was found. ``search_time_s`` is the plan search alone;
    ``baseline`` (None until :meth:`with_baseline`) carries the time of its own searches;
    ``ceiling`` is None until :meth:`with_ceiling`."""

    plan: ParallelPlan
    prediction: Prediction
    candidates: tuple[Candidate, ...]
    layouts_evaluated: int
    search_time_s: float
    baseline: HomogeneousBaseline | None = None
    ceiling: Ceiling | None = None

    @property
    def efficiency(self) -> float | None:
        """Predicted tokens/s over the homogeneous baseline (None without it; may exceed 1)."""
        if self.baseline is None:
            return None
        return self.prediction.tokens_per_s / self.baseline.tokens_per_s

    @property
    def ceiling_efficiency(self) -> float | None:
        """Predicted tokens/s over the compute ceiling (None without it; below 1)."""
        if self.ceiling is None:
            return None
        return self.prediction.tokens_per_s / self.ceiling.tokens_per_s

    def with_baseline(self, baseline: HomogeneousBaseline) -> SearchResult:
        """This result with ``baseline`` attached (reports then show it and the efficiency)."""
        return replace(self, baseline=baseline)

    def with_ceiling(self, ceiling: Ceiling) -> SearchResult:
        """This result with ``ceiling`` attached (reports then show it and its efficiency)."""
        return replace(self, ceiling=ceiling)


__all__ = ["Candidate", "HomogeneousBaseline", "KindBaseline", "SearchResult"]
