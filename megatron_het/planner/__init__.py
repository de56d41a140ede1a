"""The automatic parallel planner: search plans with the performance predictor.

:func:`search_plan` enumerates layouts (accelerator kinds per pipeline position, TP and stages
per kind, DP, micro-batch size, recompute, ZeRO-1, sequence parallelism, interleaving; and
heterogeneous DP: replicas of one kind each with batch shares by speed), balances the layers
of each by speed under the devices' memory and returns the fastest by the simulated
prediction.
:func:`homogeneous_baseline` is HETHUB's reference (one search per accelerator kind, which a
mixed plan may pass) and :func:`compute_ceiling` the throughput no plan passes; a caller
attaches them: ``result.with_baseline(...)``, ``result.with_ceiling(...)``.
:func:`evaluate_plan` predicts a given plan. Charts (:mod:`megatron_het.planner.chart`)
import matplotlib only when drawn.
"""

from megatron_het.planner.baseline import homogeneous_baseline, kind_subcluster, why_above_baseline
from megatron_het.planner.ceiling import Ceiling, KindCeiling, compute_ceiling
from megatron_het.planner.evaluate import evaluate_plan
from megatron_het.planner.result import Candidate, HomogeneousBaseline, KindBaseline, SearchResult
from megatron_het.planner.search import search_plan

__all__ = [
    "Candidate",
    "Ceiling",
    "HomogeneousBaseline",
    "KindBaseline",
    "KindCeiling",
    "SearchResult",
    "compute_ceiling",
    "evaluate_plan",
    "homogeneous_baseline",
    "kind_subcluster",
    "search_plan",
    "why_above_baseline",
]
