"""The automatic parallel planner: search plans with the performance predictor.

:func:`search_plan` enumerates layouts (accelerator kinds per pipeline position, TP and stages
per kind, DP, micro-batch size, recompute, ZeRO-1), balances the layers of each by speed under
the devices' memory and returns the fastest by the simulated prediction, with the theoretical
upper bound (:func:`upper_bound`) and the efficiency. :func:`evaluate_plan` predicts a given plan.
"""
from megatron_het.planner.evaluate import evaluate_plan
from megatron_het.planner.search import Candidate, SearchResult, search_plan
from megatron_het.planner.upper_bound import KindBound, UpperBound, kind_subcluster, upper_bound

__all__ = ["Candidate", "KindBound", "SearchResult", "UpperBound", "evaluate_plan",
           "kind_subcluster", "search_plan", "upper_bound"]
