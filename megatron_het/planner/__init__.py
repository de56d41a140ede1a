"""The automatic parallel planner: search plans with the performance predictor.

:func:`search_plan` enumerates layouts (accelerator kinds per pipeline position, TP and stages
per kind, DP, micro-batch size, recompute, ZeRO-1), balances the layers of each by speed under
the devices' memory and returns the fastest by the simulated prediction. :func:`upper_bound` is
the theoretical bound (one search per accelerator kind); a caller that wants the efficiency
attaches it: ``result.with_upper_bound(upper_bound(...))``. :func:`evaluate_plan` predicts a
given plan. Charts (:mod:`megatron_het.planner.chart`) import matplotlib only when drawn.
"""
from megatron_het.planner.evaluate import evaluate_plan
from megatron_het.planner.result import Candidate, KindBound, SearchResult, UpperBound
from megatron_het.planner.search import search_plan
from megatron_het.planner.upper_bound import kind_subcluster, upper_bound

__all__ = ["Candidate", "KindBound", "SearchResult", "UpperBound", "evaluate_plan",
           "kind_subcluster", "search_plan", "upper_bound"]
